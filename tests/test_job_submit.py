"""`ray job submit` against a real local cluster started with `ray start --head` (fake GPUs,
token auth on, as Ray 2.59+ defaults to): a run whose control plane answers and steers it
while it trains, stopped with `ray job stop` into a checkpoint that a second job resumes to
the end with progress in its logs; a SIGKILLed driver's islands release themselves. The
cluster is stopped whatever happens."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import torch

from archipelago.orchestrator.engine.state.checkpoints import load_checkpoint, one_run
from tests.conftest import REPO
from tests.helpers import TINY_LM
from tests.http_server import free_port, free_port_range
from tests.ray_processes import stop_ray

pytestmark = [pytest.mark.ray, pytest.mark.quiet]  # the machine's own Ray processes (tests/ray_apart.py)

RAY = str(Path(sys.executable).with_name("ray"))


@pytest.fixture(scope="module")
def cluster():
    """A head node with 4 CPUs and 2 fake GPUs; yields (env, dashboard address)."""
    import ray

    ray.shutdown()  # this module talks to its own cluster only through the job CLI
    if not shutil.which(RAY):
        pytest.skip(f"no `ray` command next to {sys.executable}")
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "RAY_AUTH_TOKEN": secrets.token_hex(16),
        "RAY_memory_monitor_refresh_ms": "0",
    }
    env.pop("RAY_ADDRESS", None)
    gcs, dash = free_port(), free_port()
    # a short path: Ray's socket paths under it must fit a Unix socket's 107 bytes (a pytest
    # folder does not once it is a worker's, `.../popen-gw0/ray0/session_<time>_<pid>/sockets/...`)
    temp = tempfile.mkdtemp(prefix="ray-")
    try:
        subprocess.run(
            [
                RAY,
                "start",
                "--head",
                "--num-cpus=4",
                "--num-gpus=2",
                f"--port={gcs}",
                "--include-dashboard=true",
                "--dashboard-host=127.0.0.1",
                f"--dashboard-port={dash}",
                "--disable-usage-stats",
                f"--temp-dir={temp}",
            ],
            env=env,
            check=True,
            capture_output=True,
            timeout=120,
        )
        env["ARCHIPELAGO_TEST_GCS"] = f"127.0.0.1:{gcs}"  # for tests that drive from this process
        yield env, f"http://127.0.0.1:{dash}"
    finally:
        stop_ray()
        shutil.rmtree(temp, ignore_errors=True)


NO_AGENT = "No available agent to submit job, please try again later"  # Ray's job server, agent still starting


def _job(env, address, *args, timeout=120) -> subprocess.CompletedProcess:
    """`ray job SUB ...`; a submission the job server answers with "try again later" (its
    agent on the node not up yet: on 2 loaded cores it came 30 s after `ray start`) is
    tried again, as Ray asks, for up to `timeout` in all."""
    sub, rest = args[0], list(args[1:])
    deadline = time.monotonic() + timeout
    while True:
        proc = subprocess.run(
            [RAY, "job", sub, f"--address={address}", *rest],
            check=False,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=REPO,
        )
        if proc.returncode == 0 or NO_AGENT not in proc.stderr or time.monotonic() > deadline:
            return proc
        time.sleep(2.0)


def _submit(
    env,
    address,
    job_id,
    out: Path,
    corpus_cache: str,
    *overrides: str,
    api_port: int = 0,
    api_token: str | None = None,
    runtime_env: bool = False,
) -> None:
    """Submit a tiny 2-island run (one fake GPU each). With `runtime_env` the code and its
    dependencies go through `k8s/runtime-env.yaml` and the entry point is the module (as on
    a stock Ray image); otherwise `--working-dir` plus the installed `archipelago` command."""
    sets = [
        *TINY_LM,
        f"task.kwargs.cache_dir={corpus_cache}",
        "islands.count=2",
        "islands.gpus=1",
        "islands.cpus=1",
        "data_shards=4",
        *(["api.enabled=true", f"api.port={api_port}"] if api_port else []),
        *overrides,
    ]
    ship = ["--runtime-env=k8s/runtime-env.yaml"] if runtime_env else [f"--working-dir={REPO}"]
    entry = ["python", "-m", "archipelago.orchestrator.cli"] if runtime_env else ["archipelago"]
    if api_token:  # the driver's environment: what a Secret mounted into the head pod gives
        entry = ["env", f"ARCHIPELAGO_API_TOKEN={api_token}", *entry]
    cmd = [
        "submit",
        f"--submission-id={job_id}",
        *ship,
        "--no-wait",
        "--",
        *entry,
        "run",
        "--out",
        str(out),
        *[a for s in sets for a in ("--set", s)],
    ]
    proc = _job(env, address, *cmd)
    assert proc.returncode == 0, proc.stderr


def _status(env, address, job_id) -> str:
    """The job's state from the Jobs REST API that `ray job status` reads (a CLI process
    per poll would import Ray each time: about a second of CPU, on the cluster's cores)."""
    reply = httpx.get(f"{address}/api/jobs/{job_id}", headers={"Authorization": f"Bearer {env['RAY_AUTH_TOKEN']}"})
    return str(reply.json()["status"]) if reply.status_code == 200 else "UNKNOWN"


def _wait_status(env, address, job_id, states, timeout=240) -> str:
    deadline = time.time() + timeout
    while time.time() < deadline:
        state = _status(env, address, job_id)
        if state in states:
            return state
        time.sleep(0.25)
    raise AssertionError(
        f"job {job_id} not in {states} after {timeout}s; logs:\n" + _job(env, address, "logs", job_id).stdout[-3000:]
    )


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def test_a_submitted_run_is_steered_live_and_a_stopped_job_is_resumed_by_a_new_one(cluster, tmp_path, corpus_cache):
    """One job through `k8s/runtime-env.yaml` with its control plane on: the test pauses it
    as soon as the API is up (so the run cannot slip past a poll), reads the paused run's
    status and islands, resumes it; `ray job stop` then ends it cleanly with a checkpoint,
    and a second job resumes that checkpoint to the end with progress in its logs."""
    env, address = cluster
    out, port, token = tmp_path / "out", free_port(), secrets.token_hex(16)
    sets = ["rounds=200", "inner_steps=10", "checkpoint.every_rounds=1"]
    _submit(
        env, address, "archipelago-live", out, corpus_cache, *sets, api_port=port, api_token=token, runtime_env=True
    )
    api = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"Authorization": f"Bearer {token}"}, timeout=5)

    def wait_for(predicate, what: str, timeout: float = 240) -> dict:
        deadline, next_job_check = time.time() + timeout, time.time() + 2
        while time.time() < deadline:
            try:
                status = api.get("/v1/run").json()
                if predicate(status):
                    return status
            except (httpx.HTTPError, ValueError):
                pass  # not serving yet
            if time.time() >= next_job_check:  # a job that failed would never serve: say why
                state = _status(env, address, "archipelago-live")
                assert state in ("PENDING", "RUNNING"), (what, state, _logs(env, address, "archipelago-live"))
                next_job_check = time.time() + 2
            time.sleep(0.2)
        raise AssertionError(f"no {what} within {timeout} s")

    wait_for(lambda s: "state" in s, "control plane")
    assert api.post("/v1/run/pause").status_code == 202
    paused = wait_for(lambda s: s["state"] == "paused", "paused run")
    assert paused["rounds"] == 200 and paused["islands_alive"] == 2, paused
    assert len(api.get("/v1/islands").json()) == 2
    assert api.post("/v1/run/resume").status_code == 202
    wait_for(lambda s: s["round"] >= 2, "two rounds after the resume")

    t_stop = time.time()
    stop = _job(env, address, "stop", "archipelago-live")  # waits for the job to end
    stop_s = time.time() - t_stop
    assert stop.returncode == 0, stop.stderr
    assert _wait_status(env, address, "archipelago-live", {"STOPPED", "SUCCEEDED", "FAILED"}) == "STOPPED"
    logs = _logs(env, address, "archipelago-live")
    assert "SIGTERM: stopping now" in logs and "control plane: http://" in logs, logs[-3000:]
    summary = json.loads((out / "summary.json").read_text())  # written by the clean stop, not at the end
    assert summary["state"] == "stopped" and 2 <= summary["rounds_done"] < 200
    state = load_checkpoint(one_run(out / "checkpoint"))
    assert state["version"] == summary["outer_steps"] == summary["rounds_done"]
    assert torch.isfinite(state["params"]).all()
    print(f"ray job stop → job stopped in {stop_s:.1f}s at round {summary['rounds_done']}")

    # what writers killed mid-write leave (an island streaming its inner state, the checkpoint's
    # own): the new job's coordinator is their folders' only writer, and sweeps them before it starts
    run_dir = Path(str(one_run(out / "checkpoint")))
    debris = [
        run_dir / "islands" / ".island-00000-0123456789ab.npz.4242.deadbeef.tmp",
        run_dir / ".state.pt.4242.cafe0123.tmp",
    ]
    for orphan in debris:
        orphan.parent.mkdir(exist_ok=True)
        orphan.write_bytes(b"\0" * 4096)

    # usable: a new job resumes it and carries on from the next version to the end
    done = summary["rounds_done"]
    resume = ["submit", "--submission-id=archipelago-resume", f"--working-dir={REPO}", "--no-wait", "--",
              "archipelago", "run", "--resume", str(out), "--set", f"rounds={done + 2}"]  # fmt: skip
    assert _job(env, address, *resume).returncode == 0
    final = _wait_status(env, address, "archipelago-resume", {"SUCCEEDED", "FAILED", "STOPPED"})
    logs = _logs(env, address, "archipelago-resume")
    assert final == "SUCCEEDED", logs[-3000:]
    assert f"round {done + 2}/{done + 2}" in logs and "eval loss" in logs
    versions = [r["version"] for r in _records(out / "metrics.jsonl")]
    assert versions[-2:] == [done + 1, done + 2]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["state"] == "finished" and summary["outer_steps"] == done + 2
    assert summary["final_eval_loss"] < summary["initial_eval_loss"]
    assert (out / "final.pt").exists() and load_checkpoint(one_run(out / "checkpoint"))["version"] == done + 2
    assert not list((out / "checkpoint").rglob("*.tmp")), "debris of a write left under the checkpoint folder"
    # the new job's islands are new actors, yet each continued from its predecessor's inner state
    joins = [e for e in _records(out / "events.jsonl") if e["kind"] == "join" and "inner_state" in e]
    assert sorted(e["island"] for e in joins) == [0, 1] and {e["inner_state"] for e in joins} == {"restored"}


def _logs(env, address, job_id) -> str:
    proc = _job(env, address, "logs", job_id)
    return proc.stdout + proc.stderr


def test_a_sigkilled_driver_leaves_no_island_holding_resources(cluster, tmp_path, corpus_cache):
    """Before: islands are detached (they must outlive a coordinator Ray restarts), so a
    driver killed with SIGKILL — no cleanup runs — left them holding their nodes for good.
    Now each island watches its coordinator and releases itself once it is gone."""
    import signal

    env, _ = cluster
    gcs, out = env["ARCHIPELAGO_TEST_GCS"], tmp_path / "orphaned"
    sets = [*TINY_LM, f"task.kwargs.cache_dir={corpus_cache}", "islands.count=2", "islands.cpus=1", "rounds=1000",
            "inner_steps=20", f"ray.address={gcs}", "elastic.orphan_timeout_s=3", f"out_dir={out}"]  # fmt: skip
    driver = subprocess.Popen(
        [sys.executable, "-m", "archipelago.orchestrator.cli", "-q", "run", *[a for s in sets for a in ("--set", s)]],
        env=env,
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 180
        while time.time() < deadline and len(_lines(out / "metrics.jsonl")) < 2:
            assert driver.poll() is None, "the driver ended early"
            time.sleep(0.5)
        assert len(_lines(out / "metrics.jsonl")) >= 2
    finally:
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout=30)
    # from another process (this one's Ray reads its auth settings once, at import), which
    # polls until the run's islands are gone
    left = _leftovers(env, gcs)
    print(f"islands released {left['seconds']:.1f}s after the driver was killed (orphan timeout 3s)")
    assert left["at_kill"], "the islands should still be there right after the kill"
    assert not left["islands"] and left["cpus_free"] == left["cpus"], left


_LEFTOVERS = """
import json, time, ray
from ray.util.placement_group import placement_group_table
ray.init(address="{gcs}", log_to_driver=False)
def islands():
    actors = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if "-island-" in a["name"]]
    groups = [g["name"] for g in placement_group_table().values() if g["state"] != "REMOVED" and "-island-" in g["name"]]
    return actors + groups
def busy():  # resources come back a moment after the groups are gone
    return islands() or ray.available_resources().get("CPU") != ray.cluster_resources().get("CPU")
t0, at_kill = time.time(), islands()
while busy() and time.time() - t0 < 60:
    time.sleep(0.25)
print(json.dumps({{"at_kill": at_kill, "islands": islands(), "seconds": time.time() - t0,
                   "cpus": ray.cluster_resources().get("CPU"), "cpus_free": ray.available_resources().get("CPU")}}))
"""


def _leftovers(env, gcs) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _LEFTOVERS.format(gcs=gcs)], check=False, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_five_runs_submitted_to_one_cluster_at_once_all_finish_each_with_its_own_control_plane(
    cluster, tmp_path, corpus_cache
):
    """Five jobs submitted together to one Ray cluster, with the same config whose range of
    control-plane ports (`api.ports`) holds two: the first two serve on the range (the
    head's Service forwards it on KubeRay), the other three on ports the system picks, each
    written to its run's folder (before, the third failed at start). Each is paused through
    its own control plane until all are held at once (so all served together), checked to
    answer for its own run, resumed, and every job finishes with its own outputs."""
    env, address = cluster
    count = 5
    base = free_port_range(count)  # the runs' control planes take one each
    runs = {f"archipelago-{k}": (tmp_path / f"run-{k}", secrets.token_hex(16)) for k in range(count)}
    # one island each, on a share of a CPU: five runs on the fixture's 4 CPUs and 2 GPUs at once
    sets = ["islands.count=1", "islands.gpus=0", "islands.cpus=0.5", "rounds=3", "inner_steps=10", "api.ports=2"]
    for name, (out, token) in runs.items():
        _submit(env, address, name, out, corpus_cache, *sets, api_port=base, api_token=token)
    clients: dict[str, httpx.Client] = {}
    deadline = time.time() + 300
    while len(clients) < len(runs) and time.time() < deadline:
        for name, (out, token) in runs.items():
            url_file = out / "control-plane.url"
            if name in clients or not url_file.exists():
                continue
            client = httpx.Client(
                base_url=url_file.read_text().strip(), headers={"Authorization": f"Bearer {token}"}, timeout=5
            )
            try:
                if client.post("/v1/run/pause").status_code == 202:
                    clients[name] = client
            except httpx.HTTPError:
                pass  # listening, not yet serving
        for name in runs:
            assert _status(env, address, name) in ("PENDING", "RUNNING"), _logs(env, address, name)[-3000:]
        time.sleep(0.2)
    assert set(clients) == set(runs), ({n: (o / "control-plane.url").exists() for n, (o, _) in runs.items()},)
    ports = {name: int(str(client.base_url).rstrip("/").rsplit(":", 1)[1]) for name, client in clients.items()}
    assert len(set(ports.values())) == count and {base, base + 1} <= set(ports.values()), ports
    run_ids = set()
    for client in clients.values():
        status = client.get("/v1/run").json()
        while not status.get("paused"):
            time.sleep(0.2)
            status = client.get("/v1/run").json()
        run_ids.add(status["run_id"])
    assert len(run_ids) == count  # each control plane answers for its own run
    for client in clients.values():
        assert client.post("/v1/run/resume").status_code == 202
    for name, (out, _) in runs.items():
        assert _wait_status(env, address, name, {"SUCCEEDED", "FAILED", "STOPPED"}) == "SUCCEEDED", _logs(
            env, address, name
        )[-3000:]
        summary = json.loads((out / "summary.json").read_text())
        assert summary["state"] == "finished" and summary["outer_steps"] == 3
