"""The control-plane API over real HTTP (uvicorn + httpx), against an in-process run."""

from __future__ import annotations

import httpx
import pytest

from archipelago.api.app import create_app
from tests.fake_handle import AUTH, TOKEN, FakeRun
from tests.http_server import serving


def test_read_endpoints(api):
    client, _ = api
    status = client.get("/v1/run", headers=AUTH).json()
    assert status["mode"] == "diloco" and status["version"] == 3
    islands = client.get("/v1/islands", headers=AUTH).json()
    assert [i["id"] for i in islands] == [0, 1, 2] and islands[2]["staleness_max"] == 4
    assert [r["round"] for r in client.get("/v1/run/history", params={"since": 1}, headers=AUTH).json()] == [2, 3]
    spec = client.get("/openapi.json").json()
    assert "/v1/islands/target" in spec["paths"] and "/v1/run/settings" in spec["paths"]


def test_mutations_need_the_token(api):
    client, run = api
    assert client.post("/v1/islands", json={"count": 1}).status_code == 401
    wrong = client.post("/v1/islands", json={"count": 1}, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 403 and run.target == 3
    ok = client.post("/v1/islands", json={"count": 2}, headers=AUTH)
    assert ok.status_code == 202 and ok.json()["detail"]["target"] == 5 and run.target == 5


def test_scaling_is_idempotent_and_bounded(api):
    client, run = api
    for _ in range(2):
        r = client.put("/v1/islands/target", json={"target": 4}, headers=AUTH)
        assert r.status_code == 202 and run.target == 4
    r = client.put("/v1/islands/target", json={"target": 9}, headers=AUTH)
    assert r.status_code == 422 and "outside" in r.json()["detail"] and run.target == 4


def test_a_command_retried_with_its_idempotency_key_is_applied_once(api):
    """A client that got no answer cannot know whether its `POST /v1/islands` was applied:
    sent again with the same `Idempotency-Key`, it gets the first answer and the target
    rises once; the key with another command is refused (422); a fresh key applies anew."""
    client, run = api
    key = {**AUTH, "Idempotency-Key": "add-one-3c9e"}
    first = client.post("/v1/islands", json={"count": 1}, headers=key)
    again = client.post("/v1/islands", json={"count": 1}, headers=key)
    assert first.status_code == again.status_code == 202 and first.json() == again.json() and run.target == 4
    other = client.put("/v1/islands/target", json={"target": 6}, headers=key)
    assert other.status_code == 422 and "another command" in other.json()["detail"] and run.target == 4
    fresh = client.post("/v1/islands", json={"count": 1}, headers={**AUTH, "Idempotency-Key": "add-one-77d0"})
    assert fresh.status_code == 202 and run.target == 5
    assert (
        client.post("/v1/islands", json={"count": 1}, headers={**AUTH, "Idempotency-Key": "k" * 256}).status_code == 422
    )
    assert run.target == 5


@pytest.mark.parametrize(
    "method, path, body, status",
    [
        ("post", "/v1/islands", {"count": 0}, 422),
        ("post", "/v1/islands", {"count": "many"}, 422),
        ("post", "/v1/islands", {"count": 1, "gpus": 8}, 422),
        ("put", "/v1/islands/target", {}, 422),
        ("delete", "/v1/islands/42", None, 404),
        ("delete", "/v1/islands/-1", None, 422),
        ("post", "/v1/islands/42/preempt", None, 404),
        ("post", "/v1/islands/x/preempt", None, 422),
        ("post", "/v1/run/explode", None, 404),
        ("patch", "/v1/run/settings", {}, 422),
        ("patch", "/v1/run/settings", {"inner_steps": 0}, 422),
        ("patch", "/v1/run/settings", {"outer_lr": -1}, 422),
        ("patch", "/v1/run/settings", {"learning_rate": 1}, 422),
    ],
)
def test_bad_requests_get_4xx_with_a_reason_and_change_nothing(api, method, path, body, status):
    client, run = api
    before = (run.target, dict(run.settings), {k: v["state"] for k, v in run.isl.items()})
    kwargs = {"headers": AUTH} | ({"json": body} if body is not None else {})
    r = getattr(client, method)(path, **kwargs)
    assert r.status_code == status and r.json()["detail"]
    assert (run.target, run.settings, {k: v["state"] for k, v in run.isl.items()}) == before


def test_controls_and_settings(api):
    client, run = api
    assert client.post("/v1/run/pause", headers=AUTH).status_code == 202 and run.paused
    assert client.get("/v1/run", headers=AUTH).json()["state"] == "paused"
    assert client.post("/v1/run/resume", headers=AUTH).status_code == 202 and not run.paused
    r = client.patch("/v1/run/settings", json={"inner_steps": 100}, headers=AUTH)
    assert r.status_code == 202 and run.settings["inner_steps"] == 100
    assert client.delete("/v1/islands/1", headers=AUTH).status_code == 202 and run.isl["1"]["state"] == "draining"
    target = run.target
    r = client.post("/v1/islands/2/preempt", headers=AUTH)
    assert r.status_code == 202 and run.isl["2"]["state"] == "draining" and run.target == target  # it is replaced
    assert client.post("/v1/islands/2/preempt", headers=AUTH).status_code == 409  # already leaving
    assert client.post("/v1/run/stop", headers=AUTH).status_code == 202 and run.stopped


def test_prometheus_text_format(api):
    client, _ = api
    r = client.get("/metrics", headers=AUTH)
    assert r.headers["content-type"].startswith("text/plain")
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    staleness = families["archipelago_island_staleness_versions"]
    assert {s.labels["island"]: s.value for s in staleness.samples} == {"0": 0.0, "1": 1.0, "2": 2.0}
    assert families["archipelago_eval_loss"].samples[0].value == 2.25
    assert families["archipelago_tokens"].type == "counter"


def test_mutations_refused_without_a_configured_token():
    run = FakeRun()
    with serving(create_app(run, None)) as url:
        r = httpx.post(f"{url}/v1/run/stop", headers={"Authorization": "Bearer anything"})
    assert r.status_code == 403 and "no API token" in r.json()["detail"] and not run.stopped


def test_a_non_ascii_bearer_is_refused_with_a_403_not_a_500(api):
    client, run = api
    for raw in (b"Bearer \xe9\xff", "Bearer é".encode(), b"Bearer " + TOKEN.encode() + b"\xe9"):
        r = client.post("/v1/run/pause", headers=[(b"Authorization", raw)])
        assert r.status_code == 403, (raw, r.status_code, r.text)
    assert not run.paused
    assert client.post("/v1/run/pause", headers=AUTH).status_code == 202 and run.paused


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/islands", b'{"count": NaN}'),
        ("PUT", "/v1/islands/target", b'{"target": Infinity}'),
        ("PATCH", "/v1/run/settings", b'{"outer_lr": -Infinity}'),
        ("PATCH", "/v1/run/settings", b'{"outer_lr": NaN, "inner_steps": 5}'),
    ],
)
def test_non_finite_numbers_in_a_body_get_a_422_in_valid_json(api, method, path, body):
    client, run = api
    before = (run.target, dict(run.settings))
    r = client.request(method, path, content=body, headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 422 and r.json()["detail"], r.text  # parseable JSON, with a reason
    assert (run.target, run.settings) == before


def test_a_diverged_runs_nan_loss_is_served_as_null(api, monkeypatch):
    client, run = api
    status = {**run.status(), "eval_loss": float("nan"), "tokens_per_s": float("inf")}
    monkeypatch.setattr(run, "status", lambda: status)
    r = client.get("/v1/run", headers=AUTH)
    assert r.status_code == 200 and r.json()["eval_loss"] is None and r.json()["tokens_per_s"] is None


def test_reads_need_the_token_unless_public():
    """Before: every GET (status, islands with hostnames and errors, events, metrics) was open."""
    run = FakeRun()
    with serving(create_app(run, TOKEN)) as url:
        for path in ("/v1/run", "/v1/islands", "/v1/events", "/v1/run/history", "/metrics"):
            assert httpx.get(url + path).status_code == 401, path
            assert httpx.get(url + path, headers={"Authorization": "Bearer wrong"}).status_code == 403, path
            assert httpx.get(url + path, headers=AUTH).status_code == 200, path
        spec = httpx.get(url + "/openapi.json").json()  # the API's shape is public; the run's data is not
        assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
        assert {"HTTPBearer": []} in spec["paths"]["/v1/islands"]["post"]["security"]
    with serving(create_app(run, TOKEN, public_reads=True)) as url:
        assert httpx.get(url + "/v1/run").status_code == 200
        assert httpx.post(url + "/v1/run/stop").status_code == 401 and not run.stopped


def test_request_bodies_are_bounded_and_unauthenticated_ones_are_never_read(api):
    """Before: a body was read whole, with no limit, before the auth check."""
    client, run = api
    big = b'{"count": 1, "pad": "' + b"x" * 200_000 + b'"}'
    r = client.post("/v1/islands", content=big, headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413 and "bytes" in r.json()["detail"]

    def chunks():  # no Content-Length: the server must stop reading at the limit
        for _ in range(100):
            yield b"x" * 10_000

    r = client.post("/v1/islands", content=chunks(), headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 413
    r = client.post("/v1/islands", content=big, headers={"content-type": "application/json"})
    assert r.status_code == 401  # refused before its body is read
    assert run.target == 3
    assert client.post("/v1/islands", json={"count": 1}, headers=AUTH).status_code == 202 and run.target == 4


def test_history_and_events_are_paged(api):
    client, run = api
    run.round = 9
    page = client.get("/v1/run/history", params={"since": 2, "limit": 3}, headers=AUTH).json()
    assert [r["round"] for r in page] == [3, 4, 5]
    assert client.get("/v1/run/history", params={"limit": 0}, headers=AUTH).status_code == 422
    assert client.get("/v1/run/history", params={"limit": 10**6}, headers=AUTH).status_code == 422
    assert client.get("/v1/run/history", params={"limit": 501}, headers=AUTH).status_code == 422  # 24 MiB pages were
    for n in range(5):
        client.put("/v1/islands/target", json={"target": 1 + n}, headers=AUTH)
    events = client.get("/v1/events", params={"since": 1, "limit": 2}, headers=AUTH).json()
    assert [e["target"] for e in events] == [2, 3]


def test_released_islands_have_no_metric_series(api):
    client, run = api
    run.isl["1"]["state"] = "dead"
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(client.get("/metrics", headers=AUTH).text)}
    assert {s.labels["island"] for s in families["archipelago_island_staleness_versions"].samples} == {"0", "2"}


@pytest.mark.parametrize(
    ("host", "token", "error"),
    [
        ("0.0.0.0", None, "no API token"),
        ("10.1.2.3", None, "no API token"),
        ("127.0.0.1", "change-me", "placeholder"),
        ("0.0.0.0", "short", "at least 16"),
    ],
)
def test_an_exposed_control_plane_without_a_usable_token_is_refused(host, token, error):
    from archipelago.api.auth import ExposureError, check_exposure

    with pytest.raises(ExposureError, match=error):
        check_exposure(host, token)


def test_loopback_without_a_token_and_any_host_with_a_real_token_are_allowed():
    from archipelago.api.auth import check_exposure

    for host in ("127.0.0.1", "::1", "localhost"):
        check_exposure(host, None)
    check_exposure("0.0.0.0", "a" * 32)


def test_a_token_file_that_cannot_be_read_is_an_exposure_error_naming_it(tmp_path, monkeypatch):
    """A Secret mounted root-only under a non-root Ray user raised a bare PermissionError,
    which the start-up did not catch as an exposure error."""
    from archipelago.api.auth import ExposureError, configured_token

    binary = tmp_path / "binary"
    binary.write_bytes(b"\xff\xfe token")
    for path in (tmp_path / "missing", tmp_path, binary):
        monkeypatch.setenv("ARCHIPELAGO_API_TOKEN_FILE", str(path))
        with pytest.raises(ExposureError, match=f"ARCHIPELAGO_API_TOKEN_FILE={path} cannot be read by uid"):
            configured_token()
    good = tmp_path / "token"
    good.write_text("a-real-token-0123456789\n")
    monkeypatch.setenv("ARCHIPELAGO_API_TOKEN_FILE", str(good))
    assert configured_token() == "a-real-token-0123456789"
