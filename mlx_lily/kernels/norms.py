"""Gated RMSNorm: the norm that closes each Gated DeltaNet layer."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.activations import precise_swiglu

from ..toolchain.registry import LilyOp, register


def gated_rms_norm_reference(x: mx.array, z: mx.array, weight: mx.array, eps: float):
    """rms_norm(x) * weight * silu(z), the product taken in fp32."""
    return precise_swiglu(x, z, mx.fast.rms_norm(x, weight, eps))


def _sample():
    keys = mx.random.split(mx.random.key(6), 3)
    x = mx.random.normal((1, 3, 4, 32), key=keys[0]).astype(mx.bfloat16)
    z = mx.random.normal((1, 3, 4, 32), key=keys[1]).astype(mx.bfloat16)
    w = 1 + 0.1 * mx.random.normal((32,), key=keys[2])
    return (x, z, w, 1e-6), {}


gated_rms_norm = register(
    LilyOp("gated_rms_norm", gated_rms_norm_reference, description="RMSNorm * SiLU(gate)")
)
gated_rms_norm.sample = _sample
