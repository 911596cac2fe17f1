"""A front door for the control plane, before any route runs: a request body is read at
most `max_body` bytes (413 beyond, whatever Content-Length claims), and a mutating
request without the right token is answered before its body is read at all, so an
unauthenticated client can make the server neither buffer nor parse anything.

Each client gets `RateLimit`'s token bucket: past its rate, a request is answered 429 with
`Retry-After` before anything else is done for it, so one client polling too hard (a
dashboard left in a loop, a scraper misconfigured) cannot starve the others or the run's
own thread of the snapshot lock. A client is who it proves to be: the operator's token and
the read-only token each have a bucket of their own, which nothing without that token can
drain; only a request with neither is counted by its peer address. That address is the
socket's, unless the server was told which proxies to trust (`api.trusted_proxies`):
uvicorn would otherwise take `X-Forwarded-For` from any loopback peer — where `kubectl
port-forward` traffic arrives — and any client could name itself a fresh address per
request (never limited) or the operator's (draining its bucket).

It also gives every request one reading: a request with two `Authorization` headers is
refused (a front door reading the last and a route reading the first would disagree on
who is asking); a server listening on loopback answers only requests addressed to a
loopback name (a web page whose DNS name is rebound to 127.0.0.1 cannot read the run);
HEAD is answered as GET without the body; every response says not to sniff, frame or
cache it."""

from __future__ import annotations

import hmac
import json
import math
import time
from collections.abc import Callable
from typing import Any

from .auth import TokenSource, is_loopback, token_status

MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
MAX_BODY = 64 * 1024  # the largest valid body is a few dozen bytes
SECURITY_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
]


class RateLimit:
    """A token bucket per client: `per_s` requests a second on average, `burst` at once.
    At most `MAX_CLIENTS` buckets are held, the least recently seen client's forgotten
    first (it comes back with a full bucket), so the table stays bounded whoever connects."""

    MAX_CLIENTS = 4096

    def __init__(self, per_s: float, burst: int, clock: Callable[[], float] = time.monotonic) -> None:
        if per_s <= 0 or burst < 1:
            raise ValueError(f"a rate limit needs per_s > 0 and burst >= 1, not {per_s}, {burst}")
        self.per_s, self.burst, self.clock = per_s, burst, clock
        self.buckets: dict[str, tuple[float, float]] = {}  # client -> (tokens, when), least recent first

    def wait_s(self, client: str) -> float:
        """0 when `client` may go now (a token is taken), else the seconds until it may."""
        now = self.clock()
        tokens, when = self.buckets.pop(client, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - when) * self.per_s)
        wait = 0.0 if tokens >= 1 else (1 - tokens) / self.per_s
        self.buckets[client] = (tokens - 1 if wait == 0 else tokens, now)
        if len(self.buckets) > self.MAX_CLIENTS:
            del self.buckets[next(iter(self.buckets))]
        return wait


def rate_limit(per_s: float, burst: int) -> RateLimit | None:
    """`api.rate_per_s` and `api.rate_burst` as the front door applies them (0: no limit)."""
    return RateLimit(per_s, burst) if per_s > 0 else None


def host_name(header: bytes) -> str:
    """The name in a Host header, without its port (`[::1]:8600` → `::1`)."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1 : text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


class FrontDoor:
    def __init__(
        self,
        app: Any,
        token: TokenSource,
        max_body: int = MAX_BODY,
        loopback: bool = False,
        reader: TokenSource | None = None,
        rate: RateLimit | None = None,
    ) -> None:
        """`loopback`: the server listens on loopback only, so only loopback Host names are
        answered; `reader`: the read-only token (refused for mutations, with that reason);
        `rate`: the limit per client (its token, else its address; None: none)."""
        self.app, self.token, self.max_body, self.loopback = app, token, max_body, loopback
        self.reader, self.rate = reader, rate

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send = _secured(send, head=scope["method"] == "HEAD")
        raw = scope.get("headers") or []
        headers = dict(raw)
        if self.rate is not None:
            wait = self.rate.wait_s(self._who(headers.get(b"authorization", b""), scope.get("client")))
            if wait > 0:
                retry = str(max(1, math.ceil(wait))).encode()
                await _answer(send, 429, "too many requests from this client", [(b"retry-after", retry)])
                return
        if sum(1 for name, _ in raw if name == b"authorization") > 1:
            await _answer(send, 400, "more than one Authorization header")
            return
        if self.loopback and not is_loopback(host_name(headers.get(b"host", b""))):
            await _answer(send, 421, "this control plane listens on loopback: address it as localhost or 127.0.0.1")
            return
        if scope["method"] == "HEAD":
            scope = {**scope, "method": "GET"}
        if scope["method"] in MUTATING:
            reader = self.reader.current() if self.reader is not None else None
            refused = token_status(headers.get(b"authorization", b""), self.token.current(), reader=reader)
            if refused is not None:
                await _answer(send, *refused)
                return
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            await _answer(send, 413, f"request body over {self.max_body} bytes")
            return
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body:
                await _answer(send, 413, f"request body over {self.max_body} bytes")
                return
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _who(self, authorization: bytes, client: tuple[str, int] | None) -> str:
        """The bucket a request is counted in: `operator` or `reader` for a request carrying
        that token (compared in constant time), else `peer:<address>`. A wrong token is
        counted by address like no token, so guessing costs the guesser's own bucket."""
        if authorization[:7].lower() == b"bearer ":
            sent = authorization[7:].strip()
            for name, source in (("operator", self.token), ("reader", self.reader)):
                token = source.current() if source is not None else None
                if token is not None and hmac.compare_digest(sent, token):
                    return name
        return f"peer:{client[0] if client else ''}"


def _secured(send: Any, head: bool) -> Any:
    """`send` with the security headers on every response, and no body for a HEAD."""

    async def wrapped(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            present = {name.lower() for name, _ in message.get("headers", [])}
            extra = [(n, v) for n, v in SECURITY_HEADERS if n not in present]
            message = {**message, "headers": [*message.get("headers", []), *extra]}
        elif message["type"] == "http.response.body" and head:
            message = {**message, "body": b""}
        await send(message)

    return wrapped


async def _answer(send: Any, status: int, detail: str, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *(extra or [])]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
