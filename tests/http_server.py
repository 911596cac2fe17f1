"""Serve an ASGI app with uvicorn on a free loopback port in a background thread (tests)."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

import uvicorn


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_range(count: int) -> int:
    """The first of `count` consecutive free loopback ports, chosen below the kernel's
    ephemeral range and above Ray's worker ports (10002-19999): no process of the suite
    takes ports there on its own, so a test that needs the ports after the first to stay
    free is not raced by another process's `bind(0)` (seen once with two pytest workers:
    the second of a control plane's range taken by the other worker's Ray)."""
    import random

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral = int(f.read().split()[0])
    for _ in range(200):
        base = random.randrange(20000, ephemeral - count)
        try:
            for port in range(base, base + count):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError(f"no {count} consecutive free ports between 20000 and {ephemeral}")


@contextmanager
def serving(app, tls: tuple[str, str] | None = None, trusted_proxies: tuple[str, ...] = ()):
    """`app` on a free loopback port, as the control plane serves it (HTTPS with `tls`:
    certificate and key files; `X-Forwarded-For` read from `trusted_proxies`); yields its base URL."""
    from archipelago.api.server import server_config

    port = free_port()
    server = uvicorn.Server(server_config(app, "127.0.0.1", port, tls, trusted_proxies))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started and time.time() < deadline:
        time.sleep(0.02)
    try:
        yield f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
