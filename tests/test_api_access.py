"""Who may read and how often, over real HTTP: a read-only token for dashboards and
scrapers beside the operator's, and a per-client rate limit answered with 429 and
`Retry-After` (`api/auth.py`, `api/limits.py`)."""

from __future__ import annotations

import httpx
import pytest

from archipelago.api.app import create_app
from archipelago.api.auth import ExposureError, TokenSource, configured_read_source
from archipelago.api.limits import RateLimit
from tests.fake_handle import AUTH, TOKEN, FakeRun
from tests.http_server import serving

READER = "read-only-token-0123456789"
READ = {"Authorization": f"Bearer {READER}"}


def test_the_read_only_token_reads_everything_and_changes_nothing():
    run = FakeRun()
    with serving(create_app(run, TOKEN, read_token=TokenSource(READER))) as url, httpx.Client(base_url=url) as c:
        for path in ("/v1/run", "/v1/islands", "/v1/events", "/v1/run/history", "/metrics"):
            assert c.get(path, headers=READ).status_code == 200, path
            assert c.get(path).status_code == 401, path  # reads still need one of the two tokens
            assert c.get(path, headers={"Authorization": "Bearer not-a-token-at-all"}).status_code == 403, path
        before = (run.target, dict(run.settings), run.paused)
        for method, path, body in (
            ("post", "/v1/run/pause", None),
            ("put", "/v1/islands/target", {"target": 7}),
            ("patch", "/v1/run/settings", {"outer_lr": 0.1}),
            ("delete", "/v1/islands/1", None),
        ):
            r = c.request(method, path, json=body, headers=READ)
            assert r.status_code == 403 and "read-only" in r.json()["detail"], (path, r.text)
        assert (run.target, dict(run.settings), run.paused) == before
        assert c.post("/v1/run/pause", headers=AUTH).status_code == 202  # the operator's still does


def test_a_read_only_token_must_be_usable_and_not_the_operators(monkeypatch, tmp_path):
    monkeypatch.delenv("ARCHIPELAGO_API_READ_TOKEN_FILE", raising=False)
    monkeypatch.delenv("ARCHIPELAGO_API_READ_TOKEN", raising=False)
    assert configured_read_source() is None
    monkeypatch.setenv("ARCHIPELAGO_API_READ_TOKEN", "change-me")
    with pytest.raises(ExposureError, match="placeholder"):
        configured_read_source()
    monkeypatch.setenv("ARCHIPELAGO_API_TOKEN", TOKEN + "-long-enough")
    monkeypatch.setenv("ARCHIPELAGO_API_READ_TOKEN", TOKEN + "-long-enough")
    with pytest.raises(ExposureError, match="operator token"):
        configured_read_source()
    path = tmp_path / "read-token"
    monkeypatch.setenv("ARCHIPELAGO_API_READ_TOKEN_FILE", str(path))
    assert configured_read_source() is None  # its optional Secret not made: not mounted, no reader token
    path.write_text(READER + "\n")
    source = configured_read_source()
    assert source is not None and source.current() == READER.encode()


def test_the_bucket_admits_a_burst_then_the_rate_and_says_when():
    now = [0.0]
    rate = RateLimit(per_s=2.0, burst=3, clock=lambda: now[0])
    assert [rate.wait_s("a") for _ in range(3)] == [0.0, 0.0, 0.0]
    assert rate.wait_s("a") == pytest.approx(0.5)  # one token a half second
    assert rate.wait_s("b") == 0.0  # another client has its own bucket
    now[0] += 0.5
    assert rate.wait_s("a") == 0.0 and rate.wait_s("a") == pytest.approx(0.5)
    now[0] += 100
    for i in range(RateLimit.MAX_CLIENTS + 10):  # the table stays bounded whoever connects
        rate.wait_s(f"client-{i}")
    assert len(rate.buckets) == RateLimit.MAX_CLIENTS and "a" not in rate.buckets


def test_a_client_past_its_rate_gets_429_with_retry_after():
    app = create_app(FakeRun(), TOKEN, rate=RateLimit(per_s=0.5, burst=5))
    with serving(app) as url, httpx.Client(base_url=url) as c:
        codes = [c.get("/v1/run", headers=AUTH).status_code for _ in range(8)]
        assert codes[:5] == [200] * 5 and set(codes[5:]) == {429}, codes
        r = c.get("/v1/run", headers=AUTH)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert "too many" in r.json()["detail"] and r.headers["x-content-type-options"] == "nosniff"
        assert c.post("/v1/run/pause", headers=AUTH).status_code == 429  # mutations count too


def test_spoofed_forwarded_addresses_from_loopback_are_limited_as_one_client():
    """uvicorn trusts `X-Forwarded-For` from loopback unless told otherwise: 100 requests, each
    claiming a new address, were each given a fresh bucket. Served as the control plane
    serves it, they are one peer's (burst 3, then 429), like the same requests without it."""
    app = create_app(FakeRun(), TOKEN, public_reads=True, rate=RateLimit(per_s=0.01, burst=3))
    with serving(app) as url, httpx.Client(base_url=url) as c:
        spoofed = [c.get("/v1/run", headers={"X-Forwarded-For": f"10.9.{i // 250}.{i % 250}"}) for i in range(100)]
        assert [r.status_code for r in spoofed].count(200) == 3, [r.status_code for r in spoofed]
    fresh = create_app(FakeRun(), TOKEN, public_reads=True, rate=RateLimit(per_s=0.01, burst=3))
    with serving(fresh) as url, httpx.Client(base_url=url) as c:
        plain = [c.get("/v1/run").status_code for _ in range(100)]
    assert plain.count(200) == 3


def test_no_unauthenticated_flood_locks_the_operator_or_the_reader_out():
    """The flood claims to be loopback, sends no token or a wrong one, and empties its own
    bucket; the operator's stop and the reader's status are still answered."""
    run = FakeRun()
    app = create_app(run, TOKEN, read_token=TokenSource(READER), rate=RateLimit(per_s=0.01, burst=3))
    with serving(app) as url, httpx.Client(base_url=url) as c:
        flood = [
            c.get(
                "/v1/run",
                headers={
                    "X-Forwarded-For": "127.0.0.1",
                    **({"Authorization": "Bearer a-wrong-token-0123"} if i % 2 else {}),
                },
            )
            for i in range(40)
        ]
        assert {r.status_code for r in flood[5:]} == {429}
        assert c.get("/v1/run", headers=READ).status_code == 200
        assert c.post("/v1/run/stop", headers=AUTH).status_code == 202
        assert c.post("/v1/run/stop", headers={"X-Forwarded-For": "127.0.0.1"}).status_code == 429


def test_a_configured_proxy_names_the_client_and_nobody_else_does():
    """Behind an ingress (`api.trusted_proxies`), each forwarded client has its own bucket."""
    from archipelago.api.server import server_config
    from tests.http_server import free_port

    app = create_app(FakeRun(), TOKEN, public_reads=True, rate=RateLimit(per_s=0.01, burst=2))
    config = server_config(app, "127.0.0.1", free_port(), trusted_proxies=("127.0.0.0/8",))
    config.load()
    assert config.proxy_headers and config.forwarded_allow_ips == ["127.0.0.0/8"]
    assert not server_config(app, "127.0.0.1", 1).proxy_headers
    with serving(app, trusted_proxies=("127.0.0.0/8",)) as url, httpx.Client(base_url=url) as c:
        first = [c.get("/v1/run", headers={"X-Forwarded-For": "10.0.0.1"}).status_code for _ in range(3)]
        other = [c.get("/v1/run", headers={"X-Forwarded-For": "10.0.0.2"}).status_code for _ in range(2)]
    assert first == [200, 200, 429] and other == [200, 200]


def test_trusted_proxies_must_be_addresses_or_networks():
    from archipelago.orchestrator.config import ApiConfig

    assert ApiConfig(trusted_proxies=["10.0.0.0/8", "::1"]).trusted_proxies == ["10.0.0.0/8", "::1"]
    with pytest.raises(ValueError, match="not an address or a network"):
        ApiConfig(trusted_proxies=["ingress.local"])


def test_a_second_control_plane_on_the_node_takes_the_next_free_port_of_its_range():
    """Two runs on one Ray cluster each serve a control plane on its head: the second finds
    the first's port taken and serves on the next of `api.port … + api.ports` (bound before
    uvicorn starts, so two starting at once cannot pick the same one); a range all taken is
    an error naming it, or, for a run's own control plane, a port the system picks."""
    import socket

    from archipelago.api.server import ControlPlane, bind_first_free
    from tests.http_server import free_port, free_port_range

    base = free_port_range(3)
    token = TokenSource(TOKEN + "-long-enough")
    first = ControlPlane(FakeRun(), "127.0.0.1", base, token, ports=3)
    second = ControlPlane(FakeRun(), "127.0.0.1", base, token, ports=3)
    try:
        assert (first.port, second.port) == (base, base + 1)
        for plane in (first, second):
            page = httpx.get(plane.address() + "/", timeout=5)
            assert page.status_code == 200 and "<html" in page.text.lower()
        # a TCP socket by name: asyncio sets TCP_NODELAY on what it accepts only then, and
        # without it every response waited out the client's delayed ACK (44 ms a request,
        # against 2 ms; the REST chaos run outran its own requests)
        probe = bind_first_free("127.0.0.1", free_port())
        assert probe.proto == socket.IPPROTO_TCP
        probe.close()
        with socket.socket() as third:
            third.bind(("127.0.0.1", base + 2))
            with pytest.raises(OSError, match=f"every port of 127.0.0.1:{base}-{base + 2} is taken"):
                bind_first_free("127.0.0.1", base, 3)
            # a run's own control plane overflows: a port the system picks, outside the range
            fourth = ControlPlane(FakeRun(), "127.0.0.1", base, token, ports=3, overflow=True)
            try:
                assert fourth.port not in range(base, base + 3)
                page = httpx.get(fourth.address() + "/", timeout=5)
                assert page.status_code == 200 and "<html" in page.text.lower()
            finally:
                fourth.shutdown()
    finally:
        first.shutdown()
        second.shutdown()
