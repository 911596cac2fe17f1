"""Who may read and how often, over real HTTP: a read-only token for dashboards and
scrapers beside the operator's, and a per-client rate limit answered with 429 and
`Retry-After` (`api/auth.py`, `api/limits.py`)."""

from __future__ import annotations

import httpx
import pytest

from api.app import create_app
from api.auth import ExposureError, TokenSource, configured_read_source
from api.limits import RateLimit
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
    path.write_text(READER + "\n")
    monkeypatch.setenv("ARCHIPELAGO_API_READ_TOKEN_FILE", str(path))
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
