"""Ray nodes on the testbed's machines (`netlab.py`): a head, islands, coordinator slices
and evaluation nodes, each `ray start --block` inside its namespace, as a pod runs one
Ray node. A node's raylet can be SIGKILLed and the node started again later (as a kubelet
restarts a pod), and any of its processes stopped with SIGSTOP and continued.

Several raylets on one host would share `/tmp/ray` (their sockets and session folders):
each node's processes see a folder of their own bound over `/tmp/ray` (the mount lives in
the namespace's own mount table that `ip netns exec` makes), and nothing else of the host
changes. Drivers run on the head (`run_on_head`), inside the same binding, so Ray finds
the head's raylet as a driver on a real head node would."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from enum import Enum
from pathlib import Path

from archipelago.orchestrator.bench.netlab import STATE, Machine, _pids_in, kill_namespace

log = logging.getLogger(__name__)

RAY_PORT = 6379
NODES = STATE  # each node's private /tmp/ray in a folder of its own (outside /tmp: it is bound over part of it)
# every testbed Ray process's environment: no usage report (no internet here), no warning about
# the container's CPUs (the namespaces share the host's)
RAY_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DISABLE_DOCKER_CPU_WARNING": "1"}


def ray_env() -> dict[str, str]:
    """The environment of every testbed Ray process, nodes and drivers: Ray's token
    authentication on, as Ray 2.59+ sets up a cluster, with one token for the testbed (kept
    beside the nodes' folders, so `testbed exec` finds it). Left to Ray's defaults, a token
    file in ~/.ray (which another Ray on the host may write) turned it on for the head and
    not for a driver, which then could not connect."""
    NODES.mkdir(parents=True, exist_ok=True)
    token = NODES / "auth_token"
    if not token.exists():
        token.write_text(secrets.token_hex(16))
        token.chmod(0o600)
    return os.environ | RAY_ENV | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token.read_text().strip()}


class Role(str, Enum):
    HEAD = "head"
    ISLAND = "island"
    SLICE = "slice"
    EVALUATION = "evaluation"


def _ray() -> str:
    found = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    if not Path(found).exists():
        raise FileNotFoundError("the `ray` command is not installed beside this Python")
    return found


def in_machine(machine: Machine, argv: list[str]) -> list[str]:
    """`argv` run inside `machine`: its namespace, its own `/tmp/ray`."""
    private = NODES / machine.name
    private.mkdir(parents=True, exist_ok=True)
    Path("/tmp/ray").mkdir(exist_ok=True)
    bind = 'mount --bind "$0" /tmp/ray && exec "$@"'
    return ["ip", "netns", "exec", machine.ns, "sh", "-c", bind, str(private), *argv]


class Node:
    """One Ray node on a machine: `start`, `kill_raylet`, `stop`/`cont` a process."""

    def __init__(
        self, machine: Machine, role: Role, head: str, cpus: float, system_config: dict | None, logs: Path
    ) -> None:
        self.machine, self.role, self.head, self.cpus = machine, role, head, cpus
        self.system_config = system_config or {}
        self.logs = logs
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def argv(self) -> list[str]:
        cmd = [_ray(), "start", "--block", "--disable-usage-stats", f"--node-ip-address={self.machine.address}"]
        cmd += [f"--num-cpus={self.cpus:g}", "--object-store-memory=300000000"]
        resources = {f"testbed_{self.role.value}": 1} | ({"archipelago_slice": 1} if self.role == Role.SLICE else {})
        cmd.append(f"--resources={json.dumps(resources)}")
        if self.role == Role.HEAD:
            cmd += ["--head", f"--port={RAY_PORT}", "--include-dashboard=false"]
            if self.system_config:
                cmd.append(f"--system-config={json.dumps(self.system_config)}")
        else:
            cmd.append(f"--address={self.head}:{RAY_PORT}")
        return cmd

    def start(self) -> None:
        self.starts += 1
        self.logs.mkdir(parents=True, exist_ok=True)
        out = (self.logs / f"{self.machine.name}.{self.starts}.log").open("wb")
        env = ray_env()
        self.process = subprocess.Popen(
            in_machine(self.machine, self.argv()), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        out.close()

    def pids(self, name: str, *, command: bool = False) -> list[int]:
        """The node's processes whose command line contains `name` (`ray::IslandActor`), or
        (`command`) whose command is `name` (`raylet`)."""
        found = []
        for pid in _pids_in(self.machine.ns):
            with contextlib.suppress(OSError):
                comm = Path(f"/proc/{pid}/comm").read_text().strip()
                args = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if (comm == name) if command else (name in args):
                    found.append(pid)
        return found

    def kill_raylet(self) -> list[int]:
        """SIGKILL the node's raylet (its `ray start --block` then ends the node's other
        processes, as a pod whose main container died); then every process left in the
        machine, so a later `start` is a fresh pod."""
        pids = self.pids("raylet", command=True)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        kill_namespace(self.machine.ns)
        if self.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=5)
        return pids

    def signal(self, name: str, sig: signal.Signals) -> list[int]:
        pids = self.pids(name)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


def wait_for_nodes(head: Machine, count: int, timeout_s: float = 120.0) -> None:
    """Until `count` nodes are alive in the cluster, asked from the head as a driver would."""
    probe = (
        "import ray,sys; ray.init(address='auto', logging_level='ERROR', log_to_driver=False); "
        "print(sum(n['Alive'] for n in ray.nodes()))"
    )
    deadline = time.monotonic() + timeout_s
    seen = "0"
    while time.monotonic() < deadline:
        done = subprocess.run(
            in_machine(head, [sys.executable, "-c", probe]),
            capture_output=True,
            text=True,
            env=ray_env() | {"RAY_ADDRESS": f"{head.address}:{RAY_PORT}"},
            check=False,
        )
        seen = (done.stdout.strip().splitlines() or ["0"])[-1]
        if done.returncode == 0 and seen.isdigit() and int(seen) >= count:
            return
        time.sleep(1.0)
    raise TimeoutError(f"the testbed's Ray cluster has {seen} of {count} nodes after {timeout_s:.0f}s")
