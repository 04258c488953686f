"""Sparse MoE: the routed experts (gate+up, SwiGLU, down) and the combine step."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import SwitchGLU

from ..toolchain.registry import LilyOp, register


def moe_experts_reference(x: mx.array, inds: mx.array, experts: SwitchGLU) -> mx.array:
    """x [..., D], inds [..., k] -> each chosen expert's output [..., k, D]."""
    return experts(x, inds)


def moe_combine_reference(y, scores, shared_y, shared_gate_logit):
    """sum_k scores_k * y_k + sigmoid(shared gate) * shared expert."""
    routed = (y * scores[..., None]).sum(axis=-2)
    return routed + mx.sigmoid(shared_gate_logit) * shared_y


def _sample_experts():
    experts = SwitchGLU(64, 64, 8)
    nn.quantize(experts, group_size=64, bits=4)
    x = mx.random.normal((3, 64), key=mx.random.key(9)).astype(mx.bfloat16)
    inds = mx.array([[0, 3], [7, 1], [2, 2]], dtype=mx.uint32)
    return (x, inds, experts), {}


def _sample_combine():
    keys = mx.random.split(mx.random.key(10), 4)
    y = mx.random.normal((3, 2, 16), key=keys[0]).astype(mx.bfloat16)
    s = mx.softmax(mx.random.normal((3, 2), key=keys[1]), axis=-1).astype(mx.bfloat16)
    sy = mx.random.normal((3, 16), key=keys[2]).astype(mx.bfloat16)
    sg = mx.random.normal((3, 1), key=keys[3]).astype(mx.bfloat16)
    return (y, s, sy, sg), {}


moe_experts = register(
    LilyOp("moe_experts", moe_experts_reference, description="routed experts: gate+up, SwiGLU, down")
)
moe_experts.sample = _sample_experts

moe_combine = register(
    LilyOp("moe_combine", moe_combine_reference, description="routing weights + shared expert")
)
moe_combine.sample = _sample_combine
