"""Gated DeltaNet's causal depthwise convolution followed by SiLU."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from ..toolchain.registry import LilyOp, register


def conv1d_silu_reference(x: mx.array, weight: mx.array) -> mx.array:
    """x [B, K-1+S, C] (conv state then new rows), weight [C, K, 1] -> [B, S, C]."""
    return nn.silu(mx.conv1d(x, weight, groups=x.shape[-1]))


def _sample():
    x = mx.random.normal((1, 3 + 5, 48), key=mx.random.key(1)).astype(mx.bfloat16)
    w = mx.random.normal((48, 4, 1), key=mx.random.key(2)).astype(mx.bfloat16)
    return (x, w), {}


conv1d_silu = register(
    LilyOp("conv1d_silu", conv1d_silu_reference, description="depthwise causal conv + SiLU")
)
conv1d_silu.sample = _sample
