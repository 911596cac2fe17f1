"""The bearer-token check as a FastAPI dependency (`api/auth.py` holds the token rules;
this module is apart so that the command can check a token without importing FastAPI)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from .auth import TokenSource, token_status

# auto_error=False: the missing-credentials answer is ours (401 with a reason); the scheme
# still appears in the OpenAPI document, so clients and the docs page know to send it.
_bearer = HTTPBearer(auto_error=False, description="the run's API token (ARCHIPELAGO_API_TOKEN_FILE)")


def bearer_guard(token: TokenSource, what: str = "mutations", reader: TokenSource | None = None):
    """A FastAPI dependency: 401 without credentials, 403 with wrong ones (the read-only
    token `reader` passes for reads only)."""

    def check(request: Request, _scheme: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]) -> None:
        # `_scheme` puts the bearer scheme in the OpenAPI document; the check reads the raw
        # header. The server decodes header bytes as latin-1: encoding back gives the bytes sent
        sent = request.headers.get("authorization", "").encode("latin-1")
        refused = token_status(sent, token.current(), what, reader.current() if reader is not None else None)
        if refused is not None:
            status, reason = refused
            raise HTTPException(status, reason, headers={"WWW-Authenticate": "Bearer"} if status == 401 else None)

    return check
