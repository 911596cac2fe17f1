"""The control plane served with a real run on local Ray, over HTTP."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.runtime.driver import run
from tests.helpers import toy_quadratic
from tests.http_server import free_port

pytestmark = pytest.mark.ray
TOKEN = "api-ray-test-token-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _wait_for_round(client: httpx.Client, rounds: int, timeout_s: float = 120) -> float:
    """Until the control plane serves and the run has done `rounds`; the deadline it kept."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            if client.get("/v1/run").json().get("round", 0) >= rounds:
                break
        except httpx.HTTPError:
            pass  # not serving yet
        time.sleep(0.2)
    return deadline


def test_control_plane_watches_and_scales_a_live_run(ray_local, tmp_path, monkeypatch):
    monkeypatch.setenv("ARCHIPELAGO_API_TOKEN", TOKEN)
    port = free_port()
    cfg = load_config(
        None,
        toy_quadratic(
            2,
            0.03,
            "islands.cpus=0.5",
            "inner_steps=4",
            "rounds=3000",
            "api.enabled=true",
            f"api.port={port}",
            # about the control plane, not admission: on a loaded machine the newcomer can join
            # after the others converged, and the norm guard would rightly flag its first update
            "robust.norm_ratio=null",
            f"out_dir={tmp_path / 'out'}",
        ),
    )
    box = {}
    thread = threading.Thread(target=lambda: box.update(summary=run(cfg, show_progress=False, run_id="apitest")))
    thread.start()
    url = f"http://127.0.0.1:{port}"
    client = httpx.Client(base_url=url, timeout=10, headers=AUTH)  # reads need the token too
    try:
        deadline = _wait_for_round(client, 2)
        status = client.get("/v1/run").json()
        assert status["run_id"] == "apitest" and status["mode"] == "diloco" and status["target_islands"] == 2
        assert client.post("/v1/islands", json={"count": 1}, headers={"Authorization": ""}).status_code == 401
        assert client.get("/v1/islands", headers={"Authorization": ""}).status_code == 401
        keyed = {**AUTH, "Idempotency-Key": "add-one-a41c"}
        r = client.post("/v1/islands", json={"count": 1}, headers=keyed)
        assert r.status_code == 202 and r.json()["detail"]["target"] == 3
        retried = client.post("/v1/islands", json={"count": 1}, headers=keyed)  # an answer lost, sent again
        assert retried.status_code == 202 and retried.json() == r.json()
        bad = client.put("/v1/islands/target", json={"target": 500}, headers=AUTH)
        assert bad.status_code == 422 and "outside" in bad.json()["detail"]
        while time.time() < deadline and len(client.get("/v1/islands").json()) < 3:
            time.sleep(0.2)
        assert {i["id"] for i in client.get("/v1/islands").json()} == {0, 1, 2}
        assert client.get("/v1/run").json()["target_islands"] == 3  # the retried add raised it once
        scraped = {f.name: f for f in text_string_to_metric_families(client.get("/metrics").text)}
        assert {"run_id": "apitest", "island": "2"} in [
            s.labels for s in scraped["archipelago_island_staleness_versions"].samples
        ]
        while time.time() < deadline and not client.get("/v1/islands").json()[2]["rounds_contributed"]:
            time.sleep(0.2)
        newcomer = client.get("/v1/islands").json()[2]
        assert (
            newcomer["rounds_contributed"] > 0 and newcomer["last_contribution"] > 0 and newcomer["tokens_per_s"] > 0
        ), (
            newcomer,
            [e for e in client.get("/v1/events").json() if e["kind"] not in ("checkpoint",)][-20:],
        )
        assert client.post("/v1/islands", json={"count": "two"}, headers=AUTH).status_code == 422
        assert client.delete("/v1/islands/0", headers=AUTH).status_code == 202
        assert client.delete("/v1/islands/77", headers=AUTH).status_code == 404
        while time.time() < deadline and client.get("/v1/islands").json()[0]["state"] != "drained":
            time.sleep(0.2)
        assert client.get("/v1/islands").json()[0]["state"] == "drained"
        latencies = []
        for _ in range(50):
            t0 = time.perf_counter()
            assert client.get("/v1/run").status_code == 200
            latencies.append(time.perf_counter() - t0)
        latencies.sort()
        print(f"status latency under a run: p50 {latencies[25] * 1000:.1f} ms, p95 {latencies[47] * 1000:.1f} ms")
        assert latencies[47] < 1.0
        events = client.get("/v1/events").json()
        assert any(e["kind"] == "join" and e["island"] == 2 for e in events)
        assert [e["bundles"] for e in events if e["kind"] == "resources_requested"] == [2, 3, 2]  # drain lowers it
        assert client.get("/v1/islands").json()[0]["resources"] == {"CPU": 0.5}
        assert client.post("/v1/run/stop", headers=AUTH).status_code == 202
    finally:  # a failed check must not leave the run training beside the next tests
        if thread.is_alive():
            client.post("/v1/run/stop", headers=AUTH)
        thread.join(timeout=60)
    assert box["summary"]["outer_steps"] < 3000


def test_a_frozen_slice_holds_neither_reads_nor_a_stop(ray_local, tmp_path, monkeypatch):
    """Before: every `GET /v1/run` asked each coordinator slice for the outer lr, with no
    timeout, behind its part save; three such reads held the coordinator's control threads
    and a Stop went unanswered. A slice frozen by SIGSTOP (the slowest a save can be: its
    process answers nothing) while the run checkpoints every round: the engine waits on it,
    reads are served from the published snapshot in under 2 s, a Stop is accepted (202); once
    the slice runs again the run stops there, its last checkpoint written."""
    import os
    import signal

    import ray

    from archipelago.orchestrator.runtime.names import NAMESPACE, coordinator_name

    monkeypatch.setenv("ARCHIPELAGO_API_TOKEN", TOKEN)
    port = free_port()
    overrides = ["islands.cpus=0.5", "inner_steps=4", "rounds=3000", "coordinator.shards=2"]
    cfg = load_config(
        None,
        toy_quadratic(2, 0.02, *overrides, "checkpoint.every_rounds=1", "api.enabled=true", f"api.port={port}",
                      f"out_dir={tmp_path / 'out'}"),
    )  # fmt: skip
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(summary=run(cfg, show_progress=False, run_id="frozen")))
    thread.start()
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10, headers=AUTH)
    pid = None
    try:
        _wait_for_round(client, 2)
        (frozen,) = [
            a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "-frozen-slice-1-" in a["name"]
        ]
        actor = ray.get_actor(frozen, namespace=NAMESPACE)
        pid = ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=30)
        os.kill(pid, signal.SIGSTOP)
        time.sleep(3)  # the engine is now waiting on the slice (its round closes every ~0.2 s)
        held = client.get("/v1/run").json()["round"]
        took = []
        for _ in range(5):  # more reads than the coordinator has control threads
            t0 = time.perf_counter()
            status = client.get("/v1/run")
            took.append(time.perf_counter() - t0)
            assert status.status_code == 200 and status.json()["run_id"] == "frozen"
        assert client.get("/v1/islands").status_code == 200
        t0 = time.perf_counter()
        stop = client.post("/v1/run/stop", headers=AUTH)
        took.append(time.perf_counter() - t0)
        assert stop.status_code == 202, stop.text
        assert max(took) < 2.0, took
        assert client.get("/v1/run").json()["round"] == held  # the engine really was held
        print(f"reads and a stop beside a frozen slice: slowest {max(took) * 1000:.0f} ms")
        # the coordinator itself frozen (as one still starting, or on a host too loaded to
        # schedule it): before, a read waited 10 s for it; now the last answer, within 2 s
        coordinator = ray.get_actor(coordinator_name("frozen"), namespace=NAMESPACE)
        coordinator_pid = ray.get(coordinator.__ray_call__.remote(lambda _self: os.getpid()), timeout=30)
        os.kill(coordinator_pid, signal.SIGSTOP)
        try:
            t0 = time.perf_counter()
            status = client.get("/v1/run")
            slow = time.perf_counter() - t0
            islands = client.get("/v1/islands")
            assert slow < 2.0 and time.perf_counter() - t0 < 4.0, slow
            assert status.status_code == 200 and status.json()["coordinator"] == "slow", status.text
            assert islands.status_code == 200 and client.get("/v1/events").json() == []
            for _ in range(5):  # asked again and again while it is frozen: each within the wait, the last answer
                t0 = time.perf_counter()
                assert client.get("/v1/run").json()["coordinator"] == "slow"
                assert time.perf_counter() - t0 < 2.0
        finally:
            os.kill(coordinator_pid, signal.SIGCONT)
        deadline = time.time() + 30
        while client.get("/v1/run").json()["coordinator"] != "running":
            assert time.time() < deadline, "the coordinator's reads never answered again"
            time.sleep(0.2)
        os.kill(pid, signal.SIGCONT)
        pid = None
        thread.join(timeout=120)
        assert box["summary"]["state"] == "stopped" and held <= box["summary"]["rounds_done"] <= held + 2
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        if thread.is_alive():
            client.post("/v1/run/stop", headers=AUTH)
        thread.join(timeout=60)
