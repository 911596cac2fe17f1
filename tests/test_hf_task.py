"""The Hugging Face task: a tokenizer trained on the embedded corpus, documents packed with
EOS through the shard contract, a tiny Llama built from config, and the export that
transformers loads back with the same logits. In process (the Ray runs are in
test_hf_ray.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

pytest.importorskip("transformers", reason="the [hf] extra is not installed")

from archipelago.orchestrator.cli import main
from archipelago.orchestrator.config_load import dump_config, load_config
from archipelago.workers.tasks.hf_task import HFTaskConfig, make_task
from archipelago.workers.tasks.task import TaskError, export_pretrained, load_task
from archipelago.workers.tasks.text_data import Documents, island_part
from tests.helpers import TINY_LLAMA, fell_20_percent, in_process_run

TINY = {"preset": "tiny-llama", "context": 32, "batch_size": 8, "eval_batches": 2}


@pytest.fixture(scope="module")
def task(corpus_cache):
    t = make_task(**TINY, cache_dir=corpus_cache)
    t.prepare()
    return t


def test_the_trained_tokenizer_round_trips_text_and_is_cached(task, corpus_cache):
    tok = task.tokenizer
    assert len(tok) == 2048 and tok.eos_token == "<|endoftext|>"
    text = "def f(x):\n    return {'a': x ** 2}  # ünïcode\n"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    held_out = sum(len(t.encode()) for t in task.corpus.texts("eval"))
    assert len(task.documents("eval").tokens) < held_out / 2.5  # BPE merges: far fewer tokens than bytes
    again = make_task(**TINY, cache_dir=corpus_cache).tokenizer  # loaded from the cache, not retrained
    assert again.get_vocab() == tok.get_vocab()


def test_documents_pack_with_eos_and_shards_cover_the_corpus_once(task):
    docs = Documents.of([[1, 2], [3], [4, 5, 6]])
    assert docs.packed(np.array([2, 0, 1]), 0).tolist() == [4, 5, 6, 0, 1, 2, 0, 3, 0]
    train = task.documents("train")
    whole = task.packed()
    parts = [island_part(whole, i, 4) for i in range(4)]
    assert np.array_equal(np.concatenate(parts), whole)
    assert (whole == task.eos).sum() == len(train)  # one EOS after every document
    x, y = next(task.train_batches(1, 4, seed=0))
    assert x.shape == (8, 32) and torch.equal(x[:, 1:], y[:, :-1])


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="exactly one of model, model_config, preset"):
        HFTaskConfig(preset="tiny-llama", model_config={"model_type": "llama"})
    with pytest.raises(ValueError, match="model_type"):
        HFTaskConfig(model_config={"hidden_size": 64})
    with pytest.raises(TaskError, match="rejected its kwargs"):
        load_task("archipelago.workers.tasks.hf_task:make_task", {"preset": "tiny-llama", "context_length": 64})


def test_a_model_from_config_trains_and_exports_to_transformers_with_the_same_logits(task, corpus_cache, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = task.build_model()
    assert 1e6 <= sum(p.numel() for p in model.parameters()) <= 5e6
    assert type(model).__name__ == "LlamaForCausalLM"
    batch = next(task.train_batches(0, 4, seed=0))
    before = float(task.loss(model, batch).detach())
    assert before == pytest.approx(np.log(2048), rel=0.1)  # an untrained model: uniform over the vocabulary
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(10):
        opt.zero_grad()
        task.loss(model, batch).backward()
        opt.step()
    assert float(task.loss(model, batch).detach()) < before

    out = export_pretrained(task, model.state_dict(), tmp_path / "hf")
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    loaded = AutoModelForCausalLM.from_pretrained(out)
    x = batch[0][:2]
    with torch.no_grad():
        assert torch.allclose(loaded(input_ids=x).logits, model(input_ids=x).logits, atol=1e-5)
    generated = loaded.generate(x[:1, :8], max_new_tokens=5, do_sample=False)
    assert generated.shape == (1, 13)


def _export_cli(run_dir, out_dir, *extra: str) -> subprocess.CompletedProcess:
    """`archipelago export RUN_DIR OUT_DIR` in a fresh process."""
    cmd = [sys.executable, "-m", "archipelago.orchestrator.cli", "export", str(run_dir), str(out_dir), *extra]
    return subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=120)


def test_a_run_with_the_hf_task_exports_at_the_end_and_the_cli_exports_again(corpus_cache, tmp_path, capsys):
    cfg = load_config(
        None,
        [
            "task.factory=archipelago.workers.tasks.hf_task:make_task",
            "task.kwargs.preset=tiny-llama",
            "task.kwargs.context=32",
            "task.kwargs.batch_size=8",
            "task.kwargs.eval_batches=2",
            f"task.kwargs.cache_dir={corpus_cache}",
            "warm_start.steps=0",
            "islands.count=2",
            "rounds=2",
            "inner_steps=3",
            "export.every_rounds=1",
            "export.keep=1",
            f"out_dir={tmp_path / 'run'}",
        ],
    )
    in_process_run(cfg)
    snapshots = sorted((tmp_path / "run" / "snapshots").iterdir())  # one per round, the newest kept
    assert [s.name for s in snapshots] == ["round-000002"] and (snapshots[0] / "config.json").exists()
    assert (snapshots[0] / "model.safetensors").read_bytes() == (tmp_path / "run/export/model.safetensors").read_bytes()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["export"] == str(tmp_path / "run" / "export")
    assert (tmp_path / "run" / "export" / "config.json").exists()
    cli = _export_cli(tmp_path / "run", tmp_path / "again")
    assert cli.returncode == 0, cli.stderr
    a = (tmp_path / "run" / "export" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "again" / "model.safetensors").read_bytes()
    # config.yaml is on a writable volume and names code to import: only what the checkpoint recorded
    config = tmp_path / "run" / "config.yaml"
    config.write_text(
        config.read_text().replace("archipelago.workers.tasks.hf_task:make_task", "tests.toy_tasks:make_recording")
    )
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "planted")]) == 2  # refused before any import
    assert "trained with 'archipelago.workers.tasks.hf_task:make_task'" in capsys.readouterr().err
    assert not (tmp_path / "planted").exists()


def test_export_of_a_task_without_save_pretrained_is_a_clear_error(tmp_path):
    cfg = load_config(None, ["task.kwargs.d_model=16", "task.kwargs.n_layers=1", "task.kwargs.n_heads=2"])
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(dump_config(cfg))
    task = load_task(cfg.task.factory, cfg.task.kwargs)
    torch.save(task.build_model().state_dict(), tmp_path / "run" / "final.pt")
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out")]) == 2  # no checkpoint vouches for it
    cli = _export_cli(tmp_path / "run", tmp_path / "out", "--trust-config")
    assert cli.returncode == 2 and "no save_pretrained" in cli.stderr


def test_the_shipped_llama_config_validates_and_builds_a_model_of_about_100m_parameters():
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.conftest import REPO

    cfg = load_config(str(REPO / "k8s" / "hf-llama-config.yaml"), [])
    kwargs = HFTaskConfig(**cfg.task.kwargs)
    assert kwargs.source == "hf" and cfg.inner.precision.value == "bf16" and cfg.islands.gpus == 1
    arch = dict(kwargs.architecture or {})
    assert arch["vocab_size"] == 50257  # GPT-2's tokenizer's, stated so the plan needs no download
    conf = AutoConfig.for_model(arch.pop("model_type"), **arch)
    with torch.device("meta"):  # the shape only: no memory, no download
        model = AutoModelForCausalLM.from_config(conf)
    assert 100e6 <= sum(p.numel() for p in model.parameters()) <= 150e6


def test_activation_checkpointing_gives_the_same_gradient(corpus_cache):
    grads = []
    for checkpointing in (False, True):
        t = make_task(**TINY, cache_dir=corpus_cache, activation_checkpointing=checkpointing)
        torch.manual_seed(0)
        model = t.build_model().train()
        newer = hasattr(type(model), "is_activation_checkpointing")  # transformers' newer name
        assert (model.is_activation_checkpointing if newer else model.is_gradient_checkpointing) == checkpointing
        t.loss(model, next(t.train_batches(0, 4, seed=0))).backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    assert grads[0].abs().max() > 0
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=1e-6)


def test_a_tiny_llama_trains_in_async_mode_with_its_warm_start(corpus_cache, tmp_path):
    """Asynchronous mode on the HF task, in process on the virtual clock (the Ray run of the
    same model is the sync one in test_hf_ray.py): the default warm start, then two islands'
    asynchronous updates, take the eval loss 20 % below the untrained model's."""
    from archipelago.orchestrator.bench.simulation.config import SimulationConfig
    from archipelago.orchestrator.bench.simulation.runner import run_in_process

    sets = [*TINY_LLAMA, "mode=async", f"task.kwargs.cache_dir={corpus_cache}"]
    summary = run_in_process(load_config(None, [*sets, f"out_dir={tmp_path}"]), SimulationConfig(virtual_step_s=0.05))
    assert summary["state"] == "finished" and summary["outer_steps"] >= 6
    fell_20_percent(summary)


def test_a_corpus_prepared_with_the_hf_tokenizer_carries_it_and_trains_the_task(task, corpus_cache, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from archipelago.workers.data.manifest import read_manifest

    docs = [f"def f{i}(x):\n    return x * {i}  # document {i}\n" * 20 for i in range(200)]
    pq.write_table(pa.table({"text": docs}), tmp_path / "code.parquet")
    out = tmp_path / "prepared"
    sets = ["task.factory=archipelago.workers.tasks.hf_task:make_task", "task.kwargs.preset=tiny-llama"]
    args = [a for s in [*sets, f"task.kwargs.cache_dir={corpus_cache}"] for a in ("--set", s)]
    prepare = [
        "-q",
        "data",
        "prepare",
        str(tmp_path / "code.parquet"),
        str(out),
        "--eval-every",
        "10",
        "--workers",
        "1",
    ]
    assert main([*prepare, *args]) == 0
    m = read_manifest(out)
    assert m.tokenizer == task.encoder().identity and m.dtype == "uint16" and m.separator == task.eos
    assert (out / "tokenizer" / "tokenizer.json").is_file()
    # a run on the corpus names no tokenizer: the one prepared with it is used
    on_it = make_task(**TINY, source="prepared", prepared=[{"path": str(out)}], cache_dir=str(tmp_path / "cache"))
    on_it.prepare()
    x, y = next(on_it.train_batches(0, 4, seed=0))
    assert x.shape == (8, 32) and int(x.max()) < len(on_it.tokenizer) and torch.equal(x[:, 1:], y[:, :-1])
    assert "return x *" in on_it.tokenizer.decode(x[0].tolist())
