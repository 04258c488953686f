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


def decode_request(n, Hq, Hkv, D, dtype=mx.bfloat16, seed=0):
    """One request's decode step: its query [1, Hq, 1, D] and its n keys and
    values [1, Hkv, n, D] (keys twice as spread, so scores vary)."""
    rng = np.random.default_rng(seed)
    normal = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    return (normal(1, Hq, 1, D).astype(dtype), (2 * normal(1, Hkv, n, D)).astype(dtype),
            normal(1, Hkv, n, D).astype(dtype))


def batch_decode_inputs(requests, starts, capacity, per_row_ends=False, spare=3, filler=64.0):
    """A left-padded batch cache, as mlx-lm's BatchKVCache hands it over:
    row b holds ``requests[b]`` (``decode_request``'s triples) at
    [starts[b], starts[b] + n_b) of a view of ``capacity`` rows (of a buffer
    ``spare`` rows longer); every other row holds ``filler``, large, so a
    kernel that reads one shows it. Returns (q, k, v, scale, None) and
    kwargs {length, start}: ``length`` [B] with ``per_row_ends``, else [1]
    (then every row must end at the same place, as BatchKVCache's do)."""
    B = len(requests)
    _, Hkv, _, D = requests[0][1].shape
    ends = [s + r[1].shape[2] for s, r in zip(starts, requests)]
    if not per_row_ends and len(set(ends)) != 1:
        raise ValueError(f"a shared end needs every row to end at one place, not {ends}")
    if max(ends) > capacity or min(starts) < 0:
        raise ValueError(f"rows {list(zip(starts, ends))} do not fit {capacity} rows")

    def place(which):
        rows = []
        for s, e, r in zip(starts, ends, requests):
            full = capacity + spare
            pad = lambda m: mx.full((1, Hkv, m, D), filler, dtype=r[which].dtype)  # noqa: E731
            rows.append(mx.concatenate([pad(s), r[which], pad(full - e)], axis=2) if full > e - s else r[which])
        return mx.concatenate(rows, axis=0)[:, :, :capacity, :]

    q = mx.concatenate([r[0] for r in requests], axis=0)
    length = mx.array(ends if per_row_ends else ends[:1], dtype=mx.int32)
    start = mx.array(starts, dtype=mx.int32)
    return (q, place(1), place(2), D**-0.5, None), {"length": length, "start": start}


def output_gate(B, L, Hq, D, dtype=mx.bfloat16, seed=14):
    """The layer's output gate for B rows of L queries, as ``attention_heads``
    hands it over: [B, L, Hq, D], the second half of each head's row of a [B,
    L, Hq, 2 D] projection (a strided view, as the model's)."""
    both = 3 * mx.random.normal((B, L, Hq, 2 * D), key=mx.random.key(seed))
    return mx.split(both.astype(dtype), 2, axis=-1)[1]


def prefill_check_inputs(L, S, Hq=4, Hkv=2, D=64, seed=10):
    """L queries against the first S rows of a longer cache."""
    keys = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((1, Hq, L, D), key=keys[0]).astype(mx.bfloat16)
    k = mx.random.normal((1, Hkv, S + 3, D), key=keys[1]).astype(mx.bfloat16)[:, :, :S, :]
    v = mx.random.normal((1, Hkv, S + 3, D), key=keys[2]).astype(mx.bfloat16)[:, :, :S, :]
    return q, k, v, D**-0.5, "causal"


def decode_check_inputs(S, Hq=4, Hkv=2, D=64, seed=9):
    """A decode call on a strided view: the first S rows of a longer cache."""
    keys = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((1, Hq, 1, D), key=keys[0]).astype(mx.bfloat16)
    k = mx.random.normal((1, Hkv, S + 5, D), key=keys[1]).astype(mx.bfloat16)[:, :, :S, :]
    v = mx.random.normal((1, Hkv, S + 5, D), key=keys[2]).astype(mx.bfloat16)[:, :, :S, :]
    return q, k, v, D**-0.5, None


def bounded_check_inputs(length, capacity, Hq=4, Hkv=2, D=64, seed=11):
    """A decode call on a whole cache of ``capacity`` rows filled to
    ``length``; the rows past it are large, so reading one shows."""
    q, k, v, scale, _ = decode_check_inputs(capacity, Hq, Hkv, D, seed)
    past = mx.arange(capacity)[None, None, :, None] >= length
    k, v = mx.where(past, 64.0, k).astype(mx.bfloat16), mx.where(past, 64.0, v).astype(mx.bfloat16)
    return q, k, v, scale, None, mx.array([length], dtype=mx.int32)


def sample_attention():
    # A decode step on a strided KV view (the first 9 rows of a 14-row cache),
    # as mlx-lm's KVCache passes it: the decode kernel's single pass.
    return decode_check_inputs(9, Hq=4, Hkv=2, D=64, seed=8), {}


def fuzz_attention(rng):
    """A random call a kernel takes: decode or a causal/unmasked prefill chunk,
    GQA 1/3/8, head dims 32-128, K/V a strided view of a longer cache; decode
    calls in bf16 or fp16 (prefill: bf16); some with the layer's output gate."""
    hkv = int(rng.integers(1, 3))
    hq = hkv * int(rng.choice([1, 3, 8]))
    D = int(rng.choice([32, 64, 128]))
    kwargs = {}
    if rng.random() < 0.5:
        L, S, mask = 1, int(rng.integers(1, 300)), None
        if rng.random() < 0.3:  # a cache of fixed capacity, filled part way
            kwargs["length"] = mx.array([int(rng.integers(1, S + 1))], dtype=mx.int32)
    else:
        L = int(rng.integers(1, 70))
        S = L + int(rng.integers(0, 100))
        mask = "causal" if rng.random() < 0.7 else None
    spare = int(rng.integers(0, 9))
    dtype = mx.float16 if L == 1 and rng.random() < 0.5 else mx.bfloat16
    normal = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)  # noqa: E731
    q = normal(1, hq, L, D)
    k = normal(1, hkv, S + spare, D)[:, :, :S, :]
    v = normal(1, hkv, S + spare, D)[:, :, :S, :]
    if rng.random() < 0.4:
        kwargs["gate"] = mx.split(2 * normal(1, L, hq, 2 * D), 2, axis=-1)[1]
    return (q, k, v, D**-0.5, mask), kwargs
