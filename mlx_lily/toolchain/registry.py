"""Lily ops: one name, a pure-MLX reference, and optionally a custom kernel.

Every piece of math in lily's layers goes through a :class:`LilyOp`, which
decides per call whether its kernel or its reference (the ground truth in
tests, and what runs on a CPU) runs. ``MLX_LILY_KERNEL_BACKEND`` picks the
kernel backend (``auto``, ``emulator``, ``reference``, ``metal``, ``cuda``);
``MLX_LILY_KERNELS=0`` forces the reference everywhere. Every decision is
recorded per op for ``python -m mlx_lily doctor``.

When the kernel runs, and what each backend setting means:
docs/kernel-notes.md#registry.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Protocol

import mlx.core as mx

from .._notice import notice_once


class KernelLike(Protocol):
    """What an op needs from a built kernel (see ``toolchain/kernel.py``)."""

    def ready_on(self, backend: str) -> tuple[bool, str]:
        """(usable on ``backend``, why not / which backend).

        Builds and self-checks the kernel the first time per backend and process.
        """

    def run_on(self, backend: str, *args, **kwargs): ...

    # Optional: run_checked(backend, *args, **kwargs) -> (result, None), or
    # (the reference's result, why not) when this call's instantiation of the
    # kernel failed its first-use check (see ``toolchain/kernel.py``).


BACKEND_ENV = "MLX_LILY_KERNEL_BACKEND"
BACKEND_CHOICES = ("auto", "metal", "cuda", "emulator", "reference")


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


def kernel_backend() -> tuple[Optional[str], str]:
    """('metal' | 'cuda' | 'emulator', why) where kernels run, or (None, why not).

    Read on every call (two environment look-ups), so that tests and users can
    switch backends within a process.
    """
    if not kernels_enabled():
        return None, "MLX_LILY_KERNELS=0"
    wanted = os.environ.get(BACKEND_ENV, "auto").strip().lower() or "auto"
    if wanted not in BACKEND_CHOICES:
        why = f"{BACKEND_ENV}={wanted!r} is not one of {', '.join(BACKEND_CHOICES)}"
        notice_once(f"backend-env:{wanted}", f"{why}; lily's ops run their references")
        return None, why
    if wanted == "reference":
        return None, f"{BACKEND_ENV}=reference"
    if wanted == "emulator":
        return "emulator", f"{BACKEND_ENV}=emulator (kernels run in the CPU emulator)"
    gpu = gpu_backend()
    if gpu is None:
        return None, "no GPU"
    if wanted != "auto" and wanted != gpu:
        return None, f"{BACKEND_ENV}={wanted} but the default device runs {gpu}"
    return gpu, gpu


@dataclass
class LilyOp:
    name: str
    reference: Callable
    kernel: Optional[KernelLike] = None
    # supports(*args, **kwargs) -> None when the kernel takes this call, else
    # a short reason why not (shape, dtype, quantization ...).
    supports: Optional[Callable[..., Optional[str]]] = None
    # prefers_reference(backend, *args, **kwargs) -> None, or why this call,
    # which the kernel does take, runs the reference on this backend anyway
    # (measured faster there). A choice, not a limit: bench times both.
    prefers_reference: Optional[Callable[..., Optional[str]]] = None
    description: str = ""
    # sample() -> (args, kwargs): small inputs for doctor and the test suite.
    sample: Optional[Callable[[], tuple]] = None
    # compare(got, want) -> (acceptable, error size): how doctor judges a
    # kernel's result against the reference's, for ops whose outputs are not
    # comparable element by element (None: the largest absolute difference).
    compare: Optional[Callable[..., tuple]] = None
    # fuzz(rng: numpy Generator) -> (args, kwargs): a random call the kernel
    # supports (shapes and dtypes drawn from rng), for tests/test_fuzz_kernels.py.
    fuzz: Optional[Callable[..., tuple]] = None
    # False for an op the model never calls (a stand-alone proof or benchmark
    # of a kernel layer) or calls only on some GPUs by default (the tile GEMV:
    # CUDA), so checks of "every op ran" in the emulator can leave it out.
    in_model: bool = True
    last_path: Optional[str] = field(default=None, compare=False)
    last_reason: Optional[str] = field(default=None, compare=False)

    def choose(self, *args, **kwargs) -> tuple[Callable, str, str]:
        """Return (function, 'kernel'|'reference', reason)."""
        if self.kernel is None:
            return self.reference, "reference", "no kernel yet"
        backend, why = kernel_backend()
        if backend is None:
            return self.reference, "reference", why
        ok, why = self.kernel.ready_on(backend)
        if not ok:
            return self.reference, "reference", why
        if self.supports is not None:
            why_not = self.supports(*args, **kwargs)
            if why_not is not None:
                return self.reference, "reference", why_not
        if self.prefers_reference is not None:
            why_not = self.prefers_reference(backend, *args, **kwargs)
            if why_not is not None:
                return self.reference, "reference", why_not
        # Bound to the backend just read: one environment look-up per call.
        return functools.partial(self._run_kernel, backend), "kernel", why

    def _run_kernel(self, backend: str, *args, **kwargs):
        run_checked = getattr(self.kernel, "run_checked", None)
        if run_checked is None:
            return self.kernel.run_on(backend, *args, **kwargs)
        result, why_not = run_checked(backend, *args, **kwargs)
        if why_not is not None:
            self.last_path, self.last_reason = "reference", why_not
        return result

    def __call__(self, *args, **kwargs):
        fn, path, reason = self.choose(*args, **kwargs)
        self.last_path, self.last_reason = path, reason
        return fn(*args, **kwargs)

    def planned_path(self) -> tuple[str, str]:
        """The path this op takes for shapes it supports, without running it."""
        if self.kernel is None:
            return "reference", "no kernel yet"
        backend, why = kernel_backend()
        if backend is None:
            if why == "no GPU":
                why = "no GPU (the reference runs on the CPU)"
            return "reference", why
        ok, why = self.kernel.ready_on(backend)
        return ("kernel" if ok else "reference"), why


OPS: Dict[str, LilyOp] = {}


def register(op: LilyOp) -> LilyOp:
    if op.name in OPS:
        raise ValueError(f"lily op {op.name!r} registered twice")
    OPS[op.name] = op
    return op
