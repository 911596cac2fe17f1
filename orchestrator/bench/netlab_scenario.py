"""A testbed scenario: the machines (a head, islands, coordinator slices, evaluation nodes),
each link's rate up and down, the head card's rate, Ray's settings, the command to run
on the head, and timed faults — a partition (a link down for S seconds), a degraded link
(a rate change for S seconds), a node's raylet SIGKILLed and its node started again S
seconds later (a kubelet restarting a pod), a process frozen with SIGSTOP for S seconds.

A YAML file is read into `Scenario` (strict: a misspelt key is an error naming it), and
`Testbed` brings it up (`netlab.py`, `netlab_cluster.py`), runs its command with the
faults on their timers, and reports what crossed every card and when each fault fired."""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from archipelago.orchestrator.bench.netlab import CardBytes, Network, Rate
from archipelago.orchestrator.bench.netlab_cluster import RAY_PORT, Node, Role, in_machine, ray_env, wait_for_nodes

log = logging.getLogger(__name__)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Link(Strict):
    up_mbit: float = Field(gt=0, le=100_000, description="what the machine sends, Mbit/s")
    down_mbit: float = Field(gt=0, le=100_000, description="what the machine receives, Mbit/s")

    def rate(self) -> Rate:
        return Rate(up_mbit=self.up_mbit, down_mbit=self.down_mbit)


class MachineSpec(Strict):
    name: str = Field(pattern=r"^[a-z][a-z0-9]{0,9}$", description="short: it names the namespace")
    role: Role
    cpus: float = Field(1.0, ge=0, description="Ray CPUs the node offers (islands take islands.cpus each)")
    link: Link


class FaultKind(str, Enum):
    PARTITION = "partition"  # the machine's link down for `for_s`
    DEGRADE = "degrade"  # the machine's link at `link` for `for_s`, then back
    KILL_RAYLET = "kill_raylet"  # SIGKILL of its raylet (and the node's processes), restarted `for_s` later
    FREEZE = "freeze"  # SIGSTOP of its processes matching `process` for `for_s`, then SIGCONT


class Fault(Strict):
    kind: FaultKind
    machine: str
    at_s: float = Field(ge=0, description="seconds after `after_round` rounds are recorded (0: the command's start)")
    after_round: int = Field(0, ge=0, description="wait for this many records in the run's metrics.jsonl first")
    for_s: float = Field(gt=0, description="how long the fault lasts (kill_raylet: until the node starts again)")
    link: Link | None = Field(None, description="degrade: the link's rates meanwhile")
    process: str = Field("IslandActor", description="freeze: processes whose command line contains this")

    @model_validator(mode="after")
    def _link_for_degrade(self) -> Fault:
        if self.kind == FaultKind.DEGRADE and self.link is None:
            raise ValueError("a degrade fault needs `link` (its rates meanwhile)")
        return self


class Scenario(Strict):
    head: Link = Field(description="the head's card")
    machines: list[MachineSpec] = Field(min_length=1)
    system_config: dict[str, Any] = Field(
        default_factory=dict, description="Ray's _system_config on the head (health checks, timeouts)"
    )
    run: list[str] = Field(
        default_factory=list, description="arguments of `archipelago run` on the head (ray.address is set)"
    )
    faults: list[Fault] = Field(default_factory=list)

    @model_validator(mode="after")
    def _names(self) -> Scenario:
        names = [m.name for m in self.machines]
        if len(set(names)) != len(names) or "head" in names:
            raise ValueError("machine names must be unique and not `head`")
        for f in self.faults:
            if f.machine not in names:
                raise ValueError(f"a {f.kind.value} fault names machine {f.machine!r}, which the scenario lacks")
        return self


def load(path: Path) -> Scenario:
    """The scenario in `path` (ValueError naming the field if it is not one)."""
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ValueError(f"{path} is not YAML: {err}") from err
    return Scenario.model_validate(data)


class Testbed:
    """A scenario's machines and Ray nodes, up: `with Testbed(scenario, logs) as bed:`.
    Everything is removed on leaving, on an error and on Ctrl-C too (`netlab.sweep`)."""

    def __init__(self, scenario: Scenario, logs: Path, ray: bool = True) -> None:
        self.scenario, self.logs, self.ray = scenario, logs, ray
        self.net: Network | None = None
        self.nodes: dict[str, Node] = {}
        self.fired: list[dict[str, Any]] = []

    def __enter__(self) -> Testbed:
        previous = signal.getsignal(signal.SIGTERM)
        signal.signal(signal.SIGTERM, _as_interrupt)  # a killed command sweeps too
        self._previous = previous
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        self.net = Network()
        head = self.net.add("head", self.scenario.head.rate())
        for m in self.scenario.machines:
            self.net.add(m.name, m.link.rate())
        if not self.ray:
            return
        config = self.scenario.system_config
        self.nodes["head"] = Node(head, Role.HEAD, head.address, 0, config, self.logs)
        for m in self.scenario.machines:
            self.nodes[m.name] = Node(self.net.machines[m.name], m.role, head.address, m.cpus, None, self.logs)
        self.nodes["head"].start()
        wait_for_nodes(head, 1)
        for name, node in self.nodes.items():
            if name != "head":
                node.start()
        wait_for_nodes(head, len(self.nodes))
        log.info("testbed up: %d machines, Ray at %s:%d", len(self.nodes), head.address, RAY_PORT)

    def down(self) -> None:
        if self.net is not None:
            self.net.close()
            self.net = None
        signal.signal(signal.SIGTERM, getattr(self, "_previous", signal.SIG_DFL))

    @property
    def address(self) -> str:
        assert self.net is not None
        return f"{self.net.machines['head'].address}:{RAY_PORT}"

    def cards(self) -> dict[str, CardBytes]:
        assert self.net is not None
        return self.net.cards()

    def on_head(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """`argv` run on the head as a driver (RAY_ADDRESS set), its output in `log_path`."""
        assert self.net is not None
        env = ray_env() | {"RAY_ADDRESS": self.address} | (env or {})
        with log_path.open("wb") as out:
            return subprocess.Popen(
                in_machine(self.net.machines["head"], argv), stdout=out, stderr=subprocess.STDOUT, env=env
            )

    def archipelago_run(self, out_dir: Path, *args: str) -> list[str]:
        """`archipelago run` on this testbed's cluster, its outputs in `out_dir`."""
        return ["archipelago", "run", f"--set=ray.address={self.address}", f"--set=out_dir={out_dir}", *args]

    def run(
        self,
        argv: list[str],
        log_path: Path,
        metrics: Path | None,
        timeout_s: float,
        enough: Callable[[], bool] | None = None,
        env: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """Run `argv` on the head with the scenario's faults on their timers; the report of
        it: its exit status, seconds, the bytes each card moved meanwhile, the faults fired.
        Once `enough()` (asked every half second) the run is stopped as a user stops it
        (SIGINT: it finishes its round, records it and writes its summary)."""
        before, t0 = self.cards(), time.monotonic()
        process = self.on_head(argv, log_path, env)
        timers = [
            threading.Thread(target=self._fault, args=(f, t0, metrics, process), daemon=True)
            for f in self.scenario.faults
        ]
        for t in timers:
            t.start()
        try:
            deadline = t0 + timeout_s
            while process.poll() is None and time.monotonic() < deadline:
                if enough is not None and enough():
                    process.send_signal(signal.SIGINT)
                    enough = None
                time.sleep(0.5)
            rc = process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            rc = process.wait()
            log.error("testbed: the command ran past %.0fs and was killed", timeout_s)
        seconds = time.monotonic() - t0
        for t in timers:  # each ends its fault once the command has ended: nothing is left cut or stopped
            t.join()
        after = self.cards()
        cards = {k: vars(after[k] - before[k]) for k in after}
        return {"rc": rc, "seconds": round(seconds, 2), "card_bytes": cards, "faults": list(self.fired)}

    def _fault(self, fault: Fault, t0: float, metrics: Path | None, process: subprocess.Popen[bytes]) -> None:
        if fault.after_round:
            while process.poll() is None and _records(metrics) < fault.after_round:
                time.sleep(0.2)
            start = time.monotonic()
        else:
            start = t0
        while process.poll() is None and time.monotonic() < start + fault.at_s:
            time.sleep(0.1)
        if process.poll() is not None or self.net is None:
            return
        record: dict[str, Any] = {"kind": fault.kind.value, "machine": fault.machine, "for_s": fault.for_s}
        record["at_s"] = round(time.monotonic() - t0, 2)
        record |= self.strike(fault)
        self.fired.append(record)
        until = time.monotonic() + fault.for_s
        while process.poll() is None and time.monotonic() < until:
            time.sleep(0.1)
        self.end(fault)
        record["ended_s"] = round(time.monotonic() - t0, 2)

    def strike(self, fault: Fault) -> dict[str, Any]:
        """Begin `fault`; what it touched."""
        assert self.net is not None
        log.warning("testbed: %s of %s for %.0fs", fault.kind.value, fault.machine, fault.for_s)
        if fault.kind == FaultKind.PARTITION:
            self.net.cut(fault.machine)
        elif fault.kind == FaultKind.DEGRADE:
            assert fault.link is not None
            self.net.shape(fault.machine, fault.link.rate())
        elif fault.kind == FaultKind.KILL_RAYLET:
            return {"pids": self.nodes[fault.machine].kill_raylet()}
        elif fault.kind == FaultKind.FREEZE:
            return {"pids": self.nodes[fault.machine].signal(fault.process, signal.SIGSTOP)}
        return {}

    def end(self, fault: Fault) -> None:
        assert self.net is not None
        log.warning("testbed: %s of %s over", fault.kind.value, fault.machine)
        spec = next(m for m in self.scenario.machines if m.name == fault.machine)
        if fault.kind == FaultKind.PARTITION:
            self.net.heal(fault.machine)
        elif fault.kind == FaultKind.DEGRADE:
            self.net.shape(fault.machine, spec.link.rate())
        elif fault.kind == FaultKind.KILL_RAYLET:
            self.nodes[fault.machine].start()
        elif fault.kind == FaultKind.FREEZE:
            self.nodes[fault.machine].signal(fault.process, signal.SIGCONT)


def _records(metrics: Path | None) -> int:
    try:
        return 0 if metrics is None else len(metrics.read_text().splitlines())
    except OSError:
        return 0


def _as_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def write_report(report: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")


RESULT = "result.json"


def kept(out: Path) -> dict[str, Any] | None:
    """A run's result kept in `out` by an earlier `bench testbed` into the same folder (a
    rerun after a stop continues where it stopped; a new `--out` measures everything again)."""
    path = out / RESULT
    return dict(json.loads(path.read_text())) if path.exists() else None


def keep(out: Path, result: dict[str, Any]) -> dict[str, Any]:
    """`result` kept in `out`, stamped with the commit that measured it: a rerun into the
    same folder reuses it, and its report says which commits its parts were measured at."""
    from archipelago.orchestrator.bench.report import measured_commit  # the report module draws plots: imported late

    result = {**result, "measured_at": measured_commit()["commit"], "measured_clean": measured_commit()["clean"]}
    (out / RESULT).write_text(json.dumps(result))
    return result
