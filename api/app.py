"""The control plane: a versioned JSON API over a run handle, `/metrics` for Prometheus,
and a built-in dashboard page. Mutating calls need the bearer token, and reads too unless
`api.public_reads`; every refused request gets a 4xx with a reason, and nothing a client
sends reaches the run unvalidated."""

from __future__ import annotations

import base64
import hashlib
import json
import math
import time
from collections.abc import Callable
from importlib import resources
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Header, HTTPException, Path, Query, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse

from archipelago.orchestrator.engine.commands import (
    MAX_KEY_LENGTH,
    AddIslands,
    Command,
    Drain,
    Pause,
    Preempt,
    Refusal,
    Refused,
    Resume,
    SetTarget,
    SettingsUpdate,
    Stop,
    UpdateSettings,
)
from archipelago.orchestrator.engine.fleet.watch import watched
from archipelago.orchestrator.engine.state.views import EventRecord, IslandView, RoundRecord, RunStatus

from . import prometheus
from .auth import TokenSource
from .guard import bearer_guard
from .handle import HandleError, RunHandle
from .limits import MAX_BODY, FrontDoor, RateLimit
from .schemas import Accepted, Target
from .schemas import AddIslands as AddIslandsBody

# the HTTP status of each refusal reason
REFUSAL_STATUS = {
    Refusal.OUT_OF_BOUNDS: 422,
    Refusal.INVALID: 422,
    Refusal.UNKNOWN_ISLAND: 404,
    Refusal.NOT_NOW: 409,
}
RUN_ACTIONS: dict[str, Command] = {"pause": Pause(), "resume": Resume(), "stop": Stop()}
PAGE = MAX_PAGE = (
    500  # records or events per page: a page (≈ 2.4 MiB of JSON at 64 islands) is bounded whatever the run's length
)
Since = Annotated[int, Query(ge=0, description="cursor: the last round seen (history) or events seen (events)")]
Limit = Annotated[int, Query(ge=1, le=MAX_PAGE, description="page size")]
Key = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        min_length=1,
        max_length=MAX_KEY_LENGTH,
        description="a key of the client's choosing: the run answers a key it accepted before with that first "
        "answer and applies nothing again, so a command whose answer was lost can be sent again safely",
    ),
]
Route = Callable[..., Any]


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


class FiniteJSONResponse(JSONResponse):
    """JSON has no NaN or Infinity, and Starlette refuses to write them (a 500): a diverged
    run's loss, or a client's `NaN` echoed back in a 422, is written as `null`. And it is
    written as ASCII: a client's lone surrogate (`"\\ud800"`) echoed back in a 422 cannot be
    encoded as UTF-8 (a 500), but it can be escaped."""

    def render(self, content: Any) -> bytes:
        return json.dumps(_finite(content), ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def _dashboard() -> tuple[str, str]:
    """The dashboard page and its Content-Security-Policy: only the page's own inline script
    and style run (pinned by hash), it fetches from this origin only, submits no form and
    is framed by no other site."""
    page = resources.files("archipelago.api").joinpath("dashboard.html").read_text()

    def pinned(tag: str) -> str:
        inline = page.split(f"<{tag}>", 1)[1].split(f"</{tag}>", 1)[0]
        return f"'sha256-{base64.b64encode(hashlib.sha256(inline.encode()).digest()).decode()}'"

    policy = (
        f"default-src 'none'; script-src {pinned('script')}; style-src {pinned('style')}; connect-src 'self'; "
        "img-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'"
    )
    return page, policy


def _views(handle: RunHandle) -> APIRouter:
    """The run's reads, each typed by its view (the app opens them to the read token, or to
    all with public reads)."""
    router = APIRouter()

    def view_route(path: str, model: Any, summary: str) -> Callable[[Route], Route]:
        return router.get(path, response_model=model, summary=summary)

    @view_route("/v1/run", RunStatus, "Run status: phase, mode, version, tokens, eval loss, rounds, islands, state")
    def run_status() -> dict[str, Any]:
        return handle.status()

    @view_route(
        "/v1/run/history",
        list[RoundRecord],
        "Per-round records (metrics.jsonl) after round `since`, at most `limit` (page on with the last round)",
    )
    def run_history(since: Since = 0, limit: Limit = PAGE) -> list[dict[str, Any]]:
        return handle.history(since, limit)

    @view_route(
        "/v1/islands",
        list[IslandView],
        "Islands with state, node, staleness, tokens, H, rejections, and how long each has been silent",
    )
    def islands() -> list[dict[str, Any]]:
        now = time.time()
        return [
            watched({"id": int(i), **s}, now) for i, s in sorted(handle.islands().items(), key=lambda kv: int(kv[0]))
        ]

    @view_route(
        "/v1/events",
        list[EventRecord],
        "The run's event log from index `since` on, at most `limit` (page on with since + count)",
    )
    def events(since: Since = 0, limit: Limit = PAGE) -> list[EventRecord]:
        return handle.events(since, limit)

    return router


def _commands(handle: RunHandle) -> APIRouter:
    """The routes that put a command to the run, each answered 202 `Accepted` or a 4xx from
    the refusal's reason (the app authenticates them with the token)."""
    router = APIRouter()

    def command_route(method: str, path: str, summary: str) -> Callable[[Route], Route]:
        return getattr(router, method)(path, status_code=202, response_model=Accepted, summary=summary)

    def answer(command: Command, key: str | None) -> Accepted:
        """Put `command` to the run: its acknowledgement is a 202, its refusal a 4xx from
        the refusal's reason. `key`: the `Idempotency-Key` header (a key the run accepted
        before gets that first answer, and nothing is applied again)."""
        reply = handle.submit(command, key)
        if isinstance(reply, Refused):
            raise HandleError(REFUSAL_STATUS[reply.reason], reply.message)
        return Accepted(detail=reply.detail)

    @command_route(
        "post", "/v1/islands", "Add islands (asks the autoscaler for their nodes; they join as resources appear)"
    )
    def add_islands(body: AddIslandsBody, key: Key = None) -> Accepted:
        return answer(AddIslands(count=body.count), key)

    @command_route("put", "/v1/islands/target", "Set the island count (idempotent; bounded by elastic.min/max_islands)")
    def set_target(body: Target, key: Key = None) -> Accepted:
        return answer(SetTarget(islands=body.target), key)

    @command_route(
        "delete", "/v1/islands/{island}", "Drain one island: it finishes its round, then its resources are released"
    )
    def drain(island: int = Path(..., ge=0), key: Key = None) -> Accepted:
        return answer(Drain(island=island), key)

    @command_route(
        "post",
        "/v1/islands/{island}/preempt",
        "A preemption notice (a scheduler that knows first): the island gets no new work, its replacement "
        "is placed now (the target stays), and its work out sends what it has trained by the time the node "
        "goes (notice_s from now; none given: after the step in progress)",
    )
    def preempt(
        island: int = Path(..., ge=0),
        notice_s: float | None = Query(None, ge=0, description="seconds until the node is taken, if known"),
        key: Key = None,
    ) -> Accepted:
        return answer(Preempt(island=island, notice_s=notice_s), key)

    @command_route(
        "post", "/v1/run/{action}", "pause, resume or stop (stop: finish the round, checkpoint, write outputs)"
    )
    def control(action: str, key: Key = None) -> Accepted:
        command = RUN_ACTIONS.get(action)
        if command is None:
            raise HTTPException(404, f"unknown action {action!r}; use one of {sorted(RUN_ACTIONS)}")
        return answer(command, key)

    @command_route("patch", "/v1/run/settings", "Change H and the outer lr at the next round boundary")
    def settings(body: SettingsUpdate, key: Key = None) -> Accepted:
        return answer(UpdateSettings(settings=body), key)

    return router


def create_app(
    handle: RunHandle,
    token: str | TokenSource | None,
    public_reads: bool = False,
    max_body: int = MAX_BODY,
    loopback: bool = False,
    read_token: TokenSource | None = None,
    rate: RateLimit | None = None,
) -> FastAPI:
    """The app over `handle`. Mutations need `token` (a `TokenSource` follows a token file
    as it is rotated); so do reads unless `public_reads` (or no token is configured, which
    `check_exposure` allows on loopback only). `loopback`: it is served on loopback, so it
    answers loopback Host names only. `read_token`: a second token that passes for reads
    only (dashboards, scrapers); `rate`: each client's request rate (429 beyond)."""
    source = token if isinstance(token, TokenSource) else TokenSource(token)
    app = FastAPI(
        title="Archipelago control plane",
        version="1",
        description="Watch a run, scale its islands, pause/resume/stop it, change settings at round boundaries.",
        default_response_class=FiniteJSONResponse,
    )
    auth = [Depends(bearer_guard(source))]
    open_reads = public_reads or source.current() is None
    reads = [] if open_reads else [Depends(bearer_guard(source, "reads", read_token))]
    app.add_middleware(FrontDoor, token=source, max_body=max_body, loopback=loopback, reader=read_token, rate=rate)
    page, policy = _dashboard()

    @app.exception_handler(HandleError)
    async def _refused(_: Request, err: HandleError) -> JSONResponse:
        return FiniteJSONResponse({"detail": err.message}, status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        # a body that is not UTF-8 comes back in the error as bytes, which the default
        # encoder fails to decode (a 500): decode what can be, replace the rest
        errors = jsonable_encoder(err.errors(), custom_encoder={bytes: lambda b: b.decode("utf-8", "replace")})
        return FiniteJSONResponse({"detail": errors}, status_code=422)

    app.include_router(_views(handle), dependencies=reads)
    app.include_router(_commands(handle), dependencies=auth)

    @app.get("/metrics", dependencies=reads, response_class=PlainTextResponse, summary="Prometheus text format")
    def metrics() -> PlainTextResponse:
        return PlainTextResponse(
            prometheus.render(handle.status(), handle.islands()), media_type=prometheus.CONTENT_TYPE
        )

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def dashboard() -> HTMLResponse:
        return HTMLResponse(page, headers={"content-security-policy": policy})

    return app
