"""Inputs for the attention ops' self-checks, fuzz, tests and bench:
random arrays at given shapes, as the model would pass them."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np


def qk_norm_rope_inputs(B, L, Hq, Hkv, D, dims, offset=0, traditional=False, base=1e7, scale=1.0,
                dtype=mx.bfloat16, weight_dtype=None, gated=True, rng=None, seed=0):
    """A call at these shapes. ``gated``: q is the layer's view, the first half
    of each head of a [B, L, Hq, 2 D] projection (its other half the gate)."""
    rng = np.random.default_rng(seed) if rng is None else rng
    normal = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    if gated:
        q = mx.split((2 * normal(B, L, Hq, 2 * D)).astype(dtype), 2, axis=-1)[0]
    else:
        q = (2 * normal(B, L, Hq, D)).astype(dtype)
    k = (2 * normal(B, L, Hkv, D)).astype(dtype)
    weight_dtype = dtype if weight_dtype is None else weight_dtype
    q_weight = (1 + 0.2 * normal(D)).astype(weight_dtype)
    k_weight = (1 + 0.2 * normal(D)).astype(weight_dtype)
    rope = nn.RoPE(dims, traditional=traditional, base=base, scale=scale)
    return (q, k, q_weight, k_weight, 1e-6, rope, offset), {}
