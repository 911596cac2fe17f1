"""KubeRay manifests validated offline against the v1.7.0 CRD schemas (unknown fields
rejected), and checked against the code: entry point, ports, secret and env names."""

from __future__ import annotations

import copy
import functools
import gzip
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from archipelago.api.auth import ExposureError, check_exposure
from archipelago.orchestrator.config import ApiConfig
from archipelago.orchestrator.config_load import EXTRAS, load_config
from archipelago.orchestrator.plan.cluster import LINK_ENV, LINK_GBPS, SLICE_NODES, SLICES_ENV
from archipelago.orchestrator.runtime.driver import RAY_SYSTEM_CONFIG
from tests.conftest import REPO

CRDS = REPO / "tests" / "kuberay"  # KubeRay v1.7.0's CRDs, as released (gzipped; its LICENSE beside them)
K8S = REPO / "k8s"
CHECKPOINTS = "/mnt/archipelago/checkpoints"  # the shipped configs' checkpoint.path, on the shared volume
LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the CRDs are 2.3 MB of YAML


def dicts(node):
    """Every mapping in a YAML tree, parents before children (each one's children listed
    before it is handed out, so the caller may add keys to it)."""
    if isinstance(node, dict):
        children = list(node.values())
        yield node
    elif isinstance(node, list):
        children = node
    else:
        return
    for child in children:
        yield from dicts(child)


def strict(schema):
    """Reject unknown fields wherever the schema lists properties and does not preserve unknown fields."""
    schema = copy.deepcopy(schema)
    for node in dicts(schema):
        preserved = node.get("x-kubernetes-preserve-unknown-fields")
        if "properties" in node and "additionalProperties" not in node and not preserved:
            node["additionalProperties"] = False
    return schema


@functools.cache
def crd_schema(name: str):
    crd = yaml.load(gzip.decompress((CRDS / f"{name}.gz").read_bytes()), Loader=LOADER)
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return strict(version["schema"]["openAPIV3Schema"])


def manifest(name: str):
    return yaml.safe_load((K8S / name).read_text())


CRD_OF = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml"}


@pytest.mark.parametrize(
    "file, crd", [("raycluster.yaml", "ray.io_rayclusters.yaml"), ("job/rayjob.yaml", "ray.io_rayjobs.yaml")]
)
def test_manifests_validate_against_the_crds(file, crd):
    jsonschema.validate(manifest(file), crd_schema(crd))


def test_unknown_fields_are_caught():
    bad = manifest("raycluster.yaml")
    bad["spec"]["workerGroupSpecs"][0]["maxReplica"] = 3  # typo of maxReplicas
    with pytest.raises(jsonschema.ValidationError, match="maxReplica"):
        jsonschema.validate(bad, crd_schema("ray.io_rayclusters.yaml"))


def _head(cluster_spec):
    return cluster_spec["headGroupSpec"]["template"]["spec"]["containers"][0]


def _head_volumes(spec: dict) -> list[dict]:
    return spec["headGroupSpec"]["template"]["spec"]["volumes"]


SECRET = "archipelago-api-token"  # created with `kubectl create secret` (docs/deploy.md), never a tracked file
READ_SECRET = "archipelago-api-read-token"  # the read-only token (dashboards, watchers), likewise
HF_SECRET = "archipelago-hf-token"  # the Hub token, optional: likewise created by hand
RUN_CONFIG_DIR = "/etc/archipelago/run"  # where the RayJob's head mounts the run's config (k8s/config)


def test_manifests_match_the_code():
    cluster, job = manifest("raycluster.yaml")["spec"], manifest("job/rayjob.yaml")["spec"]
    run_cfg = load_config(K8S / "config" / "run-config.yaml")
    for spec in (cluster, job["rayClusterSpec"]):
        head = _head(spec)
        ports = {p["name"]: p["containerPort"] for p in head["ports"]}
        assert ports["archipelago-api"] == run_cfg.api.port == ApiConfig().port
        # every port a run on this cluster may serve on is the head's, so its Service forwards it
        assert run_cfg.api.ports > 1 and set(range(run_cfg.api.port, run_cfg.api.port + run_cfg.api.ports)) <= set(
            ports.values()
        )
        assert ports["metrics"] == 8080  # Ray's metrics agent, where ray_archipelago_* are exported
        env = {e["name"]: e.get("valueFrom", {}).get("secretKeyRef", e.get("value")) for e in head["env"]}
        token_file = Path(env["ARCHIPELAGO_API_TOKEN_FILE"])  # the Secret as a file, not an env value
        assert "ARCHIPELAGO_API_TOKEN" not in env
        mounts = {m["name"]: m["mountPath"] for m in head["volumeMounts"]}
        secrets = {v["name"]: v["secret"]["secretName"] for v in _head_volumes(spec) if "secret" in v}
        assert secrets == {SECRET: SECRET, READ_SECRET: READ_SECRET, "hf-token": HF_SECRET}
        assert mounts["archipelago-api-token"] == str(token_file.parent) and token_file.name == "token"
        # the read-only token: a Secret of its own, as a file the control plane follows (api/auth.py)
        read_file = Path(env["ARCHIPELAGO_API_READ_TOKEN_FILE"])
        assert mounts[READ_SECRET] == str(read_file.parent) and read_file.name == "token"
        # optional: a head whose read Secret was never made starts (readers then need the operator's)
        assert {v["name"]: v["secret"].get("optional") for v in _head_volumes(spec) if "secret" in v}[READ_SECRET]
        assert "ARCHIPELAGO_API_READ_TOKEN" not in env and read_file.parent != token_file.parent
        assert int(env["RAY_JOB_STOP_WAIT_TIME_S"]) >= 30  # the final checkpoint of a stopped job
        # the head's stated link, which `plan --cluster` reads, reaches the run's own plan (and
        # its choice of `compression: auto`) by the downward API, from the one annotation
        (link,) = [e for e in head["env"] if e["name"] == LINK_ENV]
        annotations = spec["headGroupSpec"]["template"]["metadata"]["annotations"]
        assert link["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.annotations['{LINK_GBPS}']"
        assert float(annotations[LINK_GBPS]) > 0
        # and the slice nodes it states, which `coordinator.shards: auto` counts while the slices
        # group is scaled to zero: the group's maxReplicas (`plan --cluster` refuses them unequal)
        (stated,) = [e for e in head["env"] if e["name"] == SLICES_ENV]
        assert stated["valueFrom"]["fieldRef"]["fieldPath"] == f"metadata.annotations['{SLICE_NODES}']"
        (slices,) = [g for g in spec["workerGroupSpecs"] if g["groupName"] == "slices"]
        assert int(annotations[SLICE_NODES]) == slices["maxReplicas"] > 1
        # every node's Ray frees objects as often as the Ray a run starts on one machine does
        ray_pods = [head, *(g["template"]["spec"]["containers"][0] for g in spec["workerGroupSpecs"])]
        for container in ray_pods:
            period = {e["name"]: e.get("value") for e in container["env"]}["RAY_free_objects_period_milliseconds"]
            assert int(period) == RAY_SYSTEM_CONFIG["free_objects_period_milliseconds"]
        claims = {v["persistentVolumeClaim"]["claimName"] for v in _head_volumes(spec) if "persistentVolumeClaim" in v}
        assert claims == {manifest("shared/storage.yaml")["metadata"]["name"]}
        worker = spec["workerGroupSpecs"][0]
        limits = worker["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert float(limits["nvidia.com/gpu"]) == run_cfg.islands.gpus * run_cfg.islands.workers  # one island per node
        assert worker["minReplicas"] <= worker["maxReplicas"]
        assert spec["enableInTreeAutoscaling"] and spec["autoscalerOptions"]["idleTimeoutSeconds"] > 0
    assert run_cfg.api.host == "0.0.0.0" and run_cfg.checkpoint.path.startswith("/mnt/archipelago")
    with pytest.raises(ExposureError, match=f"create secret generic {SECRET} "):  # the name the manifests mount
        check_exposure(run_cfg.api.host, "change-me")
    # a round of the shipped H may take several seconds per inner step before an island is late
    assert run_cfg.deadline_s(run_cfg.inner_steps) >= 5 * run_cfg.inner_steps
    entry = job["entrypoint"].split()
    assert (
        entry[:2] == ["archipelago", "run"]
        and entry[entry.index("--config") + 1] == f"{RUN_CONFIG_DIR}/run-config.yaml"
    )
    dockerfile = (K8S / "Dockerfile").read_text()
    assert "WORKDIR /app" in dockerfile and "rayproject/ray:2.60.0" in dockerfile


def test_the_image_installs_every_extra_a_config_can_name():
    """Before: `[hf,fast]` only, so an s3:// or gs:// checkpoint or a tracker could not even
    import in the image. Every extra `check_extras` can ask for is installed, and `fast`."""
    (install,) = [line for line in (K8S / "Dockerfile").read_text().splitlines() if line.startswith("RUN pip install")]
    extras = set(re.search(r'"/app\[([^\]]+)\]"', install).group(1).split(","))
    assert extras == {*EXTRAS, "tracking", "fast"}, extras


SLICES = "slices"  # the coordinator slices' worker group


def _island_groups(spec: dict) -> list[dict]:
    """The worker groups islands run on (GPU nodes), not the coordinator slices' nodes."""
    return [g for g in spec["workerGroupSpecs"] if g["groupName"] != SLICES]


def _slice_group(spec: dict) -> dict:
    return next(g for g in spec["workerGroupSpecs"] if g["groupName"] == SLICES)


def _ray_pods(spec: dict, islands_only: bool = False) -> list[tuple[dict, dict]]:
    """(container, pod spec) of the head and each worker group (or each islands' one)."""
    groups = [spec["headGroupSpec"], *(_island_groups(spec) if islands_only else spec["workerGroupSpecs"])]
    return [(g["template"]["spec"]["containers"][0], g["template"]["spec"]) for g in groups]


@pytest.mark.parametrize("file", ["raycluster.yaml", "job/rayjob.yaml"])
def test_every_ray_pod_has_a_writable_hugging_face_cache_and_the_optional_hub_token(file):
    """The Llama example streams C4 and loads GPT-2's tokenizer on every node: each pod
    gets a writable cache of its own (the shared volume is read-only on islands) and the
    Hub token as a file from an optional Secret (public models need none; gated ones read
    it), at paths huggingface_hub itself reads from these variables."""
    spec = manifest(file)["spec"]
    spec = spec.get("rayClusterSpec", spec)
    for container, pod in _ray_pods(spec, islands_only=True):  # a slice reads no data
        env = {e["name"]: e.get("value") for e in container["env"]}
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        cache = mounts[env["HF_HOME"]]
        assert not cache.get("readOnly") and "emptyDir" in volumes[cache["name"]]
        token = Path(env["HF_TOKEN_PATH"])
        secret = volumes[mounts[str(token.parent)]["name"]]["secret"]
        assert secret["secretName"] == HF_SECRET and secret["optional"] is True and token.name == "token"
        assert "HF_TOKEN" not in env  # a file, not a value every Ray worker process inherits
    probe = "from huggingface_hub import constants as c; print(c.HF_HOME, c.HF_TOKEN_PATH, c.HF_HUB_CACHE)"
    env = {**os.environ, "HF_HOME": "/var/cache/huggingface", "HF_TOKEN_PATH": "/etc/archipelago/hf/token"}
    env.pop("HF_HUB_CACHE", None)
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True).stdout
    assert out.split() == ["/var/cache/huggingface", "/etc/archipelago/hf/token", "/var/cache/huggingface/hub"]


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
    fast = tomllib.loads((K8S.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]["fast"]
    assert env["pip"]["packages"] == [d for d in deps if not d.startswith("ray")] + fast  # the coordinator's kernel


def test_the_runtime_env_ships_the_package_under_its_import_name():
    """A stock Ray image has no Archipelago installed: the uploaded working directory's
    k8s/pythonpath, on PYTHONPATH relative to it, is the package under its one import root
    (links to the three folders), found ahead of anything else, from the job's driver and
    every worker alike (each runs in the working directory)."""
    env = manifest("runtime-env.yaml")
    view = REPO / env["env_vars"]["PYTHONPATH"]
    for folder in ("orchestrator", "workers", "api"):
        link = view / "archipelago" / folder
        assert link.is_symlink() and link.resolve() == REPO / folder, link
    found = subprocess.run(
        [
            sys.executable,
            "-c",
            "import archipelago.orchestrator.cli as m, archipelago.api.app as a; print(m.__file__, a.__file__)",
        ],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": env["env_vars"]["PYTHONPATH"]},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert found == [
        str(view / "archipelago" / "orchestrator" / "cli.py"),
        str(view / "archipelago" / "api" / "app.py"),
    ]


def _pods() -> dict[str, dict]:
    """Every pod template the manifests ship, by where it is."""
    cluster, job = manifest("raycluster.yaml")["spec"], manifest("job/rayjob.yaml")["spec"]
    pods = {}
    for name, spec in (("raycluster", cluster), ("rayjob", job["rayClusterSpec"])):
        pods[f"{name} head"] = spec["headGroupSpec"]["template"]
        for group in spec["workerGroupSpecs"]:
            pods[f"{name} {group['groupName']}"] = group["template"]
    pods["rayjob submitter"] = job["submitterPodTemplate"]
    return pods


def _without_run_config(spec: dict) -> dict:
    """A cluster spec less the RayJob head's run-config volume and its mount."""
    spec = copy.deepcopy(spec)
    pod = spec["headGroupSpec"]["template"]["spec"]
    pod["volumes"] = [v for v in pod["volumes"] if v["name"] != "run-config"]
    head = pod["containers"][0]
    head["volumeMounts"] = [m for m in head["volumeMounts"] if m["name"] != "run-config"]
    return spec


def test_the_rayjob_runs_the_same_cluster_as_the_raycluster():
    job = manifest("job/rayjob.yaml")["spec"]["rayClusterSpec"]
    assert _without_run_config(job) == manifest("raycluster.yaml")["spec"]


def _kustomize(folder: Path) -> list[dict]:
    import shutil

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl here: its kustomize renders the kustomizations")
    out = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def test_a_rayjob_reads_its_config_from_a_configmap_made_at_apply_and_names_its_run_after_itself():
    """No image rebuild and no manifest edit per run (rendered by kustomize itself): the run's
    config is a ConfigMap generated from k8s/config/run-config.yaml, named with its content's
    hash, and the head mounts exactly that one where the entrypoint reads it; the run id is
    the RayJob's name — the submitter Job KubeRay creates carries it, its pod exports it from
    its own label, and the entrypoint (run by KubeRay in the submitter's shell) passes it as
    `--run-id`. So each retry (a new cluster, a new submission) continues the same run from
    the shared volume's checkpoints, and another RayJob name is another run."""
    import shlex

    from archipelago.orchestrator.cli import build_parser

    docs = {d["kind"]: d for d in _kustomize(K8S / "job")}
    config_map, job = docs["ConfigMap"], docs["RayJob"]
    assert config_map["metadata"]["name"].startswith("archipelago-run-config-")  # the content's hash
    assert config_map["data"]["run-config.yaml"] == (K8S / "config" / "run-config.yaml").read_text()
    head_pod = job["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    (volume,) = [v for v in head_pod["volumes"] if v["name"] == "run-config"]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    mounts = {m["name"]: m["mountPath"] for m in head_pod["containers"][0]["volumeMounts"]}
    assert mounts["run-config"] == RUN_CONFIG_DIR

    assert job["spec"]["backoffLimit"] >= 1
    (submitter,) = job["spec"]["submitterPodTemplate"]["spec"]["containers"]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in submitter["env"] if "valueFrom" in e}
    assert env["ARCHIPELAGO_RUN_ID"] == "metadata.labels['batch.kubernetes.io/job-name']"
    words = shlex.split(job["spec"]["entrypoint"])
    args = build_parser().parse_args(words[1:])
    assert args.command == "run" and args.run_id == "$ARCHIPELAGO_RUN_ID"  # expanded by the submitter's shell
    expanded = build_parser().parse_args(
        shlex.split(job["spec"]["entrypoint"].replace("$ARCHIPELAGO_RUN_ID", "r1"))[1:]
    )
    assert expanded.run_id == "r1" and expanded.config == f"{RUN_CONFIG_DIR}/run-config.yaml"
    run_config = manifest("config/run-config.yaml")
    assert run_config["checkpoint"]["path"].startswith("/mnt/archipelago/")  # on the shared volume


def test_every_pod_runs_unprivileged_as_the_images_user_with_resources():
    """The Ray image's user is uid 1000 in group users (100): the Dockerfile copies the code
    `--chown=ray:users`. Root-owned 0400 Secret files were unreadable by it, so the control
    plane could not start as shipped."""
    assert "--chown=ray:users" in (K8S / "Dockerfile").read_text()
    for where, pod in _pods().items():
        spec = pod["spec"]
        context = spec["securityContext"]
        assert context["runAsNonRoot"] and context["runAsUser"] == 1000 and context["runAsGroup"] == 100, where
        assert context["seccompProfile"] == {"type": "RuntimeDefault"}, where
        assert pod["metadata"]["labels"]["app.kubernetes.io/part-of"] == "archipelago", where
        for container in spec["containers"]:
            c = container["securityContext"]
            assert c["allowPrivilegeEscalation"] is False and c["capabilities"] == {"drop": ["ALL"]}, where
            resources = container["resources"]
            assert resources["requests"] == resources["limits"], where  # Guaranteed: evicted last
        for volume in spec.get("volumes", []):
            if "secret" in volume:  # readable by uid 1000: by its group (fsGroup) or by anyone
                mode = volume["secret"]["defaultMode"]
                assert (mode & 0o040 and context.get("fsGroup") == context["runAsGroup"]) or mode & 0o004, where
        mounts = [m for c in spec["containers"] for m in c.get("volumeMounts", [])]
        if (
            "head" not in where and "submitter" not in where
        ):  # islands read the shared volume and write only their state under checkpoint.path; slices their parts
            local = {v["name"] for v in spec.get("volumes", []) if "emptyDir" in v}  # the pod's own scratch
            writable = [m for m in mounts if not m.get("readOnly") and m["name"] not in local]
            assert [(m["mountPath"], m["subPath"]) for m in writable] == [(CHECKPOINTS, "checkpoints")], where
            for config in ("config/run-config.yaml", "hf-llama-config.yaml"):  # islands/ lies under it
                assert f"{manifest(config)['checkpoint']['path']}/".startswith(f"{CHECKPOINTS}/"), config
    for spec in (manifest("raycluster.yaml")["spec"], manifest("job/rayjob.yaml")["spec"]["rayClusterSpec"]):
        assert spec["authOptions"] == {"mode": "token"}  # Ray's job server and GCS need Ray's token too


def test_a_network_policy_admits_only_the_runs_pods_and_metrics_scrapes():
    assert "shared" in manifest("kustomization.yaml")["resources"]
    assert "networkpolicy.yaml" in manifest("shared/kustomization.yaml")["resources"]
    policy = manifest("shared/networkpolicy.yaml")
    assert policy["kind"] == "NetworkPolicy" and policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    label = policy["spec"]["podSelector"]["matchLabels"]
    assert label == {"app.kubernetes.io/part-of": "archipelago"}
    rules = policy["spec"]["ingress"]
    assert rules[0] == {"from": [{"podSelector": {"matchLabels": label}}]}  # the run's own pods
    opened = {
        port for rule in rules[1:] for p in rule["ports"] for port in range(p["port"], p.get("endPort", p["port"]) + 1)
    }
    run_cfg = load_config(K8S / "config" / "run-config.yaml")
    planes = set(range(run_cfg.api.port, run_cfg.api.port + run_cfg.api.ports))  # one per run on the cluster
    assert opened == {8265, *planes}  # job server, control planes: nothing else (metrics: k8s/monitoring's)
    assert rules[1]["from"] == [{"podSelector": {}}]  # this namespace's pods
    sources = [(src, {p["port"] for p in rule["ports"]}) for rule in rules[2:] for src in rule["from"]]
    # from another namespace: only the KubeRay operator, from its own namespace (the one
    # docs/deploy.md installs it in), which polls a RayJob's status on the job server
    ((operator, ports),) = sources
    assert ports == {8265} and operator["podSelector"] == {
        "matchLabels": {"app.kubernetes.io/name": "kuberay-operator"}
    }
    namespace = operator["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
    assert (
        f"helm install kuberay-operator kuberay/kuberay-operator --version 1.7.0 --namespace {namespace}"
        in (REPO / "docs" / "deploy.md").read_text()
    )


def test_the_runs_pods_reach_only_each_other_dns_and_https():
    """Egress: a compromised island opens nothing in the cluster but the run and DNS on their
    ports; the node's credential endpoints; object storage, the Hub, trackers and the API
    server (the autoscaler's) on 443/6443."""
    policy = manifest("shared/networkpolicy.yaml")
    own, dns, metadata, https = policy["spec"]["egress"]
    assert own == {"to": [{"podSelector": policy["spec"]["podSelector"]}]}
    # DNS wherever it is served (CoreDNS, NodeLocal DNSCache's link-local address, Cloud DNS)
    assert "to" not in dns and {(p["protocol"], p["port"]) for p in dns["ports"]} == {("UDP", 53), ("TCP", 53)}
    # the node's credential endpoints (workload identity tokens), link-local only
    assert metadata["to"] == [{"ipBlock": {"cidr": "169.254.0.0/16"}}]
    assert {(p["protocol"], p["port"]) for p in metadata["ports"]} == {("TCP", 80), ("TCP", 988)}
    assert "to" not in https and {(p["protocol"], p["port"]) for p in https["ports"]} == {("TCP", 443), ("TCP", 6443)}
    assert not any("endPort" in p for rule in (dns, metadata, https) for p in rule["ports"])


@pytest.mark.parametrize("folder", ["", "job"])
def test_every_container_states_its_pull_policy_and_the_head_outlives_its_stop_wait(folder):
    """Nodes pull an immutable image reference once (`IfNotPresent`, said on every container,
    not left to the tag's default), and a head pod's grace outlasts the stop wait the manifests
    give the driver's final checkpoint (`RAY_JOB_STOP_WAIT_TIME_S`): with Kubernetes' default
    30 s the kubelet SIGKILLed the head halfway through it."""
    docs = _rendered(K8S / folder)
    containers = [c for node in dicts(docs) for c in _containers(node)]
    assert containers and all(c.get("imagePullPolicy") == "IfNotPresent" for c in containers), containers
    heads = [node for node in dicts(docs) if any(c.get("name") == "ray-head" for c in node.get("containers", []))]
    assert heads
    for pod in heads:
        (head,) = [c for c in pod["containers"] if c["name"] == "ray-head"]
        wait = int(next(e["value"] for e in head["env"] if e["name"] == "RAY_JOB_STOP_WAIT_TIME_S"))
        assert pod.get("terminationGracePeriodSeconds", 30) >= wait + 20, (
            wait,
            pod.get("terminationGracePeriodSeconds"),
        )


def test_the_monitoring_kustomization_gives_both_objects_the_release_label_kube_prometheus_stack_selects_by():
    """kube-prometheus-stack's Prometheus loads only PodMonitors and rules labelled with its
    Helm release (`release: <name>`), silently ignoring the rest: rendered by kustomize itself
    (kubectl's), both carry the label and the namespace set in one place, and the PodMonitor's
    pod selector is still the run's alone."""
    import shutil
    import subprocess

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl here: its kustomize renders k8s/monitoring")
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S / "monitoring")], capture_output=True, text=True, check=True
    ).stdout
    docs = {d["kind"]: d for d in yaml.safe_load_all(out)}
    assert set(docs) == {"PodMonitor", "PrometheusRule", "NetworkPolicy"}  # the settings' ConfigMap is local
    settings = manifest("monitoring/kustomization.yaml")
    (pairs,) = [entry["pairs"] for entry in settings["labels"]]
    assert pairs == {"release": "kube-prometheus-stack"}  # the chart's default release name
    for doc in docs.values():
        assert doc["metadata"]["labels"]["release"] == "kube-prometheus-stack"
        assert doc["metadata"]["namespace"] == settings["namespace"]
    run = {"app.kubernetes.io/part-of": "archipelago"}
    assert docs["PodMonitor"]["spec"]["selector"]["matchLabels"] == run
    # Prometheus let in on the metrics port alone, from the namespace set once in the kustomization
    policy = docs["NetworkPolicy"]["spec"]
    (rule,) = policy["ingress"]
    assert policy["podSelector"]["matchLabels"] == run and rule["ports"] == [{"protocol": "TCP", "port": 8080}]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]


def test_prometheus_is_admitted_from_the_namespace_the_monitoring_kustomization_names(tmp_path):
    """The Prometheus namespace is one setting (`prometheus-settings`): changed there, the
    NetworkPolicy rendered with the PodMonitor admits that namespace and no other."""
    import shutil
    import subprocess

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("no kubectl here: its kustomize renders k8s/monitoring")
    folder = tmp_path / "monitoring"
    shutil.copytree(K8S / "monitoring", folder)
    kust = folder / "kustomization.yaml"
    kust.write_text(kust.read_text().replace("- namespace=monitoring", "- namespace=observability"))
    out = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, check=True).stdout
    (policy,) = [d for d in yaml.safe_load_all(out) if d["kind"] == "NetworkPolicy"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "observability"}}}]


def test_the_pod_monitor_scrapes_the_metrics_port_of_every_pod_of_the_run():
    monitor = manifest("monitoring/podmonitor.yaml")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "PodMonitor"
    assert "monitoring" not in manifest("kustomization.yaml")["resources"]  # needs the operator's CRDs
    selector = monitor["spec"]["selector"]["matchLabels"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    for where, pod in _pods().items():
        if "submitter" in where:
            continue
        assert selector.items() <= pod["metadata"]["labels"].items(), where
        ports = {p["name"]: p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports", [])}
        assert ports[endpoint["port"]] == 8080, where  # Ray's metrics agent, admitted by the NetworkPolicy


def test_no_token_value_is_tracked_or_shipped():
    """The Secret is created with `kubectl create secret`; a tracked secret.yaml invited
    `sed`-ing the real token into a file that `working_dir: .` then uploads to every node."""
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    for name in tracked.split():
        path = REPO / name
        if path.suffix in (".yaml", ".yml") and path.is_file():
            for doc in yaml.safe_load_all(path.read_text()):
                assert not (isinstance(doc, dict) and doc.get("kind") == "Secret"), name
    assert "k8s/secret.yaml" in (REPO / ".gitignore").read_text().split()
    deploy = (REPO / "docs" / "deploy.md").read_text()
    assert f"kubectl create secret generic {SECRET}" in deploy and "sed -i" not in deploy
    assert f"kubectl create secret generic {READ_SECRET}" in deploy
    # the guide hands the dashboard the read-only token, never the operator's, and never in a URL
    assert f"secret {READ_SECRET} -o jsonpath" in deploy and "#token=" not in deploy


def _rendered(folder: Path) -> list[dict]:
    """The resources a kustomization lists, with its components' `images:` applied the way
    kustomize's image transformer does (every `image` of a `containers` or `initContainers`
    entry, in any kind, CRDs included, whose name matches)."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    images = {}
    for component in kustomization.get("components", []):
        found = yaml.safe_load((folder / component / "kustomization.yaml").read_text())
        assert found["kind"] == "Component"
        images.update({i["name"]: i for i in found.get("images", [])})
    docs = []
    for r in kustomization["resources"]:  # a folder is a kustomization of its own (k8s/shared)
        inner = yaml.safe_load((folder / r / "kustomization.yaml").read_text()) if (folder / r).is_dir() else None
        files = [folder / r / f for f in inner["resources"]] if inner else [folder / r]
        docs += [yaml.safe_load(f.read_text()) for f in files]

    for node in dicts(docs):
        for c in _containers(node):
            name = c["image"].split("@")[0].rsplit(":", 1)[0]
            if name in images:
                i = images[name]
                ref = i.get("newName", name)
                c["image"] = f"{ref}@{i['digest']}" if "digest" in i else f"{ref}:{i['newTag']}"
    return docs


def _containers(node: dict) -> list[dict]:
    return [*node.get("containers", []), *node.get("initContainers", [])]


def _images(tree) -> list[str]:
    return [c["image"] for node in dicts(tree) for c in _containers(node)]


def _pinned(image: str) -> bool:
    """A digest, or a tag that is a commit (12 to 40 hex digits): what one build alone has.
    A release or branch name (`0.1.0`, `main`, `latest`) is reused across builds."""
    import re

    if re.fullmatch(r"[^@\s]+@sha256:[0-9a-f]{64}", image):
        return True
    name, _, tag = image.rpartition(":")
    return bool(name) and "/" not in tag and re.fullmatch(r"[0-9a-f]{12,40}", tag) is not None


def test_only_a_digest_or_a_commit_pins_the_image():
    assert _pinned("ghcr.io/o/archipelago@sha256:" + "a" * 64)
    assert _pinned("ghcr.io/o/archipelago:dbe97d35c1c4")
    assert _pinned("localhost:5000/archipelago:" + "0" * 40)
    for reused in ("ghcr.io/o/archipelago:0.1.0", "ghcr.io/o/archipelago:latest", "ghcr.io/o/archipelago",
                   "localhost:5000/archipelago", "ghcr.io/o/archipelago:main", "ghcr.io/o/archipelago@sha256:abc"):  # fmt: skip
        assert not _pinned(reused), reused
    script = (K8S / "image" / "build.sh").read_text()  # what sets it: the commit's tag, then its digest
    assert "commit=$(git rev-parse HEAD)" in script and '"$repo:$commit"' in script and "RepoDigests" in script
    assert "git status --porcelain" in script  # a build of uncommitted changes would carry the wrong name


@pytest.mark.parametrize("folder", ["", "job"])
def test_the_image_is_set_once_and_immutable_in_what_each_kustomization_renders(folder):
    docs = _rendered(K8S / folder)
    images = _images(docs)
    assert images and len(set(images)) == 1, images  # head, workers, submitter: one image, one place
    (image,) = set(images)
    assert _pinned(image), image
    for path in [*K8S.glob("*.yaml"), *K8S.glob("job/*.yaml")]:  # no manifest names a tag of its own
        assert "archipelago:latest" not in path.read_text(), path


def test_the_alert_rules_load_and_watch_series_the_run_exports():
    """Each rule is well formed and its expression parses as PromQL (Prometheus's own
    grammar, `promql-parser`), and reads only series the run exports through Ray's metrics
    agent (`ray_` + our names)."""
    import re

    import promql_parser

    from archipelago.orchestrator.engine.state.views import HISTOGRAMS, ISLAND_METRICS, ISLAND_STATE, RUN_METRICS

    exported = {f"ray_{m.name}" for m in [*RUN_METRICS, *ISLAND_METRICS, *HISTOGRAMS, ISLAND_STATE]}
    rule = manifest("monitoring/prometheusrule.yaml")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1" and rule["kind"] == "PrometheusRule"
    assert "monitoring" not in manifest("kustomization.yaml")["resources"]  # needs the operator's CRDs
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"]]
    names = {r["alert"] for r in alerts}
    assert names == {
        "ArchipelagoIslandStale",
        "ArchipelagoIslandSilent",
        "ArchipelagoIslandStuck",
        "ArchipelagoIslandsBelowTarget",
        "ArchipelagoRoundStalled",
    }
    for r in alerts:
        assert set(r) <= {"alert", "expr", "for", "labels", "annotations"} and r["annotations"]["summary"]
        assert re.fullmatch(r"\d+[smh]", r["for"]) and r["labels"]["severity"] in ("warning", "critical")
        expr = r["expr"]
        promql_parser.parse(expr)  # raises on a syntax error, as promtool would
        series = set(re.findall(r"\bray_archipelago_\w+", expr))
        assert series and series <= exported, (r["alert"], series - exported)


@pytest.mark.parametrize("file", ["raycluster.yaml", "job/rayjob.yaml"])
def test_a_worker_pods_sigterm_drains_its_node_before_the_kubelet_kills_it(file):
    """A worker pod's SIGTERM is its island's preemption notice only through Ray's drain
    (`ray start` marks its node draining for RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S; tested
    on a real node in tests/test_cluster_ray.py): set on every worker group, long enough for a
    round's result to leave, and ended with time for Ray's teardown before the pod's grace
    period runs out and the kubelet kills what is left."""
    spec = manifest(file)["spec"]
    spec = spec.get("rayClusterSpec", spec)
    for group in _island_groups(spec):  # a slice lost restarts the coordinator, drained or not
        pod = group["template"]["spec"]
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        drain = float(env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"])
        assert 10 <= drain <= pod["terminationGracePeriodSeconds"] - 5, (group["groupName"], drain)


@pytest.mark.parametrize("file", ["raycluster.yaml", "job/rayjob.yaml"])
def test_every_ray_pods_object_store_is_sized_in_memory_backed_shared_memory(file):
    """Without a memory-backed /dev/shm of its size, Ray's object store falls back to disk
    and every version published and every pseudo-gradient pulled in goes at the disk's pace:
    each pod states its store and mounts /dev/shm in memory at least that large, within the
    pod's memory limit, with room left for the processes."""
    from archipelago.orchestrator.plan.cluster import quantity

    spec = manifest(file)["spec"]
    spec = spec.get("rayClusterSpec", spec)
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    for group, (container, pod) in zip(groups, _ray_pods(spec)):
        store = int(group["rayStartParams"]["object-store-memory"])
        shm = next(m for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm")
        volume = next(v for v in pod["volumes"] if v["name"] == shm["name"])["emptyDir"]
        limit = quantity(container["resources"]["limits"]["memory"])
        assert volume["medium"] == "Memory" and quantity(volume["sizeLimit"]) >= store
        assert store <= 0.5 * limit, (store, limit)


# The machines each cloud component names, as their providers list them (vCPU, memory GiB,
# GPUs, memory of one GPU in GiB): an independent record, not read from the components.
MACHINES = {
    "p5.4xlarge": (16, 256, 1, 80),  # AWS: 1 H100 80 GB
    "a3-highgpu-1g": (26, 218, 1, 80),  # Google Cloud: 1 H100 80 GB, 234 GB = 218 GiB
    "Standard_NC40ads_H100_v5": (40, 320, 1, 94),  # Azure: 1 H100 NVL 94 GB
    # 24-GB cards report 23,028 MiB: the plan trusts 22 GiB of them
    "g6.2xlarge": (8, 32, 1, 22),  # AWS: 1 L4 24 GB
    "g5.2xlarge": (8, 32, 1, 22),  # AWS: 1 A10G 24 GB
    "g2-standard-8": (8, 32, 1, 22),  # Google Cloud: 1 L4 24 GB
}
# what an 8-vCPU / 32-GiB node leaves a pod (the issue's bound: the kubelet's reserve and the
# daemon sets taken): CPU and GiB
SMALL_NODE_ALLOCATABLE = (7.5, 28)
# what a cloud's RWX class needs: (class, provisioner family, smallest share in GiB)
STORAGE = {
    "aws": ("efs-sc", 0),  # EFS: elastic, no minimum
    "gcp": ("standard-rwx", 1024),  # Filestore basic: 1 TiB at least
    "azure": ("azurefile-csi-premium", 100),  # Azure Files premium: 100 GiB at least
}
# each cloud's workload identity: the service account's annotation
IDENTITY = {
    "aws": "eks.amazonaws.com/role-arn",
    "gcp": "iam.gke.io/gcp-service-account",
    "azure": "azure.workload.identity/client-id",
}
COMPONENTS = ["aws", "aws/l4", "aws/a10g", "gcp", "gcp/l4", "azure"]


def _with_component(tmp_path: Path, folder: str, component: str) -> list[dict]:
    """What `kubectl kustomize` renders for k8s/<folder> with the component k8s/<component>
    added, as a user adds it (a copy of k8s/, so the checkout is untouched)."""
    import shutil

    tree = tmp_path / "k8s"
    shutil.copytree(K8S, tree)
    path = tree / folder / "kustomization.yaml"
    kustomization = yaml.safe_load(path.read_text())
    prefix = "../" if folder else ""
    kustomization["components"] = [*kustomization.get("components", []), f"{prefix}{component}"]
    tmp_path.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(kustomization))
    return _kustomize(tree / folder)


@pytest.mark.parametrize("component", COMPONENTS)
@pytest.mark.parametrize("folder", ["", "job"])
def test_each_clouds_component_fits_its_named_machine_and_gives_the_volume_a_class_it_has(tmp_path, component, folder):
    """Rendered by kustomize with the cloud's component: the GPU workers select a machine
    that exists and ask for less than it has (a share left for the kubelet and daemon
    sets; an 8-vCPU node's pod within 7.5 CPU and 28 GiB), the accelerator memory the plan
    trusts is that machine's GPU's, the rest of the pod (object store in /dev/shm, drain,
    tokens) still holds, every pod runs as the service account the cloud's identity is
    given to, and the result validates against KubeRay's CRDs. The claim and the account
    come with the cluster (`k8s/`) or, on the RayJob path, from `k8s/shared/` with the same
    component: a class of that cloud, asked for at least its smallest share."""
    from archipelago.orchestrator.plan.cluster import quantity

    cloud = component.split("/")[0]
    docs = _with_component(tmp_path, folder, f"clouds/{component}")
    clusters = [d["spec"].get("rayClusterSpec", d["spec"]) for d in docs if d["kind"] in ("RayCluster", "RayJob")]
    assert clusters
    for doc in docs:
        if doc["kind"] in CRD_OF:
            jsonschema.validate(doc, crd_schema(CRD_OF[doc["kind"]]))
    for spec in clusters:
        (group,) = _island_groups(spec)
        pod = group["template"]["spec"]
        selector = pod["nodeSelector"]
        machine = selector["node.kubernetes.io/instance-type"]
        cpus, memory_gib, gpus, gpu_gib = MACHINES[machine]
        container = pod["containers"][0]
        requests = container["resources"]["requests"]
        assert requests == container["resources"]["limits"]  # Guaranteed, as in the base
        assert quantity(requests["cpu"]) <= cpus - 1, (machine, requests)
        assert quantity(requests["memory"]) <= 0.9 * memory_gib * 2**30, (machine, requests)
        if cpus == 8:
            cpu, gib = SMALL_NODE_ALLOCATABLE
            assert quantity(requests["cpu"]) <= cpu and quantity(requests["memory"]) <= gib * 2**30, requests
        assert int(requests["nvidia.com/gpu"]) <= gpus
        annotation = group["template"]["metadata"]["annotations"]["archipelago.io/accelerator-memory"]
        assert quantity(annotation) == gpu_gib * 2**30, (machine, annotation)
        store = int(group["rayStartParams"]["object-store-memory"])
        assert store <= 0.5 * quantity(container["resources"]["limits"]["memory"])
        head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
        env = {e["name"] for e in head["env"]}
        assert {"ARCHIPELAGO_API_TOKEN_FILE", "ARCHIPELAGO_API_READ_TOKEN_FILE"} <= env
        assert any(t.get("key") == "nvidia.com/gpu" for t in pod["tolerations"])
        pods = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
        assert {g["template"]["spec"]["serviceAccountName"] for g in pods} == {"archipelago"}
        # the account's API token (KubeRay binds the autoscaler's Role to it) on the head alone
        assert "automountServiceAccountToken" not in spec["headGroupSpec"]["template"]["spec"]
        assert all(g["template"]["spec"]["automountServiceAccountToken"] is False for g in spec["workerGroupSpecs"])
    shared = docs if folder == "" else _with_component(tmp_path / "shared", "shared", f"clouds/{component}")
    (claim,) = [d for d in shared if d["kind"] == "PersistentVolumeClaim"]
    storage_class, smallest = STORAGE[cloud]
    assert claim["spec"]["storageClassName"] == storage_class and claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert quantity(claim["spec"]["resources"]["requests"]["storage"]) >= smallest * 2**30
    (account,) = [d for d in shared if d["kind"] == "ServiceAccount"]
    assert account["metadata"]["name"] == "archipelago" and account["metadata"]["annotations"][IDENTITY[cloud]]
    if folder == "job":  # deleting a job's resources never deletes the claim
        assert not [d for d in docs if d["kind"] in ("PersistentVolumeClaim", "ServiceAccount")]
    images = _images(docs)
    assert images and len(set(images)) == 1


@pytest.mark.parametrize("file", ["raycluster.yaml", "job/rayjob.yaml"])
def test_gpu_workers_keep_torch_compiles_caches_on_the_node(file):
    """Islands compile their forward on CUDA by default (`inner.compile` null): Inductor's and
    Triton's caches point into a node-local volume of the pod, writable by the image's user,
    so a restarted or replacement island process on it does not compile again."""
    from archipelago.workers.wire.spec import InnerConfig

    assert InnerConfig().compile is None and InnerConfig().compiles_on("cuda") and not InnerConfig().compiles_on("cpu")
    spec = manifest(file)["spec"]
    spec = spec.get("rayClusterSpec", spec)
    for group in _island_groups(spec):
        pod = group["template"]["spec"]
        container = pod["containers"][0]
        env = {e["name"]: e.get("value") for e in container["env"]}
        mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
        volumes = {v["name"]: v for v in pod["volumes"]}
        for variable in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
            path = Path(env[variable])
            (mount,) = [m for m in mounts if path.is_relative_to(m)]
            assert "emptyDir" in volumes[mounts[mount]], (variable, mount)


def test_the_head_is_protected_from_voluntary_disruption_on_both_paths():
    """A drain or a consolidation that evicts the head ends the run: a PodDisruptionBudget of
    `maxUnavailable: 0` selects the head pod (its template's labels and the node type KubeRay
    gives it) and no island's, and the head tells Karpenter and the cluster autoscaler."""
    docs = {d["kind"]: d for d in _kustomize(K8S)}
    budget = docs["PodDisruptionBudget"]
    assert budget["spec"]["maxUnavailable"] == 0
    selector = budget["spec"]["selector"]["matchLabels"]
    for spec in (manifest("raycluster.yaml")["spec"], manifest("job/rayjob.yaml")["spec"]["rayClusterSpec"]):
        head = spec["headGroupSpec"]["template"]["metadata"]
        assert selector.items() <= {**head["labels"], "ray.io/node-type": "head"}.items()
        assert head["annotations"]["karpenter.sh/do-not-disrupt"] == "true"
        assert head["annotations"]["cluster-autoscaler.kubernetes.io/safe-to-evict"] == "false"
        for group in spec["workerGroupSpecs"]:  # islands and slices stay evictable
            labels = {**group["template"]["metadata"].get("labels", {}), "ray.io/node-type": "worker"}
            assert not selector.items() <= labels.items(), group["groupName"]
    deploy = (REPO / "docs" / "deploy.md").read_text()
    assert "kubectl apply -k k8s/shared/ &&\nkubectl apply -k k8s/job/" in deploy  # the RayJob path applies it too
    assert "pdb.yaml" in manifest("shared/kustomization.yaml")["resources"]


def test_the_gcs_fault_tolerance_component_points_the_head_at_redis(tmp_path):
    """k8s/gcs-ft/, on the RayCluster path: the cluster's GCS state in an external Redis
    (KubeRay's `gcsFaultToleranceOptions`, validated against its CRD), the password from a
    Secret, never a value; both worker groups wait 600 s for a head that comes back; the
    network policy lets the pods reach Redis's port, and nothing else is opened. Not a
    RayJob's: a job whose driver died is retried on a fresh cluster, which keeps nothing."""
    docs = _with_component(tmp_path, "", "gcs-ft")
    (cluster,) = [d for d in docs if d["kind"] == "RayCluster"]
    jsonschema.validate(cluster, crd_schema(CRD_OF["RayCluster"]))
    spec = cluster["spec"]
    options = spec["gcsFaultToleranceOptions"]
    assert options["redisAddress"] == "archipelago-redis:6379"
    assert options["redisPassword"] == {"valueFrom": {"secretKeyRef": {"name": "archipelago-redis", "key": "password"}}}
    assert {g["groupName"] for g in spec["workerGroupSpecs"]} == {"gpu", "slices"}
    for group in spec["workerGroupSpecs"]:
        env = {e["name"]: e.get("value") for e in group["template"]["spec"]["containers"][0]["env"]}
        assert env["RAY_gcs_rpc_server_reconnect_timeout_s"] == "600"
    (policy,) = [d for d in docs if d["kind"] == "NetworkPolicy"]
    (base,) = [d for d in _rendered(K8S / "shared") if d["kind"] == "NetworkPolicy"]
    added = [rule for rule in policy["spec"]["egress"] if rule not in base["spec"]["egress"]]
    assert added == [{"ports": [{"protocol": "TCP", "port": 6379}]}]
    assert policy["spec"]["ingress"] == base["spec"]["ingress"]
    assert "RayJob" not in (K8S / "gcs-ft" / "kustomization.yaml").read_text().split("apiVersion:")[1]
