"""The names of a run's Ray actors and the namespace they live in, in one place, so the
runtime, the control plane and tests agree on them (the engine knows none of them)."""

from __future__ import annotations

NAMESPACE = "archipelago"


def island_name(run_id: str, index: int) -> str:
    return f"archipelago-{run_id}-island-{index}"


def coordinator_name(run_id: str) -> str:
    return f"archipelago-{run_id}-coordinator"


def run_id_of_coordinator(name: str) -> str | None:
    """The run id in a coordinator actor's name, or None if `name` is not one."""
    prefix, suffix = "archipelago-", "-coordinator"
    return name[len(prefix) : -len(suffix)] if name.startswith(prefix) and name.endswith(suffix) else None


def slice_name(run_id: str, k: int, incarnation: str) -> str:
    return f"archipelago-{run_id}-slice-{k}-{incarnation}"
