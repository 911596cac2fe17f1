"""The run's metrics in the Prometheus text exposition format (version 0.0.4), built
from the handle's status and islands, so `/metrics` works without Ray's metrics agent.
Islands that left the run (drained, dead, quarantined) have no series."""

from __future__ import annotations

from typing import Any

from orchestrator.engine.views import ISLAND_METRICS, RUN_METRICS, current


def _label(value: Any) -> str:
    """Escape a label value as the exposition format requires (backslash, newline, quote)."""
    return str(value).replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: Any) -> str | None:
    if value is None or isinstance(value, bool):
        return None if value is None else str(int(value))
    return repr(float(value))


def render(status: dict[str, Any], islands: dict[str, dict[str, Any]]) -> str:
    run = _label(status.get("run_id", ""))
    islands = current(islands)
    lines: list[str] = []
    for name, key, help_text, kind in RUN_METRICS:
        value = _number(status.get(key))
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        if value is not None:
            lines.append(f'{name}{{run_id="{run}"}} {value}')
    for name, key, help_text, kind in ISLAND_METRICS:
        lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        for island, stats in sorted(islands.items(), key=lambda kv: int(kv[0])):
            value = _number(stats.get(key))
            if value is not None:
                lines.append(
                    f'{name}{{run_id="{run}",island="{_label(island)}",state="{_label(stats.get("state"))}"}} {value}'
                )
    return "\n".join(lines) + "\n"
