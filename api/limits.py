"""A front door for the control plane, before any route runs: a request body is read at
most `max_body` bytes (413 beyond, whatever Content-Length claims), and a mutating
request without the right token is answered before its body is read at all, so an
unauthenticated client can make the server neither buffer nor parse anything."""

from __future__ import annotations

import json
from typing import Any

from api.auth import token_status

MUTATING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
MAX_BODY = 64 * 1024  # the largest valid body is a few dozen bytes


class FrontDoor:
    def __init__(self, app: Any, token: str | None, max_body: int = MAX_BODY) -> None:
        self.app, self.max_body = app, max_body
        self.expected = token.encode("utf-8") if token is not None else None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if scope["method"] in MUTATING:
            refused = token_status(headers.get(b"authorization", b""), self.expected)
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


async def _answer(send: Any, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
