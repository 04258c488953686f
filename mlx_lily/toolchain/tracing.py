"""Kernels in a traced graph, and first uses that met one.

``traced_not_run()`` builds kernels for a graph that ``mx.export_function``
traces rather than evaluates (bench/counts.py), ``contiguous`` stands in for
``mx.contiguous`` there, and the counters tell a compiled step whether a
kernel's first-use check met a graph transformation (it then runs eagerly
once more) and how long first-use checks took (bench --cold-start).
"""

from __future__ import annotations

import contextlib
import threading

import mlx.core as mx


class _Tracing(threading.local):
    active = False


_TRACING = _Tracing()


@contextlib.contextmanager
def traced_not_run():
    """Build kernels for a graph that is traced (``mx.export_function``), not
    evaluated: without the row-contiguous copy MLX puts before each input,
    whose primitive export cannot serialize. The graph then shows each kernel
    as one node; a copy MLX would make of a non-contiguous input at run time
    is not in it (bench/counts.py says so)."""
    before, _TRACING.active = _TRACING.active, True
    try:
        yield
    finally:
        _TRACING.active = before


def tracing() -> bool:
    """Inside ``traced_not_run()``."""
    return _TRACING.active


def contiguous(a: mx.array) -> mx.array:
    """``mx.contiguous(a)``; in a traced graph, where export cannot serialize
    that primitive, an element-wise copy (``a * 1``, the same values) stands
    for it: one node that reads and writes ``a``, as the copy does at run
    time."""
    if _TRACING.active:
        return a * mx.array(1, dtype=a.dtype)
    return mx.contiguous(a)


# First uses that met a graph transformation, so ran the reference unchecked.
_FIRST_USES_IN_TRACES = [0]
_FIRST_USES_MET: list = []


class _FirstUseTime:
    """Seconds spent in first-use checks so far in this process: building
    and running each instantiation (on CUDA mostly NVRTC's compile) and its
    reference; what a cold start costs beyond stock's (bench --cold-start)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.checks, self.kernel_s, self.reference_s = 0, 0.0, 0.0

    def add(self, kernel_s: float, reference_s: float) -> None:
        self.checks += 1
        self.kernel_s += kernel_s
        self.reference_s += reference_s

    def as_dict(self) -> dict:
        return {"checks": self.checks, "kernel_s": round(self.kernel_s, 3),
                "reference_s": round(self.reference_s, 3)}


FIRST_USE_TIME = _FirstUseTime()


def first_uses_in_traces() -> int:
    """How many first uses so far came inside a graph transformation: a
    compiled step whose trace raised this count holds references where a
    kernel would run once checked."""
    return _FIRST_USES_IN_TRACES[0]


def inside_transformation(exc: Exception) -> bool:
    """Whether ``exc`` is MLX refusing to evaluate inside a graph
    transformation (compile, vmap, grad)."""
    return isinstance(exc, ValueError) and "during function transformations" in str(exc)


def count_first_use_in_trace(what: str = "a kernel") -> None:
    """A first use met a graph transformation and ran the reference
    unchecked; ``what`` names the instance (for the compiled step's notice)."""
    _FIRST_USES_IN_TRACES[0] += 1
    _FIRST_USES_MET.append(what)


def first_uses_met_since(count: int) -> list:
    """The instances named by the first uses in traces after the first ``count``."""
    return _FIRST_USES_MET[count:]
