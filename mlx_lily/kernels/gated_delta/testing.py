"""Inputs for the gated delta ops' self-checks, fuzz, tests and bench:
random arrays at given shapes, as the model would pass them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


def conv_qk_norm_call(B, T, Hk, Hv, Dk, Dv, K=4, rng=None, seed=0, dtype=mx.bfloat16):
    """A prompt chunk's prologue call at these shapes: random activations,
    conv state and conv weights in ``dtype`` (as the model holds them)."""
    rng = np.random.default_rng(seed) if rng is None else rng
    normal = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    C = 2 * Hk * Dk + Hv * Dv
    qkv = normal(B, T, C).astype(dtype)
    conv_state = normal(B, K - 1, C).astype(dtype)
    conv_weight = (0.5 * normal(C, K, 1)).astype(dtype)
    return (qkv, conv_state, conv_weight, Hk, Hv, Dk, Dv), {}


def gated_rms_norm_call(shape, weight_dtype=mx.bfloat16, rng=None, seed=0, dtype=mx.bfloat16):
    """x, z of this shape (``dtype``), a weight near 1 (as trained norms are)."""
    rng = np.random.default_rng(seed) if rng is None else rng
    normal = lambda *s: mx.array(rng.standard_normal(s).astype(np.float32))  # noqa: E731
    x = normal(*shape).astype(dtype)
    z = (2 * normal(*shape)).astype(dtype)
    w = (1 + 0.1 * normal(shape[-1])).astype(weight_dtype)
    return (x, z, w, 1e-6), {}


def gated_delta_decode_inputs(Hk, Hv, Dk, Dv, K=4, with_state=True, rng=None, seed=0, dtype=mx.bfloat16,
                              B=1, mask=None):
    """A decode call at these shapes, ``B`` rows: random activations and conv
    state in ``dtype``, the model's parameter dtypes (fp32 A_log, dt_bias; the
    norm weight in ``dtype``). ``mask`` (B bools, False: a padding step)
    becomes the call's ``mask`` keyword, [B, 1]."""
    rng = np.random.default_rng(seed) if rng is None else rng
    normal = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    C = 2 * Hk * Dk + Hv * Dv
    qkv = normal(B, 1, C).astype(dtype)
    z = normal(B, 1, Hv, Dv).astype(dtype)
    a = normal(B, 1, Hv).astype(dtype)
    b = normal(B, 1, Hv).astype(dtype)
    conv_state = normal(B, K - 1, C).astype(dtype)
    conv_weight = (0.5 * normal(C, K, 1)).astype(dtype)
    A_log = mx.log(mx.array(rng.uniform(1, 16, (Hv,)).astype(np.float32)))
    dt_bias = mx.array(rng.uniform(0.5, 1.5, (Hv,)).astype(np.float32))
    state = 0.1 * normal(B, Hv, Dv, Dk) if with_state else None
    norm_weight = (1 + 0.1 * normal(Dv)).astype(dtype)
    kwargs = {} if mask is None else {"mask": mx.array(np.asarray(mask, dtype=bool).reshape(B, 1))}
    return (qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, state, norm_weight, 1e-6, Hk), kwargs


# The decode call's per-row arguments (qkv, z, a, b, conv_state, state), by position.
DECODE_ROW_ARGS = (0, 1, 2, 3, 4, 8)


def gated_delta_decode_rows(Hk, Hv, Dk, Dv, n, with_state=True, seed=0, dtype=mx.bfloat16):
    """n one-row decode calls sharing one layer's weights (seed's), each with
    its own activations, conv state and state: rows to assemble batches from."""
    shared, _ = gated_delta_decode_inputs(Hk, Hv, Dk, Dv, with_state=with_state, seed=seed, dtype=dtype)
    calls = []
    for r in range(n):
        own, _ = gated_delta_decode_inputs(Hk, Hv, Dk, Dv, with_state=with_state, seed=seed + 1 + r, dtype=dtype)
        args = list(shared)
        for i in DECODE_ROW_ARGS:
            args[i] = own[i]
        calls.append(tuple(args))
    return calls


def gated_delta_decode_batch(rows, mask=None):
    """One decode call whose rows are the given one-row calls' rows, in order;
    ``mask`` (one bool a row, False: a padding step) its ``mask`` keyword."""
    args = list(rows[0])
    for i in DECODE_ROW_ARGS:
        if args[i] is not None:
            args[i] = mx.concatenate([r[i] for r in rows], axis=0)
    kwargs = {} if mask is None else {"mask": mx.array(np.asarray(mask, dtype=bool).reshape(-1, 1))}
    return tuple(args), kwargs


def gated_delta_decode_steps_inputs(Hk, Hv, Dk, Dv, P, K=4, with_state=True, seed=0, dtype=mx.bfloat16):
    """P consecutive positions of one stream: the per-position inputs of P
    rows, the stream's one conv state and state."""
    args, _ = gated_delta_decode_inputs(Hk, Hv, Dk, Dv, K=K, with_state=with_state, seed=seed, dtype=dtype, B=P)
    args = list(args)
    args[4] = args[4][:1]
    if args[8] is not None:
        args[8] = args[8][:1]
    return tuple(args), {}
