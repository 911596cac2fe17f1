"""The testbed's network: machines as Linux network namespaces on one host, each joined to
one bridge by a veth pair whose two ends are shaped with `tc tbf`, one per direction.

Why this and not the simulator: every claim about links, the head's card and network
faults must be measured where bytes really cross a card. A namespace is a machine as the
kernel sees it (its own address, routes and counters); a veth pair is its card and cable.
The namespace's end shapes what the machine sends (its uplink), the bridge's end what it
receives (its downlink). `tbf` and `htb` work on this kind of host; `netem` does not, so
the testbed has no delay or loss emulation: a link here is a rate and a queue, and a
partition is a link set down (`cut`), which TCP sees as total loss until `heal`.

Bytes that crossed a card are read from the kernel (`/sys/class/net/<end>/statistics`) on
the bridge's end, outside the machine, so nothing the machine runs can miscount them.

Everything made here is named with `PREFIX` so `sweep` can find and remove it after a
crash, a Ctrl-C or a previous run's SIGKILL: the namespaces (and every process in them),
the links and the bridge."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "aptb"  # every namespace, link and bridge of the testbed starts with it
BRIDGE = f"{PREFIX}-br"
SUBNET = "10.77.0"  # machines are SUBNET.2 and up; the bridge is SUBNET.1
NET = Path("/sys/class/net")
# the testbed's own files: each node's private /tmp/ray (netlab_cluster.py), the Ray token, the lock
STATE = Path("/var/tmp/aptb-nodes")


class TestbedUnavailable(RuntimeError):
    """The testbed cannot be made here (not root, no namespaces, no `tc`): the command
    exits 2 with the reason."""


@dataclass(frozen=True)
class Rate:
    """A link's rates, Mbit/s: `up` is what the machine sends, `down` what it receives."""

    up_mbit: float
    down_mbit: float


@dataclass(frozen=True)
class CardBytes:
    """Bytes that crossed a machine's card, as the kernel counted them."""

    sent: int
    received: int

    @property
    def total(self) -> int:
        return self.sent + self.received

    def __sub__(self, other: CardBytes) -> CardBytes:
        return CardBytes(sent=self.sent - other.sent, received=self.received - other.received)


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def _tc(*args: str) -> None:
    subprocess.run(["tc", *args], capture_output=True, text=True, check=True)


def require() -> None:
    """Refuse, with the reason, where the testbed cannot be made."""
    if os.geteuid() != 0:
        raise TestbedUnavailable("the testbed needs root (network namespaces, veth links and tc)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise TestbedUnavailable(f"the testbed needs `{tool}` (Debian's iproute2)")
    probe = f"{PREFIX}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        raise TestbedUnavailable(f"network namespaces are unavailable here: {made.stderr.strip()}")
    _ip("netns", "del", probe, check=False)


def tbf(device: str, mbit: float, ns: str | None = None) -> None:
    """Shape what `device` sends to `mbit` with a token bucket. The burst holds at least
    4 ms of the rate (the kernel's timer granularity) and a full-size frame; the queue holds
    50 ms of it: a shallow queue, as a WAN router's, so a saturated link drops and TCP backs
    off instead of queueing seconds of data (which starves Ray's own control traffic)."""
    rate_bytes = mbit * 1e6 / 8
    burst = max(16_384, int(rate_bytes * 0.004))
    limit = max(burst + 3_000, int(rate_bytes * 0.05))
    cmd = ["qdisc", "replace", "dev", device, "root", "tbf", "rate", f"{mbit}mbit", "burst", str(burst)]
    cmd += ["limit", str(limit)]
    _tc(*(["-n", ns] if ns else []), *cmd)


@dataclass
class Machine:
    """A machine of the testbed: its namespace, address and card (the veth pair's ends)."""

    name: str
    index: int
    rate: Rate

    @property
    def ns(self) -> str:
        return f"{PREFIX}-{self.name}"

    @property
    def address(self) -> str:
        return f"{SUBNET}.{self.index + 2}"

    @property
    def outer(self) -> str:
        """The card's end on the bridge (what it counts as received the machine sent)."""
        return f"{PREFIX}{self.index}o"

    @property
    def inner(self) -> str:
        return f"{PREFIX}{self.index}i"


class Network:
    """The bridge and its machines. `add` a machine, `shape` its link, `cut` and `heal` it,
    read its `card`; `close` (or `sweep`) removes it all."""

    def __init__(self) -> None:
        require()
        STATE.mkdir(parents=True, exist_ok=True)
        self._lock = (STATE / "lock").open("w")
        try:  # one testbed a host: the next one's sweep would take this one's machines
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as err:
            self._lock.close()
            raise TestbedUnavailable("another testbed is running on this host") from err
        sweep()
        _ip("link", "add", BRIDGE, "type", "bridge")
        _ip("addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE)
        _ip("link", "set", BRIDGE, "up")
        self.machines: dict[str, Machine] = {}

    def add(self, name: str, rate: Rate) -> Machine:
        m = Machine(name=name, index=len(self.machines), rate=rate)
        _ip("netns", "add", m.ns)
        _ip("link", "add", m.outer, "type", "veth", "peer", "name", m.inner)
        _ip("link", "set", m.inner, "netns", m.ns)
        _ip("link", "set", m.outer, "master", BRIDGE)
        _ip("link", "set", m.outer, "up")
        _ip("-n", m.ns, "link", "set", "lo", "up")
        _ip("-n", m.ns, "addr", "add", f"{m.address}/24", "dev", m.inner)
        _ip("-n", m.ns, "link", "set", m.inner, "up")
        self.machines[name] = m
        self.shape(name, rate)
        return m

    def shape(self, name: str, rate: Rate) -> None:
        """Set `name`'s link to `rate` (a degraded link is a lower one, set live)."""
        m = self.machines[name]
        tbf(m.inner, rate.up_mbit, ns=m.ns)  # what the machine sends
        tbf(m.outer, rate.down_mbit)  # what the bridge delivers to it
        m.rate = rate

    def cut(self, name: str) -> None:
        """A partition: `name`'s card loses its carrier (both directions, as a pulled cable)."""
        _ip("link", "set", self.machines[name].outer, "down")

    def heal(self, name: str) -> None:
        _ip("link", "set", self.machines[name].outer, "up")

    def card(self, name: str) -> CardBytes:
        """The bytes `name` sent and received through its card, read on the bridge's end
        (it receives what the machine sends)."""
        stats = NET / self.machines[name].outer / "statistics"
        return CardBytes(
            sent=int((stats / "rx_bytes").read_text()),
            received=int((stats / "tx_bytes").read_text()),
        )

    def cards(self) -> dict[str, CardBytes]:
        return {name: self.card(name) for name in self.machines}

    def close(self) -> None:
        sweep()
        self._lock.close()  # and with it the lock


def _pids_in(ns: str) -> list[int]:
    out = _ip("netns", "pids", ns, check=False).stdout.split()
    return [int(p) for p in out if p.isdigit()]


def kill_namespace(ns: str, timeout_s: float = 10.0) -> None:
    """SIGKILL every process in `ns` and wait until none is left."""
    deadline = time.monotonic() + timeout_s
    while (pids := _pids_in(ns)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    if pids:  # unkillable (in the kernel's uninterruptible sleep): said, as they outlive the namespace's name
        log.warning("testbed: processes %s in %s did not end in %.0fs", pids, ns, timeout_s)


def sweep() -> None:
    """Remove whatever the testbed made, found by its prefix: the processes in its
    namespaces, the namespaces, the links and the bridge. Safe to call at any time, twice."""
    listed = _ip("netns", "list", check=False).stdout.split("\n")
    spaces = [line.split()[0] for line in listed if line.startswith(f"{PREFIX}-")]
    for ns in spaces:
        kill_namespace(ns)
        _ip("netns", "del", ns, check=False)
    for link in NET.iterdir() if NET.exists() else ():
        if link.name.startswith(PREFIX):
            _ip("link", "del", link.name, check=False)
    for folder in STATE.iterdir() if STATE.exists() else ():
        if folder.is_dir():  # the nodes' /tmp/ray of the testbed before (Ray's logs of its sessions)
            shutil.rmtree(folder, ignore_errors=True)
    if spaces:
        log.info("testbed: removed %s", ", ".join(spaces))
