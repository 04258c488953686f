"""A CPU emulator for MLX custom Metal kernels.

``metal_kernel`` is a drop-in for ``mx.fast.metal_kernel``: it takes the same
kernel body, generates the signature MLX would, compiles it with the system
C++ compiler (``$CXX``, default ``g++``; cached in ``$MLX_LILY_CACHE`` or
``~/.cache/mlx_lily/emulator``) and runs it on the CPU with Metal's
semantics, reporting deadlocks, out-of-bounds accesses and runtime errors
with the threads and source lines involved.

Design notes (execution model, rendezvous, deadlocks, bounds checks, what is
not emulated): docs/kernel-notes.md#emulator.
"""

from .errors import (
    EmulatorError,
    KernelCompileError,
    KernelDeadlock,
    KernelOutOfBounds,
    KernelRuntimeError,
    KernelTimeout,
)
from .runner import EmulatedKernel, metal_kernel

__all__ = [
    "metal_kernel",
    "EmulatedKernel",
    "EmulatorError",
    "KernelCompileError",
    "KernelDeadlock",
    "KernelOutOfBounds",
    "KernelRuntimeError",
    "KernelTimeout",
]
