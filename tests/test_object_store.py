"""Checkpoints on object storage (`checkpoint.path: s3://…`) against a real S3 endpoint
running locally (moto's server, spoken to by s3fs over HTTP, as a bucket on AWS or MinIO
would be): a run checkpoints there, its coordinator is lost, and the restarted one resumes
from the bucket, every batch trained once; a corrupt newest object falls back to the one
before; a bucket that cannot be written is refused before any compute (exit 2's error)."""

from __future__ import annotations

from collections import Counter

import pytest

from orchestrator.config_load import ConfigError, check_folders, load_config
from orchestrator.engine.build import build_engine
from orchestrator.engine.checkpoints import load_checkpoint, run_folder, runs_in
from tests.engine_scenarios import check_exactly_once, drive, scenario_cfg
from tests.helpers import in_process_engine

boto3 = pytest.importorskip("boto3")
pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

BUCKET = "archipelago-checkpoints"


@pytest.fixture(scope="module")
def endpoint():
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(endpoint, monkeypatch):
    """The SDKs' own environment: credentials and the endpoint, never the run's config."""
    import s3fs

    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": endpoint,
    }.items():
        monkeypatch.setenv(key, value)
    s3fs.S3FileSystem.clear_instance_cache()
    client = boto3.client("s3", endpoint_url=endpoint)
    if BUCKET not in [b["Name"] for b in client.list_buckets()["Buckets"]]:
        client.create_bucket(Bucket=BUCKET)
    yield client
    s3fs.S3FileSystem.clear_instance_cache()


def _objects(client, prefix: str) -> list[str]:
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return sorted(o["Key"].rsplit("/", 1)[-1] for o in listed)


def test_a_run_checkpointed_to_s3_resumes_from_the_bucket_after_its_coordinator_is_lost(tmp_path, s3):
    location = f"s3://{BUCKET}/{tmp_path.name}"
    cfg = scenario_cfg(tmp_path, "diloco", f"checkpoint.path={location}", "checkpoint.keep=2")
    check_folders(cfg)
    first, pool = in_process_engine(cfg, run_id="bucket")
    drive(first, until=3)
    assert _objects(s3, f"{tmp_path.name}/bucket/") == [
        "membership.json", "state-000002.pt", "state-000002.pt.sha256", "state-000003.pt", "state-000003.pt.sha256",
    ]  # fmt: skip
    assert runs_in(location) == ["bucket"]
    saved = load_checkpoint(run_folder(location, "bucket"))["ledger"]["position"]
    lost = Counter((s, i) for s, p in enumerate(first.ledger.position) for i in range(saved[s], p))
    pool.coordinator_lost()
    second = build_engine(cfg, pool, run_id="bucket")  # a new process would read the same objects
    assert second.resumed and second.rounds_done == 3
    drive(second)
    check_exactly_once(cfg, second.summary, lost)
    assert second.summary["rounds_done"] == 6


def test_a_corrupt_newest_object_falls_back_to_the_one_before(tmp_path, s3):
    location = f"s3://{BUCKET}/{tmp_path.name}"
    cfg = scenario_cfg(tmp_path, "diloco", f"checkpoint.path={location}")
    first, _ = in_process_engine(cfg, run_id="torn")
    drive(first, until=3)
    key = f"{tmp_path.name}/torn/state-000003.pt"
    data = bytearray(s3.get_object(Bucket=BUCKET, Key=key)["Body"].read())
    data[len(data) // 2] ^= 0xFF
    s3.put_object(Bucket=BUCKET, Key=key, Body=bytes(data))
    assert load_checkpoint(run_folder(location, "torn"))["counters"]["rounds_done"] == 2


def test_a_bucket_that_cannot_be_written_is_refused_before_any_compute(tmp_path, s3):
    cfg = load_config(None, [f"out_dir={tmp_path}", "checkpoint.path=s3://no-such-bucket/runs"])
    with pytest.raises(ConfigError, match=r"checkpoint\.path: s3://no-such-bucket/runs is not writable"):
        check_folders(cfg)
