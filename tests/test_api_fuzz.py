"""Property-based fuzzing of the control plane's OpenAPI spec (schemathesis over real
HTTP): whatever a client sends, with or without the token, the API never answers 5xx."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is a test dependency")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from archipelago.api.app import create_app  # noqa: E402
from tests.fake_handle import FakeRun  # noqa: E402
from tests.http_server import serving  # noqa: E402

TOKEN = "fuzz-token"


@pytest.fixture(scope="module")
def base_url():
    with serving(create_app(FakeRun(islands=3), TOKEN)) as url:
        yield url


def test_fuzz_every_operation_no_5xx(base_url):
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json")
    calls = {"requests": 0}
    for op in schema.get_all_operations():
        operation = op.ok()

        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=operation.as_strategy())
        def fuzz(case):
            for headers in ({"Authorization": f"Bearer {TOKEN}"}, {}):
                response = case.call(base_url=base_url, headers=headers)
                calls["requests"] += 1
                case.validate_response(response, checks=[not_a_server_error])

        fuzz()
    print(f"fuzzed {calls['requests']} requests across {len(list(schema.get_all_operations()))} operations")
    assert calls["requests"] >= 200


def _raw(base_url: str, request: bytes) -> int:
    """Send `request` as bytes on a socket (no client library cleaning it up); the status."""
    import socket
    from urllib.parse import urlsplit

    where = urlsplit(base_url)
    with socket.create_connection((where.hostname, where.port), timeout=10) as s:
        s.sendall(request)
        head = b""
        while b"\r\n" not in head:
            chunk = s.recv(4096)
            if not chunk:
                break
            head += chunk
    return int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else 400  # no answer: the parser refused


_ROUTES = [(b"POST", b"/v1/islands"), (b"PUT", b"/v1/islands/target"), (b"PATCH", b"/v1/run/settings"),
           (b"DELETE", b"/v1/islands/1"), (b"POST", b"/v1/run/pause"), (b"GET", b"/v1/run"),
           (b"GET", b"/v1/events?since=0")]  # fmt: skip
_VALUE = st.binary(max_size=64).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(
    route=st.sampled_from(_ROUTES),
    body=st.one_of(
        st.binary(max_size=256),
        st.sampled_from(
            [b"{", b'{"count": NaN}', b"[]", b"null", b'{"count":1}', rb'{"count":"\ud800"}', rb'{"\udfff":1}']
        ),
    ),
    auth=st.one_of(_VALUE.map(lambda v: b"Bearer " + v), _VALUE, st.just(b"Bearer " + TOKEN.encode())),
    extra=_VALUE,
    content_type=st.sampled_from([b"application/json", b"text/plain", b"application/json; charset=\xff"]),
)
def test_invalid_json_and_arbitrary_header_bytes_never_get_a_5xx(base_url, route, body, auth, extra, content_type):
    """Beyond the schema: bodies that are not JSON, NaN, any bytes in Authorization and
    other headers (schemathesis sends only valid JSON and ASCII headers)."""
    method, path = route
    request = (
        method + b" " + path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\nAuthorization: " + auth
        + b"\r\nX-Fuzz: " + extra + b"\r\nContent-Type: " + content_type
        + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )  # fmt: skip
    status = _raw(base_url, request)
    assert status < 500, (request[:200], status)
