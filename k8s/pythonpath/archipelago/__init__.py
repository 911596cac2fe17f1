"""Archipelago: one model trained across islands of accelerators joined by slow links, on Ray.

The package's root: its version and the Python API (`archipelago.orchestrator.library`:
`config`, `plan`, `run`, `summary`, `commit`), each imported on first use so that
`import archipelago` stays light (the command imports it before anything else). Its code
lives in the three folders mapped below it (`archipelago.orchestrator`, `.workers`, `.api`);
this file sits in k8s/pythonpath, the package's view under its import name.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

API = ("ConfigError", "RunConfig", "commit", "config", "plan", "run", "summary", "version")
__all__ = ["__version__", *API]


def __getattr__(name: str) -> Any:
    if name == "__version__":  # without the library's imports (pydantic's models)
        return import_module("archipelago.orchestrator.build_info").version()
    if name in API:
        return getattr(import_module("archipelago.orchestrator.library"), name)
    raise AttributeError(f"module 'archipelago' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
