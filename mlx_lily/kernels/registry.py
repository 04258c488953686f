"""Lily ops: one name, a pure-MLX reference, and optionally a custom kernel.

Every piece of math in lily's layers goes through a :class:`LilyOp`. The op
decides per call which path runs:

* the **kernel**, when one is registered, the default device is a GPU, the
  kernel built and passed its one-time self-check on this machine, and the
  op's ``supports`` predicate accepts the call's shapes and dtypes;
* otherwise the **reference**, a pure-MLX function that is the ground truth in
  tests and what runs on a CPU.

``MLX_LILY_KERNELS=0`` forces the reference everywhere (a kill switch for
debugging and for A/B checks). Every decision is recorded per op so that
``python -m mlx_lily doctor`` can say which path each op takes and why.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Protocol

import mlx.core as mx


class KernelLike(Protocol):
    """What an op needs from a built kernel (see ``kernels/toolchain.py``)."""

    def ready(self) -> tuple[bool, str]:
        """(usable on this machine, why not / which backend)."""

    def __call__(self, *args, **kwargs): ...


def kernels_enabled() -> bool:
    return os.environ.get("MLX_LILY_KERNELS", "1") != "0"


def gpu_backend() -> Optional[str]:
    """'metal', 'cuda' or None, for the default device."""
    if mx.default_device() != mx.gpu:
        return None
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return None


@dataclass
class LilyOp:
    name: str
    reference: Callable
    kernel: Optional[KernelLike] = None
    # supports(*args, **kwargs) -> None when the kernel takes this call, else
    # a short reason why not (shape, dtype, quantization ...).
    supports: Optional[Callable[..., Optional[str]]] = None
    description: str = ""
    # sample() -> (args, kwargs): small inputs for doctor and the test suite.
    sample: Optional[Callable[[], tuple]] = None
    last_path: Optional[str] = field(default=None, compare=False)
    last_reason: Optional[str] = field(default=None, compare=False)

    def choose(self, *args, **kwargs) -> tuple[Callable, str, str]:
        """Return (function, 'kernel'|'reference', reason)."""
        if self.kernel is None:
            return self.reference, "reference", "no kernel yet"
        if not kernels_enabled():
            return self.reference, "reference", "MLX_LILY_KERNELS=0"
        if gpu_backend() is None:
            return self.reference, "reference", "no GPU"
        ok, why = self.kernel.ready()
        if not ok:
            return self.reference, "reference", why
        if self.supports is not None:
            why_not = self.supports(*args, **kwargs)
            if why_not is not None:
                return self.reference, "reference", why_not
        return self.kernel, "kernel", why

    def __call__(self, *args, **kwargs):
        fn, path, reason = self.choose(*args, **kwargs)
        self.last_path, self.last_reason = path, reason
        return fn(*args, **kwargs)

    def planned_path(self) -> tuple[str, str]:
        """The path this op takes for shapes it supports, without running it."""
        if self.kernel is None:
            return "reference", "no kernel yet"
        if not kernels_enabled():
            return "reference", "MLX_LILY_KERNELS=0"
        if gpu_backend() is None:
            return "reference", "no GPU (the reference runs on the CPU)"
        ok, why = self.kernel.ready()
        return ("kernel" if ok else "reference"), why


OPS: Dict[str, LilyOp] = {}


def register(op: LilyOp) -> LilyOp:
    if op.name in OPS:
        raise ValueError(f"lily op {op.name!r} registered twice")
    OPS[op.name] = op
    return op
