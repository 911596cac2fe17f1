"""Bearer-token auth for mutating calls. The token comes from $ARCHIPELAGO_API_TOKEN or a
file named by $ARCHIPELAGO_API_TOKEN_FILE (a mounted Kubernetes Secret). Without a token
configured, mutations are refused rather than left open."""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from fastapi import Header, HTTPException


def configured_token() -> str | None:
    path = os.environ.get("ARCHIPELAGO_API_TOKEN_FILE")
    if path and Path(path).exists():
        return Path(path).read_text().strip() or None
    return os.environ.get("ARCHIPELAGO_API_TOKEN") or None


def bearer_guard(token: str | None):
    """A FastAPI dependency: 401 without credentials, 403 with wrong ones."""

    def check(authorization: str | None = Header(None)) -> None:
        if token is None:
            raise HTTPException(403, "mutations are disabled: no API token is configured (ARCHIPELAGO_API_TOKEN)")
        if not authorization or not authorization.startswith("Bearer "):
            raise HTTPException(401, "missing bearer token", headers={"WWW-Authenticate": "Bearer"})
        # On bytes: the server decodes header bytes as latin-1, so any bytes a client sends
        # come back as they were; comparing str would raise on non-ASCII (a 500).
        given = authorization[len("Bearer ") :].strip().encode("latin-1", errors="replace")
        if not hmac.compare_digest(given, token.encode("utf-8")):
            raise HTTPException(403, "wrong token")

    return check
