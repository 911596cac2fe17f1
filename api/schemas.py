"""Request bodies of the control-plane API (validated; unknown fields rejected). The settings
body is the engine's own `SettingsUpdate`: the mid-run settings schema exists once."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class _Body(BaseModel):
    """Unknown fields and loose types refused: `true`, `"2"` and `2.0` are not a count."""

    model_config = ConfigDict(extra="forbid", strict=True)


class AddIslands(_Body):
    count: int = Field(1, ge=1, le=64, description="islands to add", examples=[2])


class Target(_Body):
    target: int = Field(..., ge=0, le=1024, description="desired number of islands (idempotent)", examples=[4])


class Accepted(BaseModel):
    accepted: bool = True
    detail: dict = Field(default_factory=dict)
