"""What every request meets before a route (`api/limits.py`) and what every answer carries,
over real HTTP: strict request types, bodies no echo can break, one reading of
`Authorization`, loopback Host names on a loopback server, HEAD, and security headers."""

from __future__ import annotations

import base64
import hashlib
import re

import httpx
import pytest

from api.app import create_app
from api.limits import host_name
from tests.fake_handle import FakeRun
from tests.http_server import serving

TOKEN = "front-door-token-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def api():
    run = FakeRun()
    with serving(create_app(run, TOKEN)) as url, httpx.Client(base_url=url, timeout=10) as client:
        yield client, run


def _unchanged(run: FakeRun) -> tuple:
    return run.target, dict(run.settings), run.paused


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("post", "/v1/islands", {"count": True}),
        ("post", "/v1/islands", {"count": "2"}),
        ("post", "/v1/islands", {"count": 1.0}),
        ("put", "/v1/islands/target", {"target": False}),
        ("put", "/v1/islands/target", {"target": "4"}),
        ("patch", "/v1/run/settings", {"inner_steps": "100"}),
        ("patch", "/v1/run/settings", {"inner_steps": 100.0}),
        ("patch", "/v1/run/settings", {"outer_lr": True}),
        ("patch", "/v1/run/settings", {"outer_lr": "0.5"}),
    ],
)
def test_a_count_or_a_setting_of_the_wrong_json_type_is_refused(api, method, path, body):
    """`true`, `"2"` and `1.0` used to be accepted as a count (202)."""
    client, run = api
    before = _unchanged(run)
    r = getattr(client, method)(path, json=body, headers=AUTH)
    assert r.status_code == 422 and r.json()["detail"][0]["loc"][-1] == next(iter(body))
    assert _unchanged(run) == before


def test_an_integer_outer_lr_is_still_a_number(api):
    client, run = api
    assert client.patch("/v1/run/settings", json={"outer_lr": 1}, headers=AUTH).status_code == 202
    assert run.settings["outer_lr"] == 1.0


@pytest.mark.parametrize("path", ["/v1/islands", "/v1/islands/target", "/v1/run/settings"])
@pytest.mark.parametrize("body", [rb'{"count": "\ud800"}', rb'{"\udfff": 1}', rb'{"target": ["\udbff\udbff"]}'])
def test_lone_surrogates_in_a_body_get_a_422_in_ascii_json(api, path, body):
    """A lone surrogate echoed in the 422 could not be encoded as UTF-8: a 500 (it is
    escaped now, and the whole answer is ASCII)."""
    client, run = api
    before = _unchanged(run)
    method = {"/v1/islands": "POST", "/v1/islands/target": "PUT", "/v1/run/settings": "PATCH"}[path]
    r = client.request(method, path, content=body, headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"], r.text
    r.content.decode("ascii")
    assert _unchanged(run) == before


@pytest.mark.parametrize("method, path", [("POST", "/v1/run/pause"), ("GET", "/v1/run")])
def test_two_authorization_headers_are_refused_whichever_comes_first(api, method, path):
    """The front door read the last header and the route guard the first: a right token
    beside a wrong one passed one check and failed the other, depending on the order."""
    client, run = api
    for pair in ([f"Bearer {TOKEN}", "Bearer wrong"], ["Bearer wrong", f"Bearer {TOKEN}"]):
        r = client.request(method, path, headers=[(b"Authorization", v.encode()) for v in pair])
        assert r.status_code == 400 and "more than one Authorization" in r.json()["detail"]
    assert not run.paused


def test_head_is_answered_as_get_without_a_body(api):
    client, _ = api
    for path in ("/v1/run", "/v1/islands", "/"):
        get, head = client.get(path, headers=AUTH), client.head(path, headers=AUTH)
        assert head.status_code == get.status_code == 200 and head.content == b""
        assert head.headers["content-type"] == get.headers["content-type"]
    assert client.head("/v1/run").status_code == 401  # reads still need the token


def test_every_answer_carries_the_security_headers_and_the_page_a_pinned_policy(api):
    client, _ = api
    for r in (
        client.get("/v1/run", headers=AUTH),
        client.get("/v1/run"),
        client.post("/v1/run/pause"),
        client.get("/"),
    ):
        assert r.headers["x-content-type-options"] == "nosniff" and r.headers["x-frame-options"] == "DENY"
        assert r.headers["referrer-policy"] == "no-referrer" and r.headers["cache-control"] == "no-store"
    page = client.get("/")
    policy = page.headers["content-security-policy"]
    script = re.search(r"<script>(.*?)</script>", page.text, re.S).group(1)
    digest = base64.b64encode(hashlib.sha256(script.encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in policy and "'unsafe-inline'" not in policy
    assert "default-src 'none'" in policy and "frame-ancestors 'none'" in policy and "connect-src 'self'" in policy


def test_a_loopback_server_answers_loopback_host_names_only():
    """Reads are open on loopback without a token: a page whose DNS name was rebound to
    127.0.0.1 would send its own name as Host, and is refused."""
    run = FakeRun()
    with serving(create_app(run, None, loopback=True)) as url:
        port = url.rsplit(":", 1)[1]
        assert httpx.get(f"{url}/v1/run").status_code == 200
        for host in (f"localhost:{port}", f"[::1]:{port}", "127.0.0.1"):
            assert httpx.get(f"{url}/v1/run", headers={"Host": host}).status_code == 200, host
        for host in (f"attacker.example:{port}", "10.0.0.1", ""):
            r = httpx.get(f"{url}/v1/run", headers={"Host": host})
            assert r.status_code == 421 and "loopback" in r.json()["detail"], host
    with serving(create_app(run, TOKEN)) as url:  # served beyond loopback (with a token): any name
        assert httpx.get(f"{url}/v1/run", headers={**AUTH, "Host": "archipelago.example"}).status_code == 200


@pytest.mark.parametrize(
    ("header", "name"),
    [
        (b"localhost:8600", "localhost"),
        (b"[::1]:8600", "::1"),
        (b"127.0.0.1", "127.0.0.1"),
        (b"EXAMPLE.org", "example.org"),
        (b"", ""),
    ],
)
def test_host_name_drops_the_port(header, name):
    assert host_name(header) == name
