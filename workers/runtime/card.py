"""The bytes this process's network card has moved, for the heartbeat's "a transfer is
progress" rule: an island fetching its parameters at its round's start or having its
pseudo-gradient pulled after its last step takes no step, and on a slow link that lasts
longer than any silence the hang rule allows (a 4 GB download through a 10 Gbit/s head
shared by 16 islands takes ≈ 51 s). Its card's counters keep moving, and that is what the
coordinator reads (`engine/work/inflight.py: InFlight.progressed`).

The counters are the network namespace's, so the node's: on a node of several islands (or
one on the host's network, where bridges count bytes again) a neighbour's transfer keeps a
hung island looking busy until the transfer ends or its deadline comes — the rule can only
be late there, never early."""

from __future__ import annotations

from pathlib import Path

DEVICES = Path("/proc/self/net/dev")  # this process's network namespace's cards (Linux)


def card_bytes() -> int | None:
    """Bytes received plus sent by every card but loopback, as the kernel counts them for
    this process's network namespace (on a node: the node's); None where not readable."""
    try:
        lines = DEVICES.read_text().splitlines()[2:]
    except OSError:
        return None
    total = 0
    for line in lines:
        name, _, counters = line.partition(":")
        fields = counters.split()
        if name.strip() == "lo" or len(fields) < 9:
            continue
        total += int(fields[0]) + int(fields[8])  # received bytes, sent bytes
    return total
