"""KubeRay manifests validated offline against the v1.7.0 CRD schemas (unknown fields
rejected), and checked against the code: entry point, ports, secret and env names."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from api.auth import ExposureError, check_exposure
from orchestrator.config import ApiConfig
from orchestrator.config_load import load_config
from tests.conftest import REPO

jsonschema = pytest.importorskip("jsonschema")
CRDS = REPO.parent / "shared" / "kuberay"
K8S = REPO / "k8s"
needs_crds = pytest.mark.skipif(not CRDS.is_dir(), reason=f"KubeRay CRD schemas not found at {CRDS}")


def strict(schema):
    """Reject unknown fields wherever the schema lists properties and does not preserve unknown fields."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (
                "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def crd_schema(name: str):
    crd = yaml.safe_load((CRDS / name).read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return strict(version["schema"]["openAPIV3Schema"])


def manifest(name: str):
    return yaml.safe_load((K8S / name).read_text())


@needs_crds
@pytest.mark.parametrize(
    "file, crd", [("raycluster.yaml", "ray.io_rayclusters.yaml"), ("rayjob.yaml", "ray.io_rayjobs.yaml")]
)
def test_manifests_validate_against_the_crds(file, crd):
    jsonschema.validate(manifest(file), crd_schema(crd))


@needs_crds
def test_unknown_fields_are_caught():
    bad = manifest("raycluster.yaml")
    bad["spec"]["workerGroupSpecs"][0]["maxReplica"] = 3  # typo of maxReplicas
    with pytest.raises(jsonschema.ValidationError, match="maxReplica"):
        jsonschema.validate(bad, crd_schema("ray.io_rayclusters.yaml"))


def _head(cluster_spec):
    return cluster_spec["headGroupSpec"]["template"]["spec"]["containers"][0]


def _head_volumes(spec: dict) -> list[dict]:
    return spec["headGroupSpec"]["template"]["spec"]["volumes"]


def test_manifests_match_the_code():
    cluster, job = manifest("raycluster.yaml")["spec"], manifest("rayjob.yaml")["spec"]
    secret = manifest("secret.yaml")
    run_cfg = load_config(K8S / "run-config.yaml")
    for spec in (cluster, job["rayClusterSpec"]):
        head = _head(spec)
        ports = {p["name"]: p["containerPort"] for p in head["ports"]}
        assert ports["archipelago-api"] == run_cfg.api.port == ApiConfig().port
        assert ports["metrics"] == 8080  # Ray's metrics agent, where ray_archipelago_* are exported
        env = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef", e.get("value")) for e in head["env"]}
        token_file = Path(env["ARCHIPELAGO_API_TOKEN_FILE"])  # the Secret as a file, not an env value
        assert "ARCHIPELAGO_API_TOKEN" not in env
        mounts = {m["name"]: m["mountPath"] for m in head["volumeMounts"]}
        secrets = {v["name"]: v["secret"]["secretName"] for v in _head_volumes(spec) if "secret" in v}
        assert secrets == {"archipelago-api-token": secret["metadata"]["name"]}
        assert mounts["archipelago-api-token"] == str(token_file.parent) and token_file.name == "token"
        assert int(env["RAY_JOB_STOP_WAIT_TIME_S"]) >= 30  # the final checkpoint of a stopped job
        claims = {v["persistentVolumeClaim"]["claimName"] for v in _head_volumes(spec) if "persistentVolumeClaim" in v}
        assert claims == {manifest("storage.yaml")["metadata"]["name"]}
        assert "token" in secret["stringData"]
        worker = spec["workerGroupSpecs"][0]
        limits = worker["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert float(limits["nvidia.com/gpu"]) == run_cfg.islands.gpus * run_cfg.islands.workers  # one island per node
        assert worker["minReplicas"] <= worker["maxReplicas"]
        assert spec["enableInTreeAutoscaling"] and spec["autoscalerOptions"]["idleTimeoutSeconds"] > 0
    assert run_cfg.api.host == "0.0.0.0" and run_cfg.checkpoint.path.startswith("/mnt/archipelago")
    with pytest.raises(ExposureError, match="placeholder"):  # the shipped placeholder is refused, not served
        check_exposure(run_cfg.api.host, secret["stringData"]["token"])
    # a round of the shipped H may take several seconds per inner step before an island is late
    assert run_cfg.deadline_s(run_cfg.inner_steps) >= 5 * run_cfg.inner_steps
    entry = job["entrypoint"].split()
    assert entry[:2] == ["archipelago", "run"] and entry[entry.index("--config") + 1] == "/app/k8s/run-config.yaml"
    dockerfile = (K8S / "Dockerfile").read_text()
    assert "WORKDIR /app" in dockerfile and "rayproject/ray:2.60.0" in dockerfile


def test_kustomization_lists_files_that_exist():
    kust = manifest("kustomization.yaml")
    for res in kust["resources"]:
        assert (K8S / res).exists(), res
    for gen in kust["configMapGenerator"]:
        for f in gen["files"]:
            assert (K8S / f).exists(), f


def test_runtime_env_ships_the_package_dependencies():
    """`k8s/runtime-env.yaml` (code + deps at submit time) lists exactly pyproject's
    dependencies, Ray itself aside (the image provides it)."""
    import tomllib

    deps = tomllib.loads((K8S.parent / "pyproject.toml").read_text())["project"]["dependencies"]
    env = manifest("runtime-env.yaml")
    assert env["working_dir"] == "."
    assert env["pip"]["packages"] == [d for d in deps if not d.startswith("ray")]
