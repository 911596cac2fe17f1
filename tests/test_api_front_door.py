"""What every request meets before a route (`api/limits.py`) and what every answer carries,
over real HTTP: strict request types, bodies no echo can break, one reading of
`Authorization`, loopback Host names on a loopback server, HEAD, and security headers."""

from __future__ import annotations

import base64
import hashlib
import re
import ssl

import httpx
import pytest

from archipelago.api.app import create_app
from archipelago.api.limits import host_name
from tests.fake_handle import AUTH, TOKEN, FakeRun
from tests.http_server import serving


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


def test_a_rotated_token_file_takes_effect_without_a_restart(tmp_path):
    """Kubernetes updates a mounted Secret in place; the token was read once at start, so
    rotating it needed a restart. A rotation to a token the start would refuse keeps the
    previous one."""
    import logging

    from archipelago.api.auth import TokenSource

    said: list[str] = []
    listener = logging.Handler(logging.WARNING)
    listener.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("archipelago.api.auth").addHandler(listener)  # on the logger: whatever the CLI configured
    first, second = "first-token-0123456789", "second-token-0123456789"
    token_file = tmp_path / "token"
    token_file.write_text(first + "\n")
    run = FakeRun()
    with serving(create_app(run, TokenSource(first, token_file))) as url:

        def pause_with(token: str) -> int:
            return httpx.post(f"{url}/v1/run/pause", headers={"Authorization": f"Bearer {token}"}).status_code

        assert pause_with(first) == 202
        replacement = tmp_path / "token.new"
        replacement.write_text(second + "\n")
        replacement.replace(token_file)  # as the kubelet swaps the Secret's files
        assert pause_with(first) == 403 and pause_with(second) == 202
        assert httpx.get(f"{url}/v1/run", headers={"Authorization": f"Bearer {second}"}).status_code == 200
        token_file.write_text("change-me")
        assert pause_with(second) == 202 and pause_with("change-me") == 403
    logging.getLogger("archipelago.api.auth").removeHandler(listener)
    assert any("re-read" in m for m in said) and any("not usable" in m and "previous token stays" in m for m in said)


def test_the_control_plane_serves_https_with_a_certificate_and_its_key(tmp_path):
    """`api.tls_cert` / `api.tls_key` (`archipelago serve --tls-cert --tls-key`): the token
    travels in every request, so beyond a private network it should travel encrypted."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    with serving(create_app(FakeRun(), TOKEN), tls=(str(cert), str(key))) as url:
        assert url.startswith("https://")
        r = httpx.get(f"{url}/v1/run", headers=AUTH, verify=ssl.create_default_context(cafile=str(cert)))
        assert r.status_code == 200 and r.json()["mode"] == "diloco"
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port is not served
            httpx.get(url.replace("https://", "http://") + "/v1/run", headers=AUTH)


def test_tls_settings_are_checked_before_anything_starts(tmp_path):
    from archipelago.orchestrator.config_load import ConfigError, load_config

    (tmp_path / "cert.pem").write_text("x")
    with pytest.raises(ConfigError, match=r"api\.tls_cert needs api\.tls_key"):
        load_config(None, [f"api.tls_cert={tmp_path / 'cert.pem'}"])
    with pytest.raises(ConfigError, match=r"api\.tls_key: .*missing\.pem is not a file"):
        load_config(None, [f"api.tls_cert={tmp_path / 'cert.pem'}", f"api.tls_key={tmp_path / 'missing.pem'}"])
