"""Serving the control plane: uvicorn in a background thread of a long-lived process —
a Ray actor started with the run (pinned to the driver's node), or `archipelago serve`
in a terminal against a running job. A plain class: `ray.remote(ControlPlane)` makes the actor."""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn

from api.app import create_app
from api.auth import TokenSource, check_exposure, is_loopback
from api.handle import RayRunHandle
from api.limits import RateLimit


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


class ControlPlane:
    def __init__(
        self,
        run_id: str,
        host: str = "127.0.0.1",
        port: int = 8600,
        token: TokenSource | None = None,
        public_reads: bool = False,
        tls: tuple[str, str] | None = None,
        read_token: TokenSource | None = None,
        rate: RateLimit | None = None,
        trusted_proxies: tuple[str, ...] = (),
    ) -> None:
        """`token`: the configured token, followed in its file (rotation); `tls`:
        (certificate, key) PEM files to serve HTTPS with; `read_token`, `rate`: see
        `create_app`; `trusted_proxies`: see `server_config`."""
        token = token or TokenSource()
        current = token.current()
        check_exposure(host, current.decode("utf-8") if current is not None else None)
        app = create_app(
            RayRunHandle(run_id), token, public_reads, loopback=is_loopback(host), read_token=read_token, rate=rate
        )
        self.server = uvicorn.Server(server_config(app, host, port, tls, trusted_proxies))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 15
        while not self.server.started and self.thread.is_alive() and time.time() < deadline:
            time.sleep(0.02)
        if not self.server.started:
            raise RuntimeError(f"the control plane could not listen on {host}:{port}")
        self.url = f"{'https' if tls else 'http'}://{host}:{port}"

    def address(self) -> str:
        return self.url

    def shutdown(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
