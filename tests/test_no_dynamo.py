"""Islands and the coordinator build, step and save their optimizers without importing
`torch._dynamo` (about 1.1 s of CPU per process, the largest part of an island's start
before), and the optimizers they step are bitwise torch's own."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from archipelago.workers.runtime.optim import SGD, Adam, AdamW
from tests.conftest import REPO
from tests.helpers import TINY_LM

RUN = textwrap.dedent(
    """
    import sys
    from archipelago.orchestrator.config_load import load_config
    from archipelago.orchestrator.engine.build import PhasedRun
    from archipelago.orchestrator.bench.simulation.pool import InProcessPool

    # nothing called first: importing the modules that build optimizers applies it
    for i, sets in enumerate(sys.argv[2:]):
        cfg = load_config(None, [*sets.split(), "checkpoint.every_rounds=1", f"out_dir={sys.argv[1]}/{i}"])
        summary = PhasedRun(cfg, f"r{i}", lambda c, _: InProcessPool(c)).execute()
        assert summary["state"] == "finished", summary["state"]
    print("dynamo imported:", "torch._dynamo" in sys.modules)
    """
)


def test_a_run_imports_no_dynamo(tmp_path, corpus_cache):
    """A warm-started run (AdamW islands, Nesterov outer, saved island and optimizer
    state), Muon islands, SGD islands with an Adam outer step, and ddp."""
    tiny = " ".join([*TINY_LM, f"task.kwargs.cache_dir={corpus_cache}", "task.kwargs.eval_batches=1"])
    small = f"{tiny} warm_start.steps=2 rounds=2 inner_steps=2"
    runs = [
        small,
        f"{small} inner.optimizer=muon",
        f"{small} inner.optimizer=sgd outer.optimizer=adam outer.lr=0.01",
        f"{tiny} mode=ddp rounds=3 inner_steps=1",
    ]
    out = subprocess.run(
        [sys.executable, "-c", RUN, str(tmp_path), *runs],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "dynamo imported: False"


@pytest.mark.parametrize(
    ("ours", "theirs", "kwargs"),
    [
        (AdamW, torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "foreach": True}),
        (Adam, torch.optim.Adam, {"lr": 1e-2, "betas": (0.8, 0.9)}),
        (SGD, torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ],
)
def test_the_plain_step_is_torchs_step_bitwise(ours, theirs, kwargs):
    torch.manual_seed(0)
    start = [torch.randn(7, 5), torch.randn(5)]
    grads = [[torch.randn_like(p) for p in start] for _ in range(6)]
    params = {}
    for name, cls in (("ours", ours), ("theirs", theirs)):
        ps = [torch.nn.Parameter(p.clone()) for p in start]
        opt = cls(ps, **kwargs)
        for g in grads:
            for p, gi in zip(ps, g):
                p.grad = gi.clone()
            opt.step()
        params[name] = ps
    assert ours is not theirs and issubclass(ours, theirs)
    for a, b in zip(params["ours"], params["theirs"]):
        assert torch.equal(a, b)
        assert not torch.equal(a, start[0] if a.shape == start[0].shape else start[1])  # they moved
