"""'Add GPU nodes' end to end on Ray's fake autoscaling cluster: a REST call raises the
target, the autoscaler brings up a fake GPU node, an island starts there and contributes;
lowering the target drains it and the idle node is scaled down."""

from __future__ import annotations

import copy
import threading
import time

import httpx
import pytest
import ray
from ray.cluster_utils import AutoscalingCluster

from archipelago.orchestrator.config_load import load_config
from archipelago.orchestrator.runtime.driver import run
from tests.conftest import importable_checkout
from tests.http_server import free_port
from tests.ray_processes import stop_ray

pytestmark = [pytest.mark.ray, pytest.mark.quiet]  # the machine's own Ray processes (tests/ray_apart.py)
GPU_NODE = {
    "resources": {"CPU": 1, "GPU": 1, "object_store_memory": 200 * 1024**2},
    "node_config": {},
    "min_workers": 0,
    "max_workers": 3,
}


class FakeAutoscalingCluster(AutoscalingCluster):
    """The 2.60 wheel does not ship the base YAML `_generate_config` reads; build it here."""

    def _generate_config(self, head_resources, worker_node_types, autoscaler_v2=False, **config_kwargs):
        config = {
            "cluster_name": "archipelago-test",
            "max_workers": 4,
            "head_node_type": "ray.head.default",
            "provider": {
                "type": "fake_multinode",
                "use_node_id_as_ip": True,
                "disable_node_updaters": True,
                "disable_launch_config_check": True,
            },
            "available_node_types": {
                **copy.deepcopy(worker_node_types),
                "ray.head.default": {"resources": dict(head_resources), "node_config": {}, "max_workers": 0},
            },
            "auth": {},
            "upscaling_speed": 1.0,
            "idle_timeout_minutes": 0.05,
            "docker": {},
            "initialization_commands": [],
            "setup_commands": [],
            "head_setup_commands": [],
            "worker_setup_commands": [],
            "head_start_ray_commands": [],
            "worker_start_ray_commands": [],
            "file_mounts": {},
            "cluster_synced_files": [],
            "file_mounts_sync_continuously": False,
            "rsync_exclude": [],
            "rsync_filter": [],
        }
        config.update(config_kwargs)
        return config


@pytest.fixture(scope="module")
def autoscaling():
    ray.shutdown()
    with importable_checkout():  # in the environment of every node the autoscaler starts
        cluster = FakeAutoscalingCluster(head_resources={"CPU": 2}, worker_node_types={"gpu": GPU_NODE})
        cluster.start()
        ray.init("auto", log_to_driver=False)
        yield cluster
    ray.shutdown()
    stop_ray()  # as `cluster.shutdown()` (`ray stop --force`) does, in a fraction of its 12 s


def _gpu_nodes() -> int:
    return sum(1 for n in ray.nodes() if n["Alive"] and n["Resources"].get("GPU", 0) > 0)


def test_add_gpu_islands_over_rest_and_scale_back_down(autoscaling, tmp_path, monkeypatch):
    monkeypatch.setenv("ARCHIPELAGO_API_TOKEN", "autoscaling-test-token-0123")
    port = free_port()
    cfg = load_config(
        None,
        [
            "task.factory=tests.toy_tasks:make_quadratic",
            "warm_start.steps=0",
            "task.kwargs.centers=[[1.0,0.0],[-0.5,2.0]]",
            "task.kwargs.batch_s=0.05",
            "islands.count=1",
            "islands.cpus=1",
            "islands.gpus=1",
            "data_shards=4",
            "inner.optimizer=sgd",
            "inner.lr=0.1",
            "inner.warmup_steps=0",
            "inner_steps=4",
            "rounds=100000",
            "api.enabled=true",
            f"api.port={port}",
            f"out_dir={tmp_path / 'out'}",
        ],
    )
    box = {}
    thread = threading.Thread(target=lambda: box.update(summary=run(cfg, show_progress=False, run_id="autoscale")))
    thread.start()
    client = httpx.Client(
        base_url=f"http://127.0.0.1:{port}", timeout=10, headers={"Authorization": "Bearer autoscaling-test-token-0123"}
    )
    deadline = time.time() + 150

    def wait(predicate, what):
        while time.time() < deadline:
            try:
                if predicate():
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise AssertionError(f"timed out waiting for {what}")

    # a 409 "retry" until the coordinator first answers (the control plane serves from the start)
    wait(lambda: client.get("/v1/run").json().get("round", 0) >= 2, "the first island on an autoscaled GPU node")
    assert _gpu_nodes() == 1
    t_add = time.time()
    assert client.put("/v1/islands/target", json={"target": 2}).status_code == 202
    wait(lambda: _gpu_nodes() == 2, "a second fake GPU node")
    t_node = time.time()
    wait(lambda: client.get("/v1/islands").json()[1]["rounds_contributed"] > 0, "the new island's contribution")
    newcomer = client.get("/v1/islands").json()[1]
    t_contrib = newcomer["last_contribution"]
    assert newcomer["resources"] == {"CPU": 1.0, "GPU": 1.0}
    t_lower = time.time()
    assert client.put("/v1/islands/target", json={"target": 1}).status_code == 202
    wait(lambda: _gpu_nodes() == 1, "the idle GPU node to be scaled down")
    t_down = time.time()
    assert client.post("/v1/run/stop").status_code == 202
    thread.join(timeout=60)
    print(
        f"autoscaling: add -> node up {t_node - t_add:.1f}s, add -> first contribution "
        f"{t_contrib - t_add:.1f}s, target lowered -> node removed {t_down - t_lower:.1f}s"
    )
    assert box["summary"]["islands"]["1"]["state"] == "drained"
