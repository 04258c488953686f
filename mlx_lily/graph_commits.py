"""How often MLX's CUDA backend commits its graph of queued kernels.

MLX on CUDA records the kernels an evaluation launches into a CUDA graph and
commits (updates and launches) it every ``MLX_MAX_OPS_PER_BUFFER`` kernels
(100 on the H200) or every ``MLX_MAX_MB_PER_BUFFER`` MB of kernel inputs
(1000), whichever comes first. It counts each input array whole. A MoE launch
is given every expert's weights (about 400 MB per layer at Qwen3.6-35B-A3B's
shapes), of which a decode token reads 8 of 256, so a token of about 300
kernels committed about 17 times instead of 3; each commit costs the host
about 13 us (``python -m bench.diagnostics.launch_cost --input-mb 256,512``,
H200). On CUDA, lily raises the byte bound to ``RELAXED_MB`` so that the op
bound decides.

MLX reads the variable once, when the process first uses the GPU. Lily sets
it when ``mlx_lily`` is imported, which mlx-lm's commands with ``--backend
lily`` do before they load a model; a program that used the GPU before it
imported mlx_lily keeps MLX's bound. A value the user set is kept:
``MLX_MAX_MB_PER_BUFFER=1000`` restores MLX's default. Metal is left alone
(its bound sizes command buffers, and nothing was measured there).
"""

from __future__ import annotations

import os
from typing import Optional

import mlx.core as mx

BYTES_ENV = "MLX_MAX_MB_PER_BUFFER"
RELAXED_MB = 1 << 20  # 1 TB: never reached, so the op bound decides
_set_by_lily = False


def _cuda_build() -> bool:
    """Whether this MLX runs on CUDA, asked without touching a device."""
    cuda = getattr(mx, "cuda", None)
    return cuda is not None and cuda.is_available() and not mx.metal.is_available()


def relax_byte_bound() -> Optional[str]:
    """On CUDA, set ``MLX_MAX_MB_PER_BUFFER`` to ``RELAXED_MB`` unless it is
    set already; returns the value now set (None off CUDA)."""
    global _set_by_lily
    if not _cuda_build():
        return None
    if os.environ.get(BYTES_ENV) is None:
        os.environ[BYTES_ENV] = str(RELAXED_MB)
        _set_by_lily = True
    return os.environ[BYTES_ENV]


def describe() -> str:
    """One line for doctor and the bench: the byte bound and who set it."""
    value = os.environ.get(BYTES_ENV)
    if not _cuda_build():
        return "not CUDA: MLX's own command-buffer bounds"
    if value is None:
        return f"{BYTES_ENV} unset: MLX's default (1000 MB of kernel inputs per graph commit)"
    who = "set by lily (MoE launches count every expert's weights)" if _set_by_lily else "set by the user"
    return f"{BYTES_ENV}={value}, {who}; MLX reads it at the process's first GPU use"
