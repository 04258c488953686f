"""Full attention: q/k RMSNorm + partial RoPE, and GQA scaled dot-product attention."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..toolchain.registry import LilyOp, register


def qk_norm_rope_reference(q, k, q_weight, k_weight, eps, rope, offset):
    """q [B, L, Hq, D], k [B, L, Hkv, D] -> normed, rotated, as [B, H, L, D]."""
    q = mx.fast.rms_norm(q, q_weight, eps).transpose(0, 2, 1, 3)
    k = mx.fast.rms_norm(k, k_weight, eps).transpose(0, 2, 1, 3)
    return rope(q, offset=offset), rope(k, offset=offset)


def attention_reference(q, k, v, scale, mask):
    """q [B, Hq, L, D], k/v [B, Hkv, S, D] -> [B, Hq, L, D]."""
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def _sample_norm_rope():
    keys = mx.random.split(mx.random.key(7), 2)
    q = mx.random.normal((1, 3, 4, 32), key=keys[0]).astype(mx.bfloat16)
    k = mx.random.normal((1, 3, 2, 32), key=keys[1]).astype(mx.bfloat16)
    return (q, k, mx.ones((32,)), mx.ones((32,)), 1e-6, nn.RoPE(8, base=1e7), 5), {}


def _sample_attention():
    keys = mx.random.split(mx.random.key(8), 3)
    q = mx.random.normal((1, 4, 1, 32), key=keys[0]).astype(mx.bfloat16)
    k = mx.random.normal((1, 2, 9, 32), key=keys[1]).astype(mx.bfloat16)
    v = mx.random.normal((1, 2, 9, 32), key=keys[2]).astype(mx.bfloat16)
    return (q, k, v, 32**-0.5, None), {}


qk_norm_rope = register(
    LilyOp("qk_norm_rope", qk_norm_rope_reference, description="q/k RMSNorm + partial RoPE")
)
qk_norm_rope.sample = _sample_norm_rope

attention = register(
    LilyOp("attention", attention_reference, description="GQA scaled dot-product attention")
)
attention.sample = _sample_attention
