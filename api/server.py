"""Serving the control plane: uvicorn in a background thread of a long-lived process —
the run's driver (`orchestrator/runtime/control_plane.py`), or `archipelago serve` in a
terminal against a running job — on the first free port of a range (past it, a port the
system picks), so any number of runs on one Ray cluster each serve their own."""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from typing import Any

import uvicorn

from .app import create_app
from .auth import TokenSource, check_exposure, is_loopback
from .handle import RunHandle
from .limits import RateLimit

log = logging.getLogger(__name__)


def server_config(
    app: Any, host: str, port: int, tls: tuple[str, str] | None = None, trusted_proxies: tuple[str, ...] = ()
) -> uvicorn.Config:
    """How uvicorn serves the app: HTTPS when `tls` names a certificate and its key. The
    token travels in every request, so beyond a private network it should only travel
    encrypted (or behind a TLS-terminating ingress).

    `X-Forwarded-For` is read only from the peers in `trusted_proxies` (addresses or
    networks; none by default): uvicorn's own default trusts it from loopback, where `kubectl
    port-forward` delivers every client, so any client could pick the address the rate
    limit counts it under (`api/limits.py`)."""
    cert, key = tls if tls else (None, None)
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        ssl_certfile=cert,
        ssl_keyfile=key,
        proxy_headers=bool(trusted_proxies),
        forwarded_allow_ips=list(trusted_proxies) if trusted_proxies else None,
    )


def bind_first_free(host: str, port: int, ports: int = 1, *, overflow: bool = False) -> socket.socket:
    """A listening socket on the first of `port` … `port + ports - 1` that is free on
    `host`. Bound here, then handed to uvicorn, so two runs starting at once on one node
    cannot both pick a port that looked free: the loser's bind fails and it takes the next.
    When every port is taken: with `overflow`, a port the system picks (a run past the
    range still serves, on an address it publishes); else `OSError` naming the range."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    last = port + ports - 1
    for candidate in [*range(port, last + 1), *([0] if overflow else [])]:
        sock = socket.socket(
            family, socket.SOCK_STREAM, socket.IPPROTO_TCP
        )  # TCP named: asyncio sets TCP_NODELAY only then
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does: past TIME_WAIT
        try:
            sock.bind((host, candidate))
        except OSError as err:
            sock.close()
            if err.errno == errno.EADDRINUSE:
                continue
            raise
        sock.listen(2048)
        if candidate == 0:
            log.warning(
                "%s (api.port, api.ports): serving on %d, which the system picked",
                _taken(host, port, last), sock.getsockname()[1],
            )  # fmt: skip
        return sock
    raise OSError(errno.EADDRINUSE, _taken(host, port, last))


def _taken(host: str, port: int, last: int) -> str:
    return f"every port of {host}:{port}-{last} is taken" if last > port else f"{host}:{port} is taken"


class ControlPlane:
    def __init__(
        self,
        handle: RunHandle,
        host: str = "127.0.0.1",
        port: int = 8600,
        token: TokenSource | None = None,
        public_reads: bool = False,
        tls: tuple[str, str] | None = None,
        read_token: TokenSource | None = None,
        rate: RateLimit | None = None,
        trusted_proxies: tuple[str, ...] = (),
        ports: int = 1,
        overflow: bool = False,
    ) -> None:
        """`handle`: the run served (`RayRunHandle` of a running job); `token`: the configured token, followed in its file (rotation); `tls`:
        (certificate, key) PEM files to serve HTTPS with; `read_token`, `rate`: see
        `create_app`; `trusted_proxies`: see `server_config`; `ports`: how many ports from
        `port` up it may take, and `overflow` whether it serves past them (`bind_first_free`)."""
        token = token or TokenSource()
        current = token.current()
        check_exposure(host, current.decode("utf-8") if current is not None else None)
        app = create_app(handle, token, public_reads, loopback=is_loopback(host), read_token=read_token, rate=rate)
        sock = bind_first_free(host, port, ports, overflow=overflow)
        port = sock.getsockname()[1]
        self.server = uvicorn.Server(server_config(app, host, port, tls, trusted_proxies))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.time() + 15
        while not self.server.started and self.thread.is_alive() and time.time() < deadline:
            time.sleep(0.02)
        if not self.server.started:
            sock.close()
            raise RuntimeError(f"the control plane could not serve on {host}:{port}")
        self.port = port
        self.url = f"{'https' if tls else 'http'}://{host}:{port}"

    def address(self) -> str:
        return self.url

    def shutdown(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
