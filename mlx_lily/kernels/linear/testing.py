"""Inputs for the linear ops' self-checks, fuzz, tests and bench:
random arrays at given shapes, as the model would pass them."""

from __future__ import annotations

from typing import Sequence

import mlx.core as mx
import numpy as np

from .gemv import GROUP_SIZE


def gemv_weights(K: int, rows: Sequence[int], bits: Sequence[int], rng=None, seed=0, dtype=mx.bfloat16):
    """Quantized projections (w, scales, biases) [N, K] at these bits, group 64,
    as ``nn.QuantizedLinear`` would hold them (scales and biases in ``dtype``)."""
    rng = np.random.default_rng(seed) if rng is None else rng
    out = []
    for n, b in zip(rows, bits):
        dense = mx.array((rng.standard_normal((n, K)) * K**-0.5).astype(np.float32)).astype(dtype)
        out.append(tuple(mx.quantize(dense, group_size=GROUP_SIZE, bits=b)))
    return tuple(out)


def gemv_call(K, rows, bits, prologue="none", residual=False, norm_dtype=None, rng=None, seed=0,
              dtype=mx.bfloat16, batch=1):
    """A call at these shapes: (args, kwargs), x [batch, 1, K]. prologue
    'none', 'norm' or 'gate' (a strided [batch, 1, G, D] view: the second
    half of each of G rows of a [batch, 1, G, 2D] tensor); activations, scales
    and biases in ``dtype``, the norm weight in ``norm_dtype`` (default:
    ``dtype``)."""
    rng = np.random.default_rng(seed) if rng is None else rng
    normal = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    norm_dtype = dtype if norm_dtype is None else norm_dtype
    x = normal(batch, 1, K).astype(dtype)
    weights = gemv_weights(K, rows, bits, rng=rng, dtype=dtype)
    kwargs = {}
    if prologue == "norm":
        kwargs["norm_weight"] = (1 + 0.2 * normal(K)).astype(norm_dtype)
        kwargs["eps"] = 1e-6
    elif prologue == "gate":
        heads = [g for g in (1, 2, 3, 5, 8) if K % g == 0 and (K // g) % 2 == 0]
        G = heads[int(rng.integers(len(heads)))]
        D = K // G
        both = (2 * normal(batch, 1, G, 2 * D)).astype(dtype)
        kwargs["gate"] = mx.split(both, 2, axis=-1)[1]
    if residual:
        kwargs["residual"] = normal(batch, 1, rows[0]).astype(dtype)
    return (x, weights), kwargs
