"""The coordinator's hot path in one pass per byte: the token-weighted mean of K
pseudo-gradients, each one's ‖Δ_i‖² for admission, and an SGD / Nesterov outer step
(`FlatSGD`'s arithmetic), element by element, compiled with numba.

Why compiled: the same work as vectorised numpy/torch ops reads the K updates, writes the
mean, then reads it, the momentum and the parameters again; at 4 updates of 8 M values
that is about 0.47× memcpy on one core, where this loop, reading each byte once and
writing the new parameters and momentum once, runs at about 0.85× (`bench datapath`).

Why into separate output buffers: admission decides from the norms this same pass
computes, so the step is taken before anyone knows whether it is wanted. Writing the
result beside the current parameters and momentum (which the pass only reads) keeps a
refused update exact to undo: the caller swaps the buffers only if every update was
admitted as assumed, and otherwise steps the admitted ones from the untouched state.

Bit for bit what `WeightedMean.fill` and `FlatSGD.step` compute (tested): the same float32
operations in the same order, with the fused multiply-adds torch's `add_(x, alpha=a)`
takes (`llvm.fma`), and no fast-math on the arithmetic that reaches the parameters; only
the norms' sums may be reassociated (they are admission's, in float64).

The kernel is generated per (K, rule) and compiled on first use in a process (about a
second; numba compiles `exec`'d source but cannot cache it on disk).

numba is optional (the `fast` extra; the image and the test extra install it): without it
`available()` is False and the coordinator takes the mean-then-step path, the same numbers
bit for bit at about half this pass's rate, which matters only for large models."""

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


def _source(k: int, momentum: bool, has_buffer: bool, nesterov: bool) -> str:
    """The kernel for k updates: one loop over the elements, K float64 norm sums."""
    xs = ", ".join(f"x{i}" for i in range(k))
    ws = ", ".join(f"w{i}" for i in range(k))
    lines = [
        f"def kernel({xs}, {ws}, total, scale, lr, mom, p, b, p_out, b_out, sq):",
        *(f"    s{i} = 0.0" for i in range(k)),
        "    for j in range(p.size):",
        *(f"        a{i} = x{i}[j]" for i in range(k)),
        *(f"        s{i} = square_add(s{i}, a{i})" for i in range(k)),
        "        acc = a0 * w0",
        *(f"        acc = fma(a{i}, w{i}, acc)" for i in range(1, k)),
        "        g = acc / total * scale",  # × 1 is exact: the unscaled step's numbers
    ]
    if not momentum:
        lines.append("        p_out[j] = fma(-lr, g, p[j])")
    else:
        lines.append("        bn = b[j] * mom + g" if has_buffer else "        bn = g")
        lines.append("        b_out[j] = bn")
        lines.append(
            "        p_out[j] = fma(-lr, fma(mom, bn, g), p[j])"
            if nesterov
            else "        p_out[j] = fma(-lr, bn, p[j])"
        )
    lines += [f"    sq[{i}] = s{i}" for i in range(k)]
    return "\n".join(lines) + "\n"


@functools.cache
def kernel(k: int, momentum: bool, has_buffer: bool, nesterov: bool) -> Callable[..., None]:
    """The compiled kernel (memoised per process). Only the norms' additions may be
    reassociated (`_square_add`): every operation on the values is one IEEE float32
    operation or fma, in the order written."""
    import numba

    namespace: dict[str, Any] = {"np": np, "fma": _fma(), "square_add": _square_add()}
    exec(compile(_source(k, momentum, has_buffer, nesterov), f"<fused_step k={k}>", "exec"), namespace)
    fn: Callable[..., None] = numba.njit(nogil=True)(namespace["kernel"])
    return fn


@functools.cache
def _pool(threads: int) -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fused-step")


def mean_step(
    parts: Sequence[tuple[np.ndarray, float]],
    rule: SGDRule,
    p: np.ndarray,
    b: np.ndarray | None,
    p_out: np.ndarray,
    b_out: np.ndarray | None,
    threads: int = 1,
    scale: float = 1.0,
) -> list[float]:
    """p_out (and, with momentum, b_out) = one outer step from p (and momentum b; None:
    its first step) on Σ w_i x_i / Σ w_i × `scale` (a pacing's) over `parts`; returns
    each x_i's ‖x_i‖² (not finite if x_i is not). `threads` split the vector into
    contiguous ranges, each its own pass (the kernel releases the GIL)."""
    total = sum(w for _, w in parts)
    if total <= 0:
        raise ValueError("no contributions to average")
    momentum = rule.momentum != 0
    if momentum and b_out is None:
        raise ValueError("a step with momentum writes its momentum: b_out is needed")
    fn = kernel(len(parts), momentum, b is not None, rule.nesterov)
    xs = [np.asarray(x) for x, _ in parts]
    ws = [np.float32(w) for _, w in parts]
    f32 = np.float32
    n = p.size
    dummy = p_out[:0]  # unused operands still need an array type

    def run(lo: int, hi: int) -> np.ndarray:
        sq = np.zeros(len(parts))
        fn(
            *(x[lo:hi] for x in xs),
            *ws,
            f32(total),
            f32(scale),
            f32(rule.lr),
            f32(rule.momentum),
            p[lo:hi],
            b[lo:hi] if b is not None else dummy,
            p_out[lo:hi],
            b_out[lo:hi] if b_out is not None else dummy,
            sq,
        )
        return sq

    if threads <= 1 or n < 1 << 16:
        return [float(s) for s in run(0, n)]
    per = -(-n // threads)
    step = -(-per // 64) * 64  # whole cache lines per thread
    ranges = [(lo, min(lo + step, n)) for lo in range(0, n, step)]
    sums = list(_pool(threads).map(lambda r: run(*r), ranges))
    return [float(s) for s in np.sum(sums, axis=0)]
