"""Network faults as testbed scenarios, each run with the shipped defaults and real timing,
each with its evidence and a pass: every round finishes, every batch read is trained once
(the shards' tokens are the run's), the control plane answers every read within 2 s with
no 5xx (polled from outside the head, as a user's client would) and answers with the
coordinator's own view again within 30 s of losing it, and the run's events say
what happened (the losses and replacements each scenario expects, and no others).

- `partition_10s`: an island's link down 10 s — nothing lost, no replacement.
- `partition_90s`: 90 s — Ray declares the node dead: one loss, one replacement (on a
  spare machine), every batch once.
- `degraded_link`: an island's link at a tenth for a minute — nothing lost.
- `slow_transfer`: every transfer of one island takes ≈ 90 s (past the 60-s hang floor) —
  never declared hung (`docs/testbed/slow-download.yaml`).
- `head_saturated`: four islands at 100 Mbit/s behind a 20-Mbit/s head card — every
  transfer through it at once; nothing lost.
- `slice_lost`: a coordinator slice's node (`coordinator.shards: 2`, a slice a machine)
  SIGKILLed and started again 10 s later — no island lost.
- `raylet_killed`: an island's raylet SIGKILLed, its node started again 10 s later (a
  kubelet restarting the pod) — one loss, one replacement.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from archipelago.orchestrator.bench.netlab_cluster import Role
from archipelago.orchestrator.bench.netlab_scenario import (
    Fault,
    FaultKind,
    Link,
    MachineSpec,
    Scenario,
    Testbed,
    keep,
    kept,
)

API_PORT = 8600
ANSWER_S = 2.0  # the control plane's answer, at most
STALE_S = 30.0  # the longest the control plane may answer without the coordinator's own answer (a restart's)
FAST = Link(up_mbit=100, down_mbit=100)
RUN = ["--set=warm_start.steps=0", "--set=inner_steps=20", "--set=api.enabled=true", "--set=api.host=0.0.0.0"]


@dataclass(frozen=True)
class Case:
    name: str
    scenario: Scenario
    islands: int
    rounds: int
    losses: int  # islands the run is expected to lose (and replace)
    extra: tuple[str, ...] = ()
    # a silence past the hang floor (a cut longer than it): a loss found as a hang is the
    # rule working, not a transfer taken for one
    silent_past_floor: bool = False


def _machines(count: int, first: Link = FAST, spare: int = 0) -> list[MachineSpec]:
    links = [first] + [FAST] * (count + spare - 1)
    return [MachineSpec(name=f"island{i}", role=Role.ISLAND, cpus=1, link=link) for i, link in enumerate(links)]


def cases() -> list[Case]:
    head = Link(up_mbit=1000, down_mbit=1000)

    def fault(kind: FaultKind, for_s: float, machine: str = "island0", **kw: Any) -> Fault:
        return Fault(kind=kind, machine=machine, after_round=2, at_s=0, for_s=for_s, **kw)

    out = [
        Case(
            "partition_10s",
            Scenario(head=head, machines=_machines(2), faults=[fault(FaultKind.PARTITION, 10)]),
            2,
            8,
            0,
        ),
        Case(
            "partition_90s",
            Scenario(head=head, machines=_machines(2, spare=1), faults=[fault(FaultKind.PARTITION, 90)]),
            2,
            14,
            1,
            silent_past_floor=True,
        ),
        Case(
            "degraded_link",
            Scenario(
                head=head,
                machines=_machines(2),
                faults=[fault(FaultKind.DEGRADE, 60, link=Link(up_mbit=10, down_mbit=10))],
            ),
            2,
            10,
            0,
        ),
        Case(
            "head_saturated",
            Scenario(head=Link(up_mbit=20, down_mbit=20), machines=_machines(4)),
            4,
            4,
            0,
        ),
        Case(
            "raylet_killed",
            Scenario(head=head, machines=_machines(2), faults=[fault(FaultKind.KILL_RAYLET, 10, machine="island1")]),
            2,
            12,
            1,
        ),
    ]
    slices = [MachineSpec(name=f"slice{i}", role=Role.SLICE, cpus=0, link=FAST) for i in range(2)]
    out.append(
        Case(
            "slice_lost",
            Scenario(
                head=head,
                machines=[*_machines(2), *slices],
                faults=[fault(FaultKind.KILL_RAYLET, 10, machine="slice0")],
            ),
            2,
            10,
            0,
            ("--set=coordinator.shards=2", "--set=coordinator.slice_resource=archipelago_slice"),
        )
    )
    slow = Link(up_mbit=2.5, down_mbit=2.5)
    out.append(
        Case(
            "slow_transfer",
            Scenario(
                head=head,
                machines=_machines(2, first=slow),
                system_config={"object_manager_pull_timeout_ms": 300_000},
            ),
            2,
            2,
            0,
            ('--set=task.kwargs={"d_model": 384, "n_layers": 4, "n_heads": 4}', "--set=inner_steps=5"),
        )
    )
    return out


class Poller:
    """Reads `GET /v1/run` every second from outside the head, as a user's client: the
    slowest answer and every status that was not 200."""

    def __init__(self, url: str, token: str) -> None:
        self.url, self.token = url, token
        self.answers: list[tuple[float, int, float, bool]] = []  # (when, status, seconds, the coordinator current)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.wait(1.0):
            request = urllib.request.Request(self.url, headers={"Authorization": f"Bearer {self.token}"})
            began = time.monotonic()
            current = False
            try:
                with urllib.request.urlopen(request, timeout=10) as reply:
                    status = reply.status
                    current = json.loads(reply.read()).get("coordinator") == "running"
            except urllib.error.HTTPError as err:
                status = err.code
            except (urllib.error.URLError, OSError, ValueError):  # no answer (refused, or its 10 s passed): status 0
                status = 0
            self.answers.append((round(began - t0, 2), status, round(time.monotonic() - began, 3), current))

    def close(self) -> dict[str, Any]:
        """The reads from the first answer to the last: before, the control plane was not
        serving yet (the run starting); after, it was gone (the run ended). Between, a read
        that got no answer is one, as slow as it waited."""
        self._stop.set()
        self._thread.join(timeout=15)
        served = [i for i, a in enumerate(self.answers) if a[1] != 0]
        answers = self.answers[served[0] : served[-1] + 1] if served else []
        stale, longest = staleness(answers)
        return {
            "reads": len(answers),
            "slowest_s": max((a[2] for a in answers), default=None),
            "not_ok": [a for a in answers if a[1] != 200],
            "slow": [a for a in answers if a[2] > ANSWER_S / 2],  # (when, status, seconds, current): where to look
            "stale": stale,
            "longest_stale_s": round(longest, 2),
        }


def staleness(answers: list[tuple[float, int, float, bool]]) -> tuple[int, float]:
    """Answers that were not the coordinator's own (the last one seen, or a 409), and the
    longest stretch of them in seconds, from the first to the last of a run of them."""
    stale, longest, since = 0, 0.0, None
    for when, _, _, current in answers:
        if current:
            since = None
            continue
        stale += 1
        since = when if since is None else since
        longest = max(longest, when - since)
    return stale, longest


def run_case(case: Case, work: Path) -> dict[str, Any]:
    out = work / case.name
    if (earlier := kept(out)) is not None:
        return earlier
    out.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    with Testbed(case.scenario, out / "logs") as bed:
        assert bed.net is not None
        argv = bed.archipelago_run(
            out / "run", f"--set=islands.count={case.islands}", f"--set=rounds={case.rounds}", *RUN, *case.extra
        )
        poller = Poller(f"http://{bed.net.machines['head'].address}:{API_PORT}/v1/run", token)
        report = bed.run(
            argv, out / "run.log", out / "run" / "metrics.jsonl", 1800, env={"ARCHIPELAGO_API_TOKEN": token}
        )
        api = poller.close()
    summary = json.loads((out / "run" / "summary.json").read_text())
    events = [json.loads(x) for x in (out / "run" / "events.jsonl").read_text().splitlines() if x.strip()]
    return keep(out, judge(case, report, summary, events, api))


def judge(
    case: Case, report: dict[str, Any], summary: dict[str, Any], events: list[dict[str, Any]], api: dict[str, Any]
) -> dict[str, Any]:
    """The case's evidence and its pass, each criterion by itself."""
    kinds = [e["kind"] for e in events]
    losses = sorted({e["island"] for e in events if e["kind"] == "crash"})
    replacements = kinds.count("requested") - case.islands
    hung = [e for e in events if e["kind"] == "crash" and str(e.get("reason", "")).startswith("hung")]
    checks = {
        "finished": report["rc"] == 0 and summary["rounds_done"] == case.rounds,
        "trained_once": sum(summary["shards"]["tokens"]) == summary["tokens"],
        "losses_as_expected": len(losses) == case.losses and replacements == case.losses,
        "no_false_hang": not hung or (case.silent_past_floor and len(hung) <= case.losses),
        "api_within_2s": api["reads"] > 0 and (api["slowest_s"] or 0) <= ANSWER_S,
        "api_no_5xx": not [a for a in api["not_ok"] if a[1] >= 500],
        "api_always_answered": not [a for a in api["not_ok"] if a[1] == 0],
        # answered, but with the coordinator's own answer again within STALE_S: a coordinator
        # that never answered again would pass the 2 s on its last answer forever
        "api_current": api.get("longest_stale_s", 0.0) <= STALE_S,
    }
    return {
        "pass": all(checks.values()),
        "checks": checks,
        "seconds": report["seconds"],
        "faults": report["faults"],
        "card_bytes": report["card_bytes"],
        "payload_bytes": summary["bytes_communicated"],
        "rounds_done": summary["rounds_done"],
        "losses": losses,
        "replacements": replacements,
        "events": [
            {k: v for k, v in e.items() if k in ("kind", "island", "reason", "state")}
            for e in events
            if e["kind"] not in ("checkpoint",)
        ],
        "api": api,
    }
