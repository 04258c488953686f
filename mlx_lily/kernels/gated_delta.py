"""Gated DeltaNet: q/k L2 normalisation and the gated delta-rule recurrence.

Per value head h, with state S (Dv x Dk, fp32) and gates g = exp(-exp(A_log) *
softplus(a + dt_bias)), beta = sigmoid(b):

    S   <- g * S
    d   <- (v - S k) * beta
    S   <- S + d k^T
    y   <- S q

The reference is mlx-lm's own `gated_delta_update` (its per-token loop on a
CPU or CUDA, its Metal kernel on Apple GPUs), so the reference path is stock.
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

from .registry import LilyOp, register


def l2norm_qk_reference(q: mx.array, k: mx.array, inv_scale: float, eps: float = 1e-6):
    return normalize_qk(q, k, inv_scale=inv_scale, eps=eps)


def gated_delta_reference(q, k, v, a, b, A_log, dt_bias, state=None):
    """q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; a, b [B, T, Hv] -> (y, state)."""
    return gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, None)


def _sample_qk():
    q = mx.random.normal((1, 4, 2, 32), key=mx.random.key(3)).astype(mx.bfloat16)
    k = mx.random.normal((1, 4, 2, 32), key=mx.random.key(4)).astype(mx.bfloat16)
    return (q, k, 32**-0.5), {}


def _sample_recurrence():
    keys = mx.random.split(mx.random.key(5), 6)
    B, T, Hk, Hv, Dk, Dv = 1, 5, 2, 4, 32, 16
    q, k = mx.random.normal((2, B, T, Hk, Dk), key=keys[0]).astype(mx.bfloat16)
    q, k = normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
    v = mx.random.normal((B, T, Hv, Dv), key=keys[1]).astype(mx.bfloat16)
    a = mx.random.normal((B, T, Hv), key=keys[2]).astype(mx.bfloat16)
    b = mx.random.normal((B, T, Hv), key=keys[3]).astype(mx.bfloat16)
    A_log = mx.log(mx.random.uniform(1, 16, (Hv,), key=keys[4]))
    dt_bias = mx.ones((Hv,))
    state = 0.1 * mx.random.normal((B, Hv, Dv, Dk), key=keys[5])
    return (q, k, v, a, b, A_log, dt_bias, state), {}


l2norm_qk = register(
    LilyOp("l2norm_qk", l2norm_qk_reference, description="q/k L2 norm with readout scale")
)
l2norm_qk.sample = _sample_qk

gated_delta = register(
    LilyOp("gated_delta", gated_delta_reference, description="gated delta-rule recurrence")
)
gated_delta.sample = _sample_recurrence
