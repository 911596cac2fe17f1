"""Serving the control plane: uvicorn in a background thread of a long-lived process —
a Ray actor started with the run (pinned to the driver's node), or `archipelago serve`
in a terminal against a running job. A plain class: `ray.remote(ControlPlane)` makes the actor."""

from __future__ import annotations

import threading
import time

import uvicorn

from api.app import create_app
from api.auth import check_exposure, is_loopback
from api.handle import RayRunHandle


class ControlPlane:
    def __init__(
        self,
        run_id: str,
        host: str = "127.0.0.1",
        port: int = 8600,
        token: str | None = None,
        public_reads: bool = False,
    ) -> None:
        check_exposure(host, token)
        app = create_app(RayRunHandle(run_id), token, public_reads, loopback=is_loopback(host))
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.time() + 15
        while not self.server.started and self.thread.is_alive() and time.time() < deadline:
            time.sleep(0.02)
        if not self.server.started:
            raise RuntimeError(f"the control plane could not listen on {host}:{port}")
        self.url = f"http://{host}:{port}"

    def address(self) -> str:
        return self.url

    def shutdown(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
