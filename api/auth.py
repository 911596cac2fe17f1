"""Who may use the control plane: a bearer token, and where it may be served.

The token comes from a file named by $ARCHIPELAGO_API_TOKEN_FILE (a mounted Kubernetes
Secret: what the shipped manifests do; re-read when it changes) or from
$ARCHIPELAGO_API_TOKEN. It guards every
mutation, and every read (run status, islands with their hostnames and errors, events,
history, metrics) unless `api.public_reads` is set. Without a token, mutations are
refused rather than left open, and the server refuses to listen on anything but
loopback; a token known to be a placeholder (the `change-me` of a copied manifest) or
too short to resist guessing is refused outright, so a deploy that forgot to set one
fails at start instead of running open. See docs/control-plane.md, "Threat model".
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from pathlib import Path

MIN_TOKEN_LENGTH = 16
PLACEHOLDERS = frozenset({"change-me", "changeme", "change_me", "secret", "token", "password", "replace-me"})
LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost"})

log = logging.getLogger(__name__)


class ExposureError(ValueError):
    """The control plane would be reachable without a usable token."""


def configured_token() -> str | None:
    path = os.environ.get("ARCHIPELAGO_API_TOKEN_FILE")
    if path:
        file = Path(path)
        try:
            return file.read_text().strip() or None
        except (OSError, UnicodeDecodeError) as err:  # missing, a folder, or not readable by this uid
            raise ExposureError(
                f"ARCHIPELAGO_API_TOKEN_FILE={path} cannot be read by uid {os.getuid()} "
                f"({type(err).__name__}: {err}); mount the Secret readable by the Ray user (fsGroup)"
            ) from err
    return os.environ.get("ARCHIPELAGO_API_TOKEN") or None


class TokenSource:
    """The token requests are checked against. From a file it is re-read when the file
    changes (Kubernetes swaps a mounted Secret in place), so a rotated token takes effect
    without a restart. A change to a file that cannot be read, or to a token that
    `check_exposure` would refuse, keeps the previous token and says so in the log."""

    def __init__(self, token: str | None = None, path: str | Path | None = None) -> None:
        self.path = Path(path) if path else None
        self._token = token.encode("utf-8") if token is not None else None
        self._seen = self._stamp()

    def _stamp(self) -> tuple[int, int, int] | None:
        if self.path is None:
            return None
        try:
            st = self.path.stat()
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size, st.st_ino

    def current(self) -> bytes | None:
        stamp = self._stamp()
        if stamp is not None and stamp != self._seen:
            self._seen = stamp
            assert self.path is not None
            try:
                token = self.path.read_text().strip()
                check_exposure("0.0.0.0", token)
            except (OSError, UnicodeDecodeError, ExposureError) as err:
                log.error(
                    "the API token file %s changed but is not usable (%s); the previous token stays", self.path, err
                )
            else:
                self._token = token.encode("utf-8")
                log.warning("the API token was re-read from %s", self.path)
        return self._token


def configured_source(token: str | None) -> TokenSource:
    """`token` (from `configured_token`), followed in its file when it came from one."""
    return TokenSource(token, os.environ.get("ARCHIPELAGO_API_TOKEN_FILE") if token is not None else None)


def configured_read_source() -> TokenSource | None:
    """The read-only token, for dashboards and scrapers (every read, no mutation), from a
    file named by $ARCHIPELAGO_API_READ_TOKEN_FILE (followed as it is rotated) or from
    $ARCHIPELAGO_API_READ_TOKEN; None when neither is set. Held to the operator token's
    rules (no placeholder, long enough); raises `ExposureError` otherwise."""
    path = os.environ.get("ARCHIPELAGO_API_READ_TOKEN_FILE")
    if path:
        try:
            token: str | None = Path(path).read_text().strip() or None
        except FileNotFoundError:  # its Secret is optional (k8s/): none made, none mounted
            log.info("no read-only token at %s: reads need the operator token", path)
            return None
        except (OSError, UnicodeDecodeError) as err:
            raise ExposureError(f"ARCHIPELAGO_API_READ_TOKEN_FILE={path} cannot be read: {err}") from err
    else:
        token = os.environ.get("ARCHIPELAGO_API_READ_TOKEN") or None
    if token is None:
        return None
    check_exposure("0.0.0.0", token)
    if token == configured_token():
        raise ExposureError("the read-only token is the operator token: give readers a token of their own")
    return TokenSource(token, path or None)


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, token: str | None) -> None:
    """Raise `ExposureError` unless serving on `host` with `token` is safe to start."""
    if token is not None:
        if token.lower() in PLACEHOLDERS:
            raise ExposureError(
                f"the API token is the placeholder {token!r}: set a real one, e.g. "
                "`kubectl create secret generic archipelago-api-token --from-literal=token=$(openssl rand -hex 32)`"
            )
        if len(token) < MIN_TOKEN_LENGTH:
            raise ExposureError(f"the API token is {len(token)} characters; use at least {MIN_TOKEN_LENGTH}")
    elif not is_loopback(host):
        raise ExposureError(
            f"api.host = {host!r} exposes the control plane beyond this machine, and no API token is set: "
            "set ARCHIPELAGO_API_TOKEN_FILE (or ARCHIPELAGO_API_TOKEN), or serve on 127.0.0.1"
        )


def token_status(
    header: bytes, expected: bytes | None, what: str = "mutations", reader: bytes | None = None
) -> tuple[int, str] | None:
    """(status, reason) refusing a request with this raw `Authorization` header, or None.
    `reader`: the read-only token, accepted too (for reads). On bytes, in constant time: any
    bytes a client sends are compared as they came (a str comparison would raise on
    non-ASCII: a 500)."""
    if expected is None:
        return 403, f"{what} are disabled: no API token is configured (ARCHIPELAGO_API_TOKEN_FILE)"
    if header[:7].lower() != b"bearer ":
        return 401, "missing bearer token"
    sent = header[7:].strip()
    operator = hmac.compare_digest(sent, expected)
    if not operator and reader is not None and hmac.compare_digest(sent, reader):
        return None if what == "reads" else (403, "the read-only token cannot change the run")
    return None if operator else (403, "wrong token")
