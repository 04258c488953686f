"""MoE router: softmax over all experts, top-k, optional renormalisation.

The reference is stock mlx-lm's routing, step for step (precise softmax,
argpartition, gather, renormalise in the activation dtype), so that the
reference path reproduces stock logits exactly. The kernel (when present)
computes the softmax in fp32 with a lowest-index tie-break for equal scores.
"""

from __future__ import annotations

import mlx.core as mx

from .registry import LilyOp, register


def router_topk_reference(logits: mx.array, k: int, normalize: bool):
    """logits [..., E] -> (indices [..., k] uint32, weights [..., k])."""
    gates = mx.softmax(logits, axis=-1, precise=True)
    inds = mx.stop_gradient(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:])
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if normalize:
        scores = scores / scores.sum(axis=-1, keepdims=True)
    return inds, scores


def _sample():
    logits = mx.random.normal((6, 64), key=mx.random.key(0)).astype(mx.bfloat16)
    return (logits, 8, True), {}


router_topk = register(
    LilyOp(
        "router_topk",
        router_topk_reference,
        description="MoE router: softmax + top-k + renormalise",
    )
)
router_topk.sample = _sample
