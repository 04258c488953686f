"""Exceptions raised by the Metal kernel emulator."""

from __future__ import annotations

from typing import Optional


class EmulatorError(RuntimeError):
    """Base class: a kernel could not be compiled or did something Metal
    leaves undefined (deadlock, out-of-bounds access, ...)."""

    def __init__(self, message: str, kernel: Optional[str] = None):
        super().__init__(message)
        self.kernel = kernel


class KernelCompileError(EmulatorError):
    """The kernel body did not compile; the message holds the compiler's
    diagnostics, with line numbers of the body (``source:LINE``) or header
    (``header:LINE``)."""

    def __init__(self, message: str, kernel: Optional[str] = None,
                 compiler_output: str = ""):
        super().__init__(message, kernel)
        self.compiler_output = compiler_output


class KernelDeadlock(EmulatorError):
    """Threads wait at a barrier or SIMD-group collective that some threads
    of their group can never reach (they returned, or wait elsewhere)."""


class KernelOutOfBounds(EmulatorError, IndexError):
    """A thread accessed a buffer or threadgroup array outside its bounds."""


class KernelTimeout(EmulatorError):
    """The launch ran longer than MLX_LILY_EMULATOR_TIMEOUT seconds."""


class KernelRuntimeError(EmulatorError):
    """Any other failure while running a kernel (e.g. threadgroup memory
    over Metal's 32 KiB)."""
