"""The run's control plane (`api/`) as the driver runs it: served from a thread of the
driver's own process, which lives as long as the run on the node the user was told, and
outlives a coordinator that Ray restarts. It is started right after the coordinator is
asked for (its handle resolves the coordinator's name) and serves before the run begins,
so the API can see and steer a run from its first round.

It was an actor of its own: one more process starting (Ray's worker, FastAPI, uvicorn:
about 1 s of CPU) beside the coordinator and the islands, which added 1–2 s to the first
inner step on 2 cores; and an actor outlived a driver killed with SIGKILL, where a thread
ends with it. The token never leaves this process."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from archipelago.workers.runtime.storage import is_url

from ..config import RunConfig
from ..engine.types import RunFailed

log = logging.getLogger(__name__)
URL_FILE = "control-plane.url"  # in the run's folder: the address this run's control plane serves on


def api_token(cfg: RunConfig) -> str | None:
    """The control plane's token, checked before anything starts: an exposed control plane
    without a usable token is refused (api/auth.py)."""
    if not cfg.api.enabled:
        return None
    from archipelago.api.auth import ExposureError, check_exposure, configured_token

    try:
        token = configured_token()
        check_exposure(cfg.api.host, token)
    except ExposureError as err:
        raise RunFailed(f"control plane refused: {err}") from err
    return token


class ControlPlane:
    """`start` serves `cfg.api.host` on the first free port of `api.port` … `+ api.ports`,
    past them on one the system picks, so any number of runs share a node (returns once it
    listens; a control plane that cannot serve fails the run before it trains), logs the
    address and writes it to the run's folder (`URL_FILE`); `close` stops it. Nothing when
    `api.enabled` is off."""

    def __init__(self, cfg: RunConfig, run_id: str, token: str | None) -> None:
        self.cfg, self.run_id, self.token = cfg, run_id, token
        self.server: Any = None

    def start(self) -> None:
        if not self.cfg.api.enabled:
            return
        from archipelago.api.auth import ExposureError, configured_read_source, configured_source
        from archipelago.api.limits import rate_limit
        from archipelago.api.server import ControlPlane as Server

        from .run_handle import RayRunHandle

        api = self.cfg.api
        try:
            self.server = Server(
                RayRunHandle(self.run_id),
                api.host,
                api.port,
                configured_source(self.token),
                api.public_reads,
                (api.tls_cert, api.tls_key) if api.tls_cert and api.tls_key else None,
                read_token=configured_read_source(),
                rate=rate_limit(api.rate_per_s, api.rate_burst),
                trusted_proxies=tuple(api.trusted_proxies),
                ports=api.ports,
                overflow=True,  # a run past the range serves anyway, on the address it publishes
            )
        except ExposureError as err:
            raise RunFailed(f"control plane refused: {err}") from err
        except (RuntimeError, OSError, ValueError) as err:
            raise RunFailed(f"the control plane did not start: {err}") from err
        address = self.server.address()
        log.info("control plane: %s  (dashboard at /, API at /v1, docs at /docs)", address)
        if not is_url(self.cfg.out_dir):  # where a script or the next person finds it, beside the run's outputs
            folder = Path(self.cfg.out_dir)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / URL_FILE).write_text(address + "\n")

    def close(self) -> None:
        if self.server is not None:
            self.server.shutdown()
            self.server = None
