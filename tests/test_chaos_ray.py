"""Chaos over REST against a live run (seeded, bounded, loopback only), as an operator and an
attacker would try it: adds, a drain, pause/resume and a settings change through the API,
every mutating route hit with unauthenticated header variants and with malformed bodies, a
background reader on every read route (with the read-only token, five reads every 50 ms),
island processes killed mid-round and the coordinator actor killed twice — with the
shipped rate limit on. The run must finish every round with exact token accounting and a
loss within 2% of the fault-free run with the same seed, the API must never answer 5xx or
accept an unauthenticated mutation, the reader's flood must never limit the operator, and
no accepted add may be lost or, retried with its idempotency key, applied twice."""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest
import ray

from archipelago.orchestrator.bench.simulation.config import SimulationConfig
from archipelago.orchestrator.bench.simulation.runner import run_in_process
from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.engine.state.checkpoints import one_run
from archipelago.orchestrator.runtime.driver import run
from archipelago.orchestrator.runtime.names import NAMESPACE, coordinator_name, island_name
from tests.helpers import toy_quadratic
from tests.http_server import free_port

pytestmark = pytest.mark.ray

TOKEN = "chaos-test-token-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
READER = "chaos-read-only-token-0123456789"
READ = {"Authorization": f"Bearer {READER}"}
ROUNDS = 30
MUTATIONS = [
    ("POST", "/v1/islands", {"count": 1}),
    ("PUT", "/v1/islands/target", {"target": 3}),
    ("DELETE", "/v1/islands/0", None),
    ("POST", "/v1/run/pause", None),
    ("POST", "/v1/run/resume", None),
    ("POST", "/v1/run/stop", None),
    ("PATCH", "/v1/run/settings", {"outer_lr": 0.1}),
]
UNAUTHENTICATED: list[list[tuple[bytes, bytes]]] = [
    [],
    [(b"authorization", b"")],
    [(b"authorization", b"Bearer")],
    [(b"authorization", b"Bearer wrong-token")],
    [(b"authorization", b"Basic " + TOKEN.encode())],
    [(b"authorization", TOKEN.encode())],
    [(b"authorization", b"Bearer " + TOKEN.encode() + b"x")],
    [(b"authorization", b"Bearer \xe9\xff" + TOKEN.encode())],
]
MALFORMED = [
    b"", b"{", b"[]", b"null", b"true", b"1", b'"count"', b"\xff\xfe\x00", b"{'count': 1}",
    b'{"count": NaN}', b'{"count": Infinity}', b'{"count": -1}', b'{"count": 0}', b'{"count": 1e400}',
    b'{"count": "many"}', b'{"count": 1, "gpus": 8}', b'{"count": [1]}', b'{"count": 100000}',
    b'{"target": -3}', b'{"target": "x"}', b'{"target": 99999}', b'{"target": null}',
    b'{"inner_steps": 0}', b'{"inner_steps": -5}', b'{"outer_lr": -1}', b'{"outer_lr": NaN}',
    b'{"outer_lr": 1e9}', b'{"learning_rate": 1}', b"{}", b'{"inner_steps": "ten"}',
    b'{"inner_steps": 1.5}', b"\x00" * 64, b"x" * 70_000,
]  # fmt: skip


def _cfg(tmp_path: Path, name: str, port: int | None = None, *extra: str):
    api = ["api.enabled=true", f"api.port={port}"] if port else []  # the shipped rate limit
    return load_config(
        None,
        toy_quadratic(
            3,
            0.02,
            "islands.cpus=0.5",
            "inner_steps=4",
            f"rounds={ROUNDS}",
            "checkpoint.every_rounds=2",
            "checkpoint.max_restarts=4",
            "elastic.max_islands=6",
            "seed=0",
            f"out_dir={tmp_path / name}",
            *api,
            *extra,
        ),
    )


class Client:
    """Every response is kept: the test asserts on all of them."""

    def __init__(self, url: str) -> None:
        self.http = httpx.Client(base_url=url, timeout=30)
        self.statuses: list[tuple[str, int]] = []
        self.lock = threading.Lock()

    def call(
        self, method: str, path: str, body=None, headers=None, content: bytes | None = None, who: str = "operator"
    ) -> httpx.Response:
        kwargs = {"content": content} if content is not None else {"json": body} if body is not None else {}
        r = self.http.request(method, path, headers=headers if headers is not None else AUTH, **kwargs)
        with self.lock:
            self.statuses.append((f"{who} {method} {path}", r.status_code))
        return r

    def until_accepted(self, method: str, path: str, body=None, attempts: int = 60) -> httpx.Response:
        """Retry while the coordinator restarts (409: its outcome unknown), as a client is
        told to: with one idempotency key for every attempt, so it is applied at most once."""
        key = {**AUTH, "Idempotency-Key": uuid.uuid4().hex}
        for _ in range(attempts):
            r = self.call(method, path, body, headers=key)
            if r.status_code != 409:
                return r
            time.sleep(0.5)
        return r


def _reader(client: Client, stop: threading.Event) -> None:
    cursor = 0
    while not stop.is_set():
        try:
            client.call("GET", "/v1/run", headers=READ, who="reader")
            client.call("GET", "/v1/islands", headers=READ, who="reader")
            events = client.call("GET", f"/v1/events?since={cursor}", headers=READ, who="reader")
            if events.status_code == 200:
                cursor += len(events.json())
            client.call("GET", "/v1/run/history?since=0&limit=5", headers=READ, who="reader")
            client.call("GET", "/metrics", headers=READ, who="reader")
        except httpx.TransportError:
            pass  # the server is gone: the run ended
        time.sleep(0.05)


def _round(client: Client) -> int:
    try:
        r = client.call("GET", "/v1/run")
    except httpx.TransportError:
        return 0  # the run just ended and took its control plane with it
    return r.json().get("round", 0) if r.status_code == 200 else 0


def _kill_island(run_id: str, client: Client) -> int:
    """Kill the highest-numbered training island's actor."""
    victim = _last_training(client)
    ray.kill(ray.get_actor(island_name(run_id, victim), namespace=NAMESPACE), no_restart=True)
    return victim


def _last_training(client: Client) -> int:
    """The highest-numbered island training. Just after a coordinator restart no island
    shows as training until the new coordinator has re-attached them (seen once: an empty
    list, and the test failed): waited for, within a minute."""
    deadline = time.time() + 60
    while True:
        islands = client.call("GET", "/v1/islands").json()
        training = [i["id"] for i in islands if i["state"] == "training"] if isinstance(islands, list) else []
        if training or time.time() > deadline:
            break
        time.sleep(0.2)
    assert training, f"no island training a minute after asking: {islands}"
    return max(training)


def test_rest_chaos_with_killed_islands_and_coordinator(ray_local, tmp_path, monkeypatch):
    # the fault-free run of the same seed, in process (the same engine and islands, no sleeps)
    baseline = run_in_process(
        _cfg(tmp_path, "baseline", None, "task.kwargs.batch_s=0"), SimulationConfig(virtual_step_s=0.01)
    )
    rng = random.Random(7)
    port, run_id = free_port(), "chaos"
    cfg = _cfg(tmp_path, "chaos", port)
    box: dict = {}
    monkeypatch.setenv("ARCHIPELAGO_API_TOKEN", TOKEN)
    monkeypatch.setenv("ARCHIPELAGO_API_READ_TOKEN", READER)
    thread = threading.Thread(target=lambda: box.update(summary=run(cfg, show_progress=False, run_id=run_id)))
    thread.start()
    client = Client(f"http://127.0.0.1:{port}")
    deadline = time.time() + 120
    while time.time() < deadline and not (_up(client) and _round(client) >= 1):
        time.sleep(0.2)
    stop_reading = threading.Event()
    reader = threading.Thread(target=_reader, args=(client, stop_reading), daemon=True)
    reader.start()
    adds = drains = 0
    done: set[str] = set()
    unauthenticated: list[int] = []
    malformed: list[int] = []
    coordinator = ray.get_actor(coordinator_name(run_id), namespace=NAMESPACE)
    try:
        while thread.is_alive() and time.time() < deadline + 240:
            rnd = _round(client)
            if rnd >= 3 and "add" not in done:
                done.add("add")
                r = client.until_accepted("POST", "/v1/islands", {"count": 1})
                adds += r.status_code == 202
            if rnd >= 4 and "attack" not in done:
                done.add("attack")
                for method, path, body in MUTATIONS:
                    for variant in UNAUTHENTICATED:
                        content = json.dumps(body).encode() if body is not None else b""
                        r = client.call(method, path, headers=dict(variant), content=content, who="attacker")
                        unauthenticated.append(r.status_code)
                for body in rng.sample(MALFORMED, len(MALFORMED)):
                    method, path, _ = rng.choice([MUTATIONS[0], MUTATIONS[1], MUTATIONS[6]])
                    headers = {**AUTH, "content-type": "application/json"}
                    malformed.append(client.call(method, path, headers=headers, content=body).status_code)
            if rnd >= 5 and "kill island" not in done:
                done.add("kill island")
                _kill_island(run_id, client)
            if rnd >= 7 and "kill coordinator 1" not in done:
                done.add("kill coordinator 1")
                ray.kill(coordinator, no_restart=False)
            if rnd >= 11 and "pause" not in done:
                done.add("pause")
                assert client.until_accepted("POST", "/v1/run/pause").status_code == 202
                time.sleep(1.0)
                assert client.until_accepted("POST", "/v1/run/resume").status_code == 202
            if rnd >= 13 and "settings" not in done:
                done.add("settings")
                assert client.until_accepted("PATCH", "/v1/run/settings", {"outer_lr": 0.7}).status_code == 202
            if rnd >= 15 and "drain" not in done:
                done.add("drain")
                victim = _last_training(client)
                drains += client.until_accepted("DELETE", f"/v1/islands/{victim}").status_code == 202
            if rnd >= 17 and "kill coordinator 2" not in done:
                done.add("kill coordinator 2")
                ray.kill(coordinator, no_restart=False)
                # the last fault is made while the run is held: after the restart its remaining
                # rounds took a second or two, and once they ended before a poll saw round 20
                assert client.until_accepted("POST", "/v1/run/pause").status_code == 202
                done.add("kill island 2")
                _kill_island(run_id, client)
                assert client.until_accepted("POST", "/v1/run/resume").status_code == 202
            time.sleep(0.1)
    except BaseException:  # a step above failed: end the run it drives, never leave it holding Ray
        client.call("POST", "/v1/run/stop")
        thread.join(timeout=120)
        raise
    thread.join(timeout=240)
    stop_reading.set()
    reader.join(timeout=30)
    summary = box["summary"]
    out = Path(cfg.out_dir)
    print(
        f"chaos: {len(client.statuses)} requests, {sorted(done)}, adds {adds}, drains {drains}, "
        f"loss {summary['final_eval_loss']:.6f} vs fault-free {baseline['final_eval_loss']:.6f}"
    )
    assert len(done) == 9, done  # every planned fault and operation happened before the run ended
    assert not [s for s in client.statuses if s[1] >= 500], [s for s in client.statuses if s[1] >= 500][:10]
    # the shipped limit on: whatever the reader's polling met is its own bucket's, never the operator's
    limited = [s for s in client.statuses if s[1] == 429]
    assert all(who.startswith("reader ") for who, _ in limited), limited[:10]
    assert len(unauthenticated) == len(MUTATIONS) * len(UNAUTHENTICATED)
    assert set(unauthenticated) <= {401, 403}, sorted(set(unauthenticated))
    assert all(400 <= s < 500 for s in malformed), sorted(set(malformed))
    # the run: every round, in order, once; two restarts; the faults seen
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert summary["state"] == "finished" and [r["round"] for r in records] == list(range(1, ROUNDS + 1))
    kinds = [json.loads(line)["kind"] for line in (out / "events.jsonl").read_text().splitlines()]
    # (an island killed while the coordinator restarts is found gone and re-placed: no crash event)
    assert kinds.count("restart") == 2 and kinds.count("crash") >= 1 and "paused" in kinds and "settings" in kinds
    # exact token identities: every batch trained once (a batch of this task weighs 1)
    shards = summary["shards"]
    assert shards["position"] == shards["tokens"]
    assert sum(shards["tokens"]) == summary["tokens"] == sum(i["tokens"] for i in summary["islands"].values())
    # no accepted add (or drain) lost across two coordinator restarts
    intent = json.loads(one_run(cfg.checkpoint_dir).read("membership.json"))
    assert adds == 1 and drains == 1 and intent["target"] == 3 + adds - drains
    assert abs(summary["final_eval_loss"] - baseline["final_eval_loss"]) <= 0.02 * baseline["final_eval_loss"]


def _up(client: Client) -> bool:
    try:
        return client.http.get("/v1/run", headers=AUTH).status_code == 200
    except httpx.TransportError:
        return False
