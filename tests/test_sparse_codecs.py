"""The compression frontier's parts: 2-bit values, chunked top-k with bit-packed positions,
their chains, error feedback with SparseLoCo's decay, the SparseLoCo outer rule and the
Muon inner optimizer; reference vectors worked by hand (docs/algorithms.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from archipelago.orchestrator.cli import main
from archipelago.orchestrator.config_load import ConfigError, load_config
from archipelago.workers.wire.compress import ErrorFeedback, check_payload, decode, encode
from archipelago.workers.wire.sparse import pack_indices, unpack_indices
from archipelago.workers.wire.spec import CodecSpecError, parse_codec, payload_nbytes

# vector S1 (docs/algorithms.md): chunks of 4, keep 2, values in 2 bits with one scale per chunk's 2
CENTERS = "[[1.0,0.0],[-0.5,2.0],[0.5,0.5]]"
S1_X = np.array([0.1, -2.0, 0.5, 3.0, 0.0, -0.2, 1.0, -1.0], np.float32)
S1_DECODED = [0.0, -1.0, 0.0, 3.0, 0.0, 0.0, 1.0, -1.0]


def test_vector_s1_top_k_positions_values_and_2_bit_scales():
    p = encode(S1_X, "topk:0.5+int2", chunk=4)
    assert p["topk_shape"].tolist() == [8, 4, 2]
    assert unpack_indices(p["topk_idx"], 4, 2).tolist() == [1, 3, 2, 3]  # 2 bits per position in a chunk of 4
    assert p["v.scale"].tolist() == pytest.approx([2.0, 2 / 3])  # max |kept| / 1.5 per chunk
    assert decode(p).tolist() == pytest.approx(S1_DECODED)
    check_payload(p, 8)


def test_int2_rounds_to_four_levels_per_chunk():
    x = np.array([-3.0, -1.2, 0.4, 3.0, 0.0, 0.0, 0.0, 0.0, 1.0], np.float32)
    p = encode(x, "int2", chunk=4)
    assert p["int2"].size == 3 and p["scale"].tolist() == pytest.approx([2.0, 1.0, 1 / 1.5])
    assert decode(p).tolist() == pytest.approx([-3.0, -1.0, 1.0, 3.0, 0.5, 0.5, 0.5, 0.5, 1.0])


@pytest.mark.parametrize("bits", [1, 9, 12, 16])
def test_positions_round_trip_at_their_bit_width(bits):
    idx = np.random.default_rng(bits).integers(0, 1 << bits, 1001)
    packed = pack_indices(idx, bits)
    assert packed.size == -(-1001 * bits // 8) and np.array_equal(unpack_indices(packed, 1001, bits), idx)


@pytest.mark.parametrize(("codec", "ratio"), [("topk:0.02+int2", 100), ("topk:0.02+int4", 90), ("topk:0.05+int8", 25)])
def test_top_k_chains_keep_the_largest_values_in_far_fewer_bytes(codec, ratio):
    x = np.random.default_rng(0).standard_normal(100_003).astype(np.float32)
    p = encode(x, codec, chunk=512)
    check_payload(p, x.size)
    back = decode(p)
    assert x.nbytes / payload_nbytes(p) > ratio
    kept = back != 0
    k = parse_codec(codec).topk
    assert kept.sum() <= np.ceil(k * 512) * np.ceil(x.size / 512)
    for c in range(0, x.size, 512):  # every kept value is at least every dropped one of its chunk
        part, on = np.abs(x[c : c + 512]), kept[c : c + 512]
        assert part[on].min() >= part[~on].max()


def test_a_malformed_top_k_payload_is_refused_with_a_reason():
    from archipelago.workers.wire.compress import PayloadError

    p = encode(np.arange(100, dtype=np.float32), "topk:0.1+int4", chunk=16)
    with pytest.raises(PayloadError, match="not 200 values"):
        check_payload(p, 200)
    with pytest.raises(PayloadError, match="positions"):
        check_payload({**p, "topk_idx": p["topk_idx"][:-1]}, 100)
    with pytest.raises(PayloadError, match="scales"):
        check_payload({**p, "v.scale": p["v.scale"][:-1]}, 100)


def test_error_feedback_over_50_drifting_updates_stays_one_step_behind_and_decays_as_sparseloco():
    rng = np.random.default_rng(0)
    deltas = [rng.normal(size=4096).astype(np.float32) * 0.01 + 0.002 * np.sin(t / 7) for t in range(50)]
    feedback, fed, plain = ErrorFeedback(), np.zeros(4096), np.zeros(4096)
    for d in deltas:
        plain += decode(encode(d, "topk:0.05+int2", chunk=512))
        values = feedback.compensate(d)
        sent = decode(encode(values, "topk:0.05+int2", chunk=512))
        feedback.sent(values, sent)
        fed += sent
    truth = np.sum(deltas, axis=0)
    assert np.linalg.norm(fed - truth) < np.linalg.norm(plain - truth) / 3
    # SparseLoCo's buffer: e <- beta e + delta, sent = C(e), e <- e - sent (vector S2)
    decayed = ErrorFeedback(decay=0.5)
    e = np.array([1.0, -2.0], np.float32)
    decayed.residual = e
    assert decayed.compensate(np.array([0.5, 0.5], np.float32)).tolist() == [1.0, -0.5]


@pytest.mark.parametrize(
    ("codec", "message"),
    [
        ("topk:1.5+int2", "outside (0, 1]"),
        ("topk:0+int2", "outside (0, 1]"),
        ("int:3", "bits must be 2, 4 or 8"),
        ("zstd", "unknown codec 'zstd'"),
        ("topk:0.1+int2+int4", "one value codec"),
    ],
)
def test_a_bad_codec_chain_exits_2_naming_the_field(codec, message, capsys):
    with pytest.raises(CodecSpecError, match=message.replace("(", r"\(").replace("]", r"\]")):
        parse_codec(codec)
    with pytest.raises(ConfigError, match=r"compression\.codec"):
        load_config(None, [f"compression.codec={codec}"])
    assert main(["-q", "config", "show", "--set", f"compression.downlink={codec}"]) == 2
    assert "compression.downlink" in capsys.readouterr().err


def test_sparseloco_needs_error_feedback_and_steps_without_momentum():
    from archipelago.orchestrator.engine.step.rules import outer_optimizer

    with pytest.raises(ConfigError, match="error_feedback"):
        load_config(None, ["outer.optimizer=sparseloco", "compression.codec=topk:0.02+int2"])
    cfg = load_config(
        None,
        [
            "outer.optimizer=sparseloco",
            "outer.lr=1.0",
            "compression.codec=topk:0.02+int2",
            "compression.error_feedback=true",
        ],
    )
    param = torch.nn.Parameter(torch.tensor([1.0, 2.0], dtype=torch.float64))
    opt = outer_optimizer(cfg.outer, param)
    for delta in ([0.5, -0.5], [0.5, -0.5]):  # the same Δ twice: no momentum builds up
        param.grad = torch.tensor(delta, dtype=torch.float64)
        opt.step()
    assert param.tolist() == [0.0, 3.0]


def test_muon_takes_the_hidden_matrices_and_adamw_the_rest():
    from archipelago.workers.runtime.optim import build_inner, muon_params
    from archipelago.workers.tasks.lm_task import make_task
    from archipelago.workers.wire.spec import InnerConfig

    model = make_task(d_model=32, n_layers=2, n_heads=2, context=32).build_model()
    chosen = muon_params(model)
    names = {n for n, p in model.named_parameters() if id(p) in chosen}
    assert names == {f"blocks.{i}.{w}.weight" for i in range(2) for w in ("qkv", "proj", "mlp.0", "mlp.2")}
    opt, _ = build_inner(InnerConfig(optimizer="muon", muon_lr=0.02), model.parameters(), 100, muon=chosen)
    assert isinstance(opt.muon, torch.optim.Muon) and opt.param_groups[0]["lr"] == pytest.approx(0.02 / 50)
    with pytest.raises(ConfigError, match="muon"):
        load_config(None, ["inner.optimizer=muon", "mode=ddp", "warm_start.steps=0"])


@pytest.mark.parametrize(
    "mode",
    [
        ["mode=diloco"],
        ["mode=streaming", "mode.fragments=2", "task.kwargs.split=true"],
        ["compression.downlink=int4"],
    ],
)
def test_islands_that_build_version0_download_nothing_and_one_that_differs_downloads_it(tmp_path, mode):
    from tests.helpers import events, in_process_engine

    def run(name: str, *extra: str):
        cfg = load_config(
            None,
            [
                f"task.kwargs.centers={CENTERS}",
                "warm_start.steps=0",
                "islands.count=3",
                "rounds=3",
                "inner_steps=4",
                "inner.optimizer=sgd",
                "inner.lr=0.1",
                "inner.warmup_steps=0",
                f"out_dir={tmp_path / name}",
                *mode,
                *extra,
            ],
        )
        engine, _ = in_process_engine(cfg)
        engine.execute()
        joins = [e.get("version0") for e in events(cfg.out_dir) if e["kind"] == "join"]
        return engine.summary, joins, engine.flat.data.clone()

    quad = "task.factory=tests.toy_tasks:make_quadratic"
    plain, _, plain_params = run("plain", quad)
    built, joins, built_params = run("built", quad, "islands.build_version0=true")
    assert plain["bytes_bootstrap"] > 0 and built["bytes_bootstrap"] == 0 and joins == ["built"] * 3
    assert built["bytes_communicated"] == plain["bytes_communicated"] - plain["bytes_bootstrap"]
    assert torch.equal(built_params, plain_params)  # the same run, bit for bit
    planted, joins, planted_params = run(
        "planted",
        "task.factory=tests.toy_tasks:make_planted_build",
        f"task.kwargs.record={tmp_path.name}{len(mode)}",
        "islands.build_version0=true",
    )
    assert joins == ["built", "built differently: downloads it", "built"]
    assert planted["bytes_bootstrap"] == plain["bytes_bootstrap"] // 3  # that island's download only
    assert torch.equal(planted_params, plain_params)  # it trained from the coordinator's version 0


def test_islands_forking_from_a_warm_start_load_it_from_storage_instead_of_downloading(tmp_path):
    from archipelago.orchestrator.bench.simulation.pool import InProcessPool
    from archipelago.orchestrator.engine.build import PhasedRun
    from tests.helpers import events

    def run(name: str, *extra: str):
        cfg = load_config(
            None,
            [
                "task.factory=tests.toy_tasks:make_quadratic",
                f"task.kwargs.centers={CENTERS}",
                "islands.count=3",
                "rounds=3",
                "inner_steps=4",
                "warm_start.steps=8",
                "inner.warmup_steps=0",
                f"out_dir={tmp_path / name}",
                *extra,
            ],
        )
        summary = PhasedRun(cfg, name, lambda c, rid: InProcessPool(c)).execute()
        return cfg, summary

    _, plain = run("plain")
    cfg, built = run("built", "islands.build_version0=true")
    assert plain["bytes_bootstrap"] > 0 and built["bytes_bootstrap"] == 0
    assert (tmp_path / "built" / "warm_start" / "version0.npy").is_file()
    assert [e.get("version0") for e in events(cfg.out_dir) if e["kind"] == "join"] == ["built"] * 3
    assert built["final_eval_loss"] == plain["final_eval_loss"]
