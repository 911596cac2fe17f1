"""The coordinator's hot path, compiled with numba: the token-weighted mean of K
pseudo-gradients with each one's ‖Δ_i‖² for admission (`weighted_mean`: one pass that
reads every update once and writes the mean once), and `FlatSGD`'s SGD / Nesterov step in
place (`sgd_step`: one pass over the mean, the parameters and the momentum).

Why compiled: the same work as vectorised numpy/torch ops costs a temporary per op and a
trip through memory per op; at 4 updates of 25 M values on one core the torch mean takes
36 ms and its step 20 ms, these loops 29 ms for both.

Why two passes and not one: a single loop could step while it averages, but admission
decides from the norms that loop computes, so the step would be taken before anyone knows
whether it is wanted, and would have to be written beside the parameters and momentum
(two spare vectors) and swapped in. Averaging first and stepping in place after the
decision measured faster from 25 M values up (0.96× that loop's seconds at 4 updates of
25 M on one core, 0.78× at 100 M, 0.68× at 1 B over two slices: writing in place touches
no fresh memory) and slower below (1.16× at 8 M), needs the mean buffer only (one vector
fewer), and keeps the step a stock `optimizer.step()` on the parameter it was built over.

Bit for bit what `WeightedMean.fill`'s torch path and `FlatSGD.step`'s compute (tested):
the same float32 operations in the same order, with the fused multiply-adds torch's
`add_(x, alpha=a)` takes (`llvm.fma`), and no fast-math on the arithmetic that reaches the
parameters; only the norms' sums may be reassociated (they are admission's, in float64).

The kernels are generated per K (the mean) and per rule (the step) and compiled on first
use in a process (about a second; numba compiles `exec`'d source but cannot cache it on
disk).

numba is optional (the `fast` extra; the image and the test extra install it): without it
`available()` is False and the same numbers are computed with torch ops, block by block,
at about half the rate, which matters only for large models."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np


@functools.cache
def available() -> bool:
    """Whether numba (and its llvmlite) can be imported here, so the kernel can be built."""
    try:
        import llvmlite  # noqa: F401
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class SGDRule:
    """`FlatSGD`'s hyper-parameters for one step."""

    lr: float
    momentum: float
    nesterov: bool


@functools.cache
def _fma() -> Any:
    """float32 a·b + c with one rounding, as torch's `add_(alpha=…)` computes it."""
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def fma(typingctx: Any, a: Any, b: Any, c: Any) -> Any:
        sig = types.float32(types.float32, types.float32, types.float32)

        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            f32 = ir.FloatType()
            fn = builder.module.declare_intrinsic("llvm.fma", [f32], ir.FunctionType(f32, [f32, f32, f32]))
            return builder.call(fn, args)

        return sig, codegen

    return fma


@functools.cache
def _square_add() -> Any:
    """s + a² in float64: the norms' sums, the one operation the compiler may reassociate
    (so it vectorises them). A function of its own because fast-math flags are per
    function in numba and stay on its instructions when LLVM inlines it: in the kernel
    itself `reassoc` would also let it reorder the arithmetic that reaches the
    parameters (it turned `acc / total * scale` into other roundings)."""
    import numba

    def square_add(s: float, a: float) -> float:
        v = np.float64(a)
        return s + v * v

    return numba.njit(nogil=True, fastmath={"reassoc"})(square_add)


def _mean_source(k: int) -> str:
    """The mean of k updates: one loop over the elements, K float64 norm sums."""
    xs = ", ".join(f"x{i}" for i in range(k))
    ws = ", ".join(f"w{i}" for i in range(k))
    lines = [
        f"def kernel({xs}, {ws}, total, scale, out, sq):",
        *(f"    s{i} = 0.0" for i in range(k)),
        "    for j in range(out.size):",
        *(f"        a{i} = x{i}[j]" for i in range(k)),
        *(f"        s{i} = square_add(s{i}, a{i})" for i in range(k)),
        "        acc = a0 * w0",
        *(f"        acc = fma(a{i}, w{i}, acc)" for i in range(1, k)),
        "        out[j] = acc / total * scale",  # × 1 is exact: the unscaled mean's numbers
        *(f"    sq[{i}] = s{i}" for i in range(k)),
    ]
    return "\n".join(lines) + "\n"


def _step_source(momentum: bool, has_buffer: bool, nesterov: bool) -> str:
    """`FlatSGD`'s step on the mean `g`, in place: each element of the parameters (and the
    momentum) read and written once; `b` is written even on the first step (`has_buffer`
    False: it becomes the mean, as torch's clone of the gradient makes it)."""
    lines = ["def kernel(g, lr, mom, p, b):", "    for j in range(p.size):", "        gj = g[j]"]
    if not momentum:
        lines.append("        p[j] = fma(-lr, gj, p[j])")
    else:
        lines.append("        bn = b[j] * mom + gj" if has_buffer else "        bn = gj")
        lines.append("        b[j] = bn")
        lines.append(
            "        p[j] = fma(-lr, fma(mom, bn, gj), p[j])" if nesterov else "        p[j] = fma(-lr, bn, p[j])"
        )
    return "\n".join(lines) + "\n"


def _compile(source: str, name: str) -> Callable[..., None]:
    """Only the norms' additions may be reassociated (`_square_add`): every operation on
    the values is one IEEE float32 operation or fma, in the order written."""
    import numba

    namespace: dict[str, Any] = {"np": np, "fma": _fma(), "square_add": _square_add()}
    exec(compile(source, f"<fused_step {name}>", "exec"), namespace)
    fn: Callable[..., None] = numba.njit(nogil=True)(namespace["kernel"])
    return fn


@functools.cache
def mean_kernel(k: int) -> Callable[..., None]:
    """The compiled mean of k updates (memoised per process)."""
    return _compile(_mean_source(k), f"mean k={k}")


@functools.cache
def step_kernel(momentum: bool, has_buffer: bool, nesterov: bool) -> Callable[..., None]:
    """The compiled step of one rule (memoised per process)."""
    return _compile(_step_source(momentum, has_buffer, nesterov), f"step m={momentum} b={has_buffer} n={nesterov}")


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fused-step")


def _split(n: int, threads: int, run: Callable[[int, int], Any]) -> list[Any]:
    """`run(lo, hi)` over contiguous ranges of whole cache lines, one per thread (the
    kernels release the GIL); one range below 64 Ki elements."""
    if threads <= 1 or n < 1 << 16:
        return [run(0, n)]
    per = -(-n // threads)
    step = -(-per // 64) * 64
    return list(_pool(threads).map(lambda r: run(*r), [(lo, min(lo + step, n)) for lo in range(0, n, step)]))


def weighted_mean(
    parts: Sequence[tuple[np.ndarray, float]], out: np.ndarray, threads: int = 1, scale: float = 1.0
) -> list[float]:
    """`out` = Σ w_i x_i / Σ w_i × `scale` over `parts` (float32, in their order); returns
    each x_i's ‖x_i‖² (not finite if x_i is not)."""
    total = sum(w for _, w in parts)
    if total <= 0:
        raise ValueError("no contributions to average")
    fn = mean_kernel(len(parts))
    xs = [np.asarray(x) for x, _ in parts]
    ws = [np.float32(w) for _, w in parts]
    f32 = np.float32

    def run(lo: int, hi: int) -> np.ndarray:
        sq = np.zeros(len(parts))
        fn(*(x[lo:hi] for x in xs), *ws, f32(total), f32(scale), out[lo:hi], sq)
        return sq

    return [float(s) for s in np.sum(_split(out.size, threads, run), axis=0)]


def sgd_step(rule: SGDRule, g: np.ndarray, p: np.ndarray, b: np.ndarray | None, first: bool, threads: int = 1) -> None:
    """One `FlatSGD` step on the mean `g`, in place in `p` (and the momentum `b`; `first`:
    its first step, `b` is written, not read)."""
    momentum = rule.momentum != 0
    if momentum and b is None:
        raise ValueError("a step with momentum writes its momentum: b is needed")
    fn = step_kernel(momentum, not first, rule.nesterov)
    f32 = np.float32
    dummy = p[:0]  # an unused operand still needs an array type

    def run(lo: int, hi: int) -> None:
        fn(g[lo:hi], f32(rule.lr), f32(rule.momentum), p[lo:hi], b[lo:hi] if b is not None else dummy)

    _split(p.size, threads, run)
