"""Coordinator side of Archipelago: config, outer optimizers, aggregation, the coordinator, the CLI.

The distribution's three top-level packages have generic names (`orchestrator`, `workers`,
`api`: the layout is fixed), so another `api` or `workers` earlier on `sys.path` — a
folder of that name in the working directory, another distribution — would be imported in
their place and fail far from the cause. They are checked to be this one's siblings when
the package is imported (`importlib.util.find_spec` locates them without importing them).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def _check_siblings() -> None:
    home = Path(__file__).resolve().parent.parent
    for name in ("workers", "api"):
        spec = importlib.util.find_spec(name)
        found = Path(spec.origin).resolve().parent.parent if spec is not None and spec.origin else None
        if found != home:
            where = spec.origin if spec is not None else "nowhere"
            raise ImportError(
                f"Archipelago's `{name}` package should be {home / name}, but Python finds {where}: another "
                f"`{name}` comes earlier on sys.path (a folder in the working directory, another distribution); "
                "run from another directory or install Archipelago in its own virtual environment"
            )


_check_siblings()
