"""How a kernel's result is judged against its op's reference, and how a
failure is told in one line: the self-check's and first-use check's default
tolerance, an element-wise judge for kernels that round where MLX rounds,
and a CPU-stream runner for references whose rounding must not depend on the
backend."""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx
import numpy as np


def on_cpu(fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` evaluated on the CPU stream: a reference whose
    MLX ops round bf16 where the kernels (and Metal) round, for contracts that
    must not depend on another backend's element-wise rounding (MLX's CUDA
    ops round some bf16 steps differently)."""
    with mx.stream(mx.cpu):
        result = fn(*args, **kwargs)
        mx.eval(result)
    return result


def default_agree(got, want, *args, **kwargs) -> Optional[str]:
    """Outputs within loose bf16-level tolerance, else a one-line mismatch."""
    got = got if isinstance(got, (list, tuple)) else [got]
    want = want if isinstance(want, (list, tuple)) else [want]
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape:
            return f"output {i}: shape {g.shape} != reference {w.shape}"
        if not mx.allclose(g.astype(mx.float32), w.astype(mx.float32), rtol=2e-2, atol=2e-2).item():
            diff = mx.abs(g.astype(mx.float32) - w.astype(mx.float32)).max().item()
            return f"output {i}: max |kernel - reference| = {diff:.3g}"
    return None


def elementwise_mismatch(got, want, rel: float, of_max: float, most_differ: float = 0.01) -> Optional[str]:
    """None when every element is within ``rel |want| + of_max max|want|`` of
    the reference and at most a ``most_differ`` share of them differ at all,
    else a one-line mismatch: the judge of kernels that round where MLX's ops
    round, up to a rare one-step flip."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{tuple(got.shape)} {got.dtype} (reference: {tuple(want.shape)} {want.dtype})"
    g = np.array(got.astype(mx.float32), dtype=np.float64)
    w = np.array(want.astype(mx.float32), dtype=np.float64)
    err = np.abs(g - w)
    bound = rel * np.abs(w) + of_max * np.abs(w).max(initial=0.0)
    if not (err <= bound).all():
        at = int(np.argmax(err - bound))
        return f"{int((err > bound).sum())} of {err.size} off, e.g. {g.reshape(-1)[at]:.6g} against {w.reshape(-1)[at]:.6g}"
    differ = int((err > 0).sum())
    if differ > most_differ * err.size:
        return f"{differ} of {err.size} elements differ (at most {most_differ:.0%})"
    return None


def all_finite(result) -> bool:
    arrays = result if isinstance(result, (list, tuple)) else [result]
    for a in arrays:
        if isinstance(a, mx.array) and mx.issubdtype(a.dtype, mx.inexact):
            if not mx.isfinite(a).all().item():
                return False
    return True


def one_line(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    limit = 300
    return f"{type(exc).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"
