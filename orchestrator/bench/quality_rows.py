"""The `quality` scenario's rows: what each one runs (its overrides and seeds), how its
runs continue their seed's warm start, and how its learning rates are tuned (seed 0 over a
grid that is widened past its top while the top is the best: a best on the edge of a grid
is not a tuned setting, for data-parallel as for DiLoCo)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from archipelago.orchestrator.bench.runner import continue_warm, run_methods, train_warm_start

K = 4
WARM = 400  # data-parallel steps shared by every method (a quarter of the full run, like the paper's 24k of 88k)
SEEDS = (0, 1, 2)
H_VALUES = (25, 50, 100)
OUTER_LRS = (0.3, 0.5, 0.7, 1.0)
# data-parallel's tuning: its (inner) AdamW lr, as many settings as DiLoCo's outer lr per H,
# around the shipped 3e-3 (its 4x batch may want more)
DDP_LRS = (1.5e-3, 3e-3, 6e-3, 1.2e-2)
MODEL = [
    "task.kwargs.d_model=64",
    "task.kwargs.n_layers=2",
    "task.kwargs.n_heads=2",
    "task.kwargs.context=64",
    "task.kwargs.batch_size=16",
    "task.kwargs.eval_batches=64",
    "inner.warmup_steps=40",
    "data_shards=16",  # the same shards for 1 and 4 islands, so every method continues one warm start
    f"ray.num_cpus={K}",
]
DEFAULT_LR = 0.7  # quick runs skip the sweep and use the product's default for this regime


@dataclass
class Method:
    key: str
    description: str
    overrides: list[str]
    seeds: tuple[int, ...] = (0,)
    outer_lr: float | None = None  # the DiLoCo rows' Nesterov lr
    work: Path | None = None  # where its runs are (set by `run_row`)
    runs: dict[int, dict[str, Any]] = field(default_factory=dict)  # seed -> summary


def diloco(steps: int, h: int, *extra: str) -> list[str]:
    return [f"islands.count={K}", f"inner_steps={h}", f"rounds={steps // h}", f"eval_every={max(1, 100 // h)}", *extra]


def nesterov(lr: float) -> list[str]:
    return ["outer.optimizer=nesterov", f"outer.lr={lr}", "outer.momentum=0.9"]


FEDAVG = ["outer.optimizer=sgd", "outer.lr=1.0", "outer.momentum=0.0"]


def h_row(steps: int, h: int, lr: float) -> Method:
    return Method(
        f"diloco_k4_h{h}", f"DiLoCo k=4 H={h}, Nesterov lr {lr} / 0.9", diloco(steps, h, *nesterov(lr)), SEEDS, lr
    )


def ddp_row(steps: int, lr: float | None) -> Method:
    """Data-parallel at AdamW lr `lr` (None: the shipped one)."""
    ddp = ["mode=ddp", f"islands.count={K}", "inner_steps=50", f"rounds={steps // 50}"]
    tuned = [f"inner.lr={lr}"] if lr is not None else []
    what = f"AdamW lr {lr:g} every step" if lr is not None else "AdamW every step"
    return Method("ddp_k", f"data-parallel, 4 islands = 4x batch, {what}", [*ddp, *tuned], SEEDS)


def methods(
    steps: int, quick: bool, h_rows: dict[int, Method], ddp: Method | None = None, inner: Method | None = None
) -> list[Method]:
    """The rows; `h_rows` (H -> row) are the DiLoCo rows at their chosen outer lr, `ddp`
    data-parallel at its chosen lr (default: the shipped one), `inner` the H = 50 row at its
    tuned inner lr (when that is not the shipped one). A full run adds the H = 50 row at the
    shipped outer lr when the sweep chose another: the figure a user gets."""
    single = ["islands.count=1", "inner_steps=50", "eval_every=2", *FEDAVG]
    rows = [
        ddp or ddp_row(steps, None),
        *h_rows.values(),
        *([inner] if inner is not None else []),
        Method("fedavg_k4_h50", "outer SGD lr 1 = parameter averaging", diloco(steps, 50, *FEDAVG), SEEDS),
    ]
    if quick:
        return rows
    lr50 = h_rows[50].outer_lr
    assert lr50 is not None
    best50 = diloco(steps, 50, *nesterov(lr50))  # the H = 50 row's outer settings
    if lr50 != DEFAULT_LR:
        shipped = h_row(steps, 50, DEFAULT_LR)
        rows.append(
            Method(
                f"{shipped.key}_default",
                f"{shipped.description} (the shipped default)",
                shipped.overrides,
                SEEDS,
                DEFAULT_LR,
            )
        )
    return [
        Method("single_1x", "1 island, same inner steps (1/4 the tokens)", [*single, f"rounds={steps // 50}"]),
        Method("single_4x", "1 island, same tokens (4x the steps)", [*single, f"rounds={K * steps // 50}"]),
        *rows,
        Method(
            "diloco_k4_h50_outer_adam", "outer Adam lr 0.01", diloco(steps, 50, "outer.optimizer=adam", "outer.lr=0.01")
        ),
        Method(
            "diloco_k4_h50_non_iid",
            "non-iid islands (different packages; own warm start on that split)",
            [*best50, NON_IID],
        ),
        Method("diloco_k4_h50_drop50", "50% of pseudo-gradients dropped", [*best50, "simulation.drop_prob=0.5"]),
    ]


NON_IID = "task.kwargs.split=non_iid"


def run_row(m: Method, warm: dict[int, Path], work: Path, seeds: tuple[int, ...] | None = None) -> None:
    """The seeds of `m` not run yet, each continuing its seed's warm start (a non-iid row
    its own, trained on its split: a warm start is continued only by runs of its task)."""
    m.work = m.work or work
    if NON_IID in m.overrides:
        base = [*MODEL, NON_IID, f"islands.count={K}", "inner_steps=50", f"rounds={_rounds(m)}"]
        warm = {s: train_warm_start(base, s, WARM, work / f"warm_non_iid@s{s}") for s in seeds or m.seeds}
    table = {
        f"{m.key}@s{s}": (
            m.description,
            [*m.overrides, f"seed={s}", *continue_warm(WARM, warm[s])],
        )
        for s in seeds or m.seeds
        if s not in m.runs
    }
    for name, summary in run_methods(MODEL, table, m.work).items():
        m.runs[int(name.rsplit("@s", 1)[1])] = summary
    m.runs = dict(sorted(m.runs.items()))


def _rounds(m: Method) -> int:
    """The rounds of a 4-island row at H = 50 (its warm start's schedule ends with them)."""
    return int(next(o for o in m.overrides if o.startswith("rounds="))[len("rounds=") :])


WIDEN = 2  # settings tried past a grid's top, at most, while the top stays the best
SHIPPED_INNER_LR = 3e-3  # the product's inner AdamW lr (inner.lr), DiLoCo's in every row but the tuned one


def widened(
    grid: tuple[float, ...],
    loss_at: Callable[[float], float],
    grow: Callable[[float], float],
    shrink: Callable[[float], float] | None = None,
) -> dict[float, float]:
    """`loss_at` every setting of `grid`, then past its top (`grow` of it) while the top
    is the best, or with `shrink` past its bottom while the bottom is, at most `WIDEN` more:
    a best on the edge of a grid is not a tuned one."""
    losses = {x: loss_at(x) for x in grid}
    for _ in range(WIDEN):
        best = min(losses, key=losses.__getitem__)
        if best == max(losses):
            edge = grow(best)
        elif shrink is not None and best == min(losses):
            edge = shrink(best)
        else:
            break
        losses[edge] = loss_at(edge)
    return losses


def _seed0(m: Method, warm: dict[int, Path], folder: Path) -> float:
    run_row(m, warm, folder, seeds=(0,))
    loss: float = m.runs[0]["final_eval_loss"]
    return loss


def tune_ddp(steps: int, warm: dict[int, Path], work: Path) -> tuple[dict[float, float], Method]:
    """Seed 0 of data-parallel at every AdamW lr of `DDP_LRS` (widened); its row is the best lr's."""
    tried: dict[float, Method] = {}

    def loss_at(lr: float) -> float:
        tried[lr] = ddp_row(steps, lr)
        return _seed0(tried[lr], warm, work / "sweep" / f"ddp_lr{lr:g}")

    losses = widened(DDP_LRS, loss_at, lambda lr: 2 * lr)
    return losses, tried[min(losses, key=losses.__getitem__)]


def tune_outer(
    steps: int, warm: dict[int, Path], work: Path
) -> tuple[dict[int, dict[float, float]], dict[int, Method]]:
    """Seed 0 of every H at every outer lr of `OUTER_LRS` (widened); the row of each H is its best lr's."""
    sweep: dict[int, dict[float, float]] = {}
    chosen: dict[int, Method] = {}
    for h in H_VALUES:
        tried: dict[float, Method] = {}

        def loss_at(lr: float, h: int = h, tried: dict[float, Method] = tried) -> float:
            tried[lr] = h_row(steps, h, lr)
            return _seed0(tried[lr], warm, work / "sweep" / f"lr{lr}")

        sweep[h] = widened(OUTER_LRS, loss_at, lambda lr: round(lr + 0.3, 2))
        chosen[h] = tried[min(sweep[h], key=sweep[h].__getitem__)]
    return sweep, chosen


def tune_inner(h50: Method, warm: dict[int, Path], work: Path) -> tuple[dict[float, float], Method | None]:
    """DiLoCo's inner AdamW lr tuned as hard as data-parallel's: seed 0 of the H = 50 row (at
    its chosen outer lr) at every lr of data-parallel's grid (widened the same way); the row
    at the best lr (3 seeds) when that is not the shipped one, else None."""
    tried: dict[float, Method] = {SHIPPED_INNER_LR: h50}  # its seed 0 ran in the outer lr sweep

    def loss_at(lr: float) -> float:
        if lr not in tried:
            tried[lr] = Method(
                "diloco_k4_h50_tuned_inner",
                f"{h50.description}, inner AdamW lr {lr:g}",
                [*h50.overrides, f"inner.lr={lr}"],
                SEEDS,
                h50.outer_lr,
            )
        return _seed0(tried[lr], warm, work / "sweep" / f"inner_lr{lr:g}")

    losses = widened(DDP_LRS, loss_at, lambda lr: 2 * lr)
    best = min(losses, key=losses.__getitem__)
    return losses, None if best == SHIPPED_INNER_LR else tried[best]
