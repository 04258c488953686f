"""A CPU emulator for MLX custom Metal kernels.

``metal_kernel`` is a drop-in for ``mx.fast.metal_kernel``: it takes the
same kernel body (Metal Shading Language, the form MLX accepts), generates
the same signature MLX would (builtin attributes detected by name,
``name_shape``/``name_strides``/``name_ndim`` parameters, template
arguments), compiles it with the system C++ compiler against a prelude that
gives Metal's names C++ meaning, and runs it on the CPU with Metal's
semantics. Compiled kernels are cached on disk (``$MLX_LILY_CACHE`` or
``~/.cache/mlx_lily/emulator``); ``$CXX`` picks the compiler (default
``g++``). The returned arrays are already evaluated; ``stream`` is ignored.

**Execution model.** The grid is tiled into threadgroups exactly as
``dispatchThreads`` does, with MLX's clamping of the threadgroup to the grid.
Edge threadgroups are clipped to the grid: there ``threads_per_threadgroup``
is the clipped size and ``dispatch_threads_per_threadgroup`` the requested
one (Metal has the second attribute for exactly this difference), and
threads are numbered within the clipped shape. Threadgroups run one after
another in a fixed order (x fastest). The threads of a threadgroup run as
cooperatively scheduled fibers on one OS thread: each runs until it returns
or reaches a synchronisation point, then the next one runs. Threads are
linearised x-fastest and form SIMD-groups of 32 consecutive threads. ``threadgroup``
variables declared in the body are rewritten to storage shared by the
threadgroup, fresh for every threadgroup and poisoned (all bits set: NaN
for floats, -1 for integers); outputs without ``init_value`` are poisoned
the same way. Everything is deterministic: same inputs, same bits.

**Rendezvous.** ``threadgroup_barrier`` releases when every thread of the
threadgroup waits at the same barrier; ``simdgroup_barrier`` likewise for
the lanes of a SIMD-group. SIMD-group functions (``simd_sum``,
``simd_shuffle_xor``, ``simd_ballot``, ``simdgroup_load``,
``simdgroup_multiply_accumulate``, ...) are collectives: each lane posts its
operand and waits; when every lane that has not exited waits at the same
call, the operation runs once for all lanes (in lockstep, as on the GPU),
and they resume with their results. ``simd_sum``/``simd_product`` reduce
with an ascending xor butterfly; scans run in lane order; reading a lane
that has exited gives the poison value.

**Deadlocks.** When no thread can run and no barrier or collective can
complete, the launch stops with ``KernelDeadlock``, naming the kernel, the
threadgroup, the threads (``thread_position_in_threadgroup``) grouped by
where they wait, with the source line of each barrier/collective, and the
threads that returned without reaching it. This catches early returns
before a barrier and barriers or collectives in divergent branches. A
launch running longer than ``$MLX_LILY_EMULATOR_TIMEOUT`` seconds (default
60; atomics let other threads run so spin-waits are caught) raises
``KernelTimeout``.

**Bounds checks.** Every ``device``/``constant``/``threadgroup`` pointer in
the kernel is rewritten to a checked pointer carrying the byte range of the
buffer it came from; pointer arithmetic is free, each dereference is
compared against the range. An access outside raises ``KernelOutOfBounds``
naming the kernel, the buffer (or threadgroup array), the index, the thread
and the source line (recorded through ``__builtin_LINE()`` in the implicit
conversion of the index; ``#line`` directives make lines refer to the body).
Addresses taken with ``&x[i]`` and thread-private arrays are not checked;
a crash through them (or an integer division by zero, or a stack overflow
past 256 KiB per thread) is caught while the kernel runs and raised as
``KernelRuntimeError``. A body that does not compile raises
``KernelCompileError`` with the compiler's diagnostics
(``source:LINE``/``header:LINE``).

**Not emulated.** Multi-component swizzles (``v.xy``), matrix types
(``float4x4``), textures and samplers, complex64; ``c ? half_value :
float_value`` (ambiguous for the C++ half class); data races between threads
(only visible through poison); divergent SIMD-group code that reconverges
before a collective (lanes must reach the same collective, which real
hardware would run under a mask); float results that depend on the GPU's
math library (the host's libm is used, deterministically).
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
