"""Prefill attention on CUDA: which calls take MLX's fused sdpa, and with
their keys padded to a multiple of ``SDPA_KEY_MULTIPLE`` so that a query's
bits do not depend on the call it is part of (prefix reuse:
mlx_lily/prefill_cuts.py). The attention op (``sdpa.py``) asks here."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx


# On CUDA, MLX's scaled_dot_product_attention runs prefill as one fused
# tensor-core kernel, which the prefill kernel does not match yet (H200, head
# dim 256, 16 query / 2 KV heads: 2.77 against 1.27 ms for 2048 queries on 4K
# keys, 27.5 against 6.0 ms on 32K; 0.139 against 0.165 ms for 256 on 256).
# A straight line through those points crosses near 2^18 query-key pairs per
# head: from there CUDA calls take the reference. So do calls of
# CUDA_REFERENCE_QUERIES queries or more, whatever their keys: a query must get
# the same bits in any call of that size it may be part of (prefix reuse,
# mlx_lily/prefill_cuts.py), and the kernel's bits are not sdpa's. Metal's
# sdpa has no fused prefill path at head dim 256, so there the kernel takes
# every call.
CUDA_PREFILL_REFERENCE_FROM = 2**18
CUDA_REFERENCE_QUERIES = 64


def attention_prefers_reference(backend, q, k, v, scale, mask, length=None, start=None, gate=None) -> Optional[str]:
    """Why a call the kernels take runs MLX's sdpa on this backend, or None."""
    L, S = q.shape[2], k.shape[2]
    if backend == "cuda" and L > 1 and (L * S >= CUDA_PREFILL_REFERENCE_FROM or L >= CUDA_REFERENCE_QUERIES):
        return (f"{L} queries x {S} keys on CUDA: MLX's fused sdpa (faster from "
                f"{CUDA_PREFILL_REFERENCE_FROM} pairs; every call from {CUDA_REFERENCE_QUERIES} queries)")
    return None


# On CUDA, MLX's sdpa gives a query the same bits in every causal call whose
# keys are a multiple of this many, whatever the call's first query or its
# length from 64 queries on, and other bits when they are not (H200,
# bench/diagnostics/prefill/sdpa_rows.py): prefix reuse needs the former.
SDPA_KEY_MULTIPLE = 8


def causal_with_aligned_keys(q, k, v, scale) -> mx.array:
    """MLX's causal sdpa with queries and keys padded by the same zero rows at
    the end up to a multiple of SDPA_KEY_MULTIPLE keys: the causal diagonal
    (bottom right) keeps each real query on its own keys, and only the
    padding queries, dropped after, see the padding keys."""
    L, S = q.shape[2], k.shape[2]
    pad = -S % SDPA_KEY_MULTIPLE
    if pad:
        def grow(x):
            return mx.concatenate([x, mx.zeros((*x.shape[:2], pad, x.shape[3]), x.dtype)], axis=2)

        q, k, v = grow(q), grow(k), grow(v)
    out = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")
    return out[:, :, :L] if pad else out
