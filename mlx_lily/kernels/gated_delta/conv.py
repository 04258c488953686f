"""Gated DeltaNet's causal depthwise convolution, SiLU, and (for prompt
chunks) the q/k L2 norm after it::

    conv_qk_norm(qkv, conv_state, conv_weight, Hk, Hv, Dk, Dv) -> (q, k, v)

The reference is the layer's own sequence (the concatenation, ``mx.conv1d``
+ ``nn.silu``, the split and ``normalize_qk``), so on the reference path the
layer stays stock's to the bit. The kernel (``conv_qk_norm.metal``) does it
in one dispatch, one SIMD group per (batch, token, head). The shapes, what
the kernel takes, and the contract (``conv_qk_norm_agree``):
docs/kernel-notes.md#conv-qk-norm.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from ...toolchain.contracts import elementwise_mismatch, on_cpu

from ...toolchain.kernel import Kernel, Launch, SIMD_WIDTH
from ...toolchain.registry import LilyOp, register
from ..dtypes import ACTIVATION_DTYPES, activation_dtype_reason, step_scale
from .recurrence import l2norm_qk_reference

# The stock L2 norm's epsilon (added to sum(x^2)), as the layer passes it.
L2_EPS = 1e-6
# SIMD groups per threadgroup: the rows are independent, this only sizes the launch.
SIMD_GROUPS = 8
MAX_HEAD_DIM = 256
# The body indexes with 32-bit unsigned integers.
MAX_ELEMENTS = 2**31


def conv1d_silu_reference(x: mx.array, weight: mx.array) -> mx.array:
    """x [B, K-1+S, C] (conv state then new rows), weight [C, K, 1] -> [B, S, C]."""
    return nn.silu(mx.conv1d(x, weight, groups=x.shape[-1]))


def conv_qk_norm_reference(qkv, conv_state, conv_weight, num_k_heads, num_v_heads, head_k_dim, head_v_dim):
    """The layer's sequence (module docstring) -> (q, k, v)."""
    B, T, _ = qkv.shape
    key_dim = num_k_heads * head_k_dim
    conv_out = conv1d_silu_reference(mx.concatenate([conv_state, qkv], axis=1), conv_weight)
    q, k, v = mx.split(conv_out, [key_dim, 2 * key_dim], axis=-1)
    q = q.reshape(B, T, num_k_heads, head_k_dim)
    k = k.reshape(B, T, num_k_heads, head_k_dim)
    v = v.reshape(B, T, num_v_heads, head_v_dim)
    q, k = l2norm_qk_reference(q, k, head_k_dim**-0.5, L2_EPS)
    return q, k, v


def conv_qk_norm_supports(qkv, conv_state, conv_weight, num_k_heads, num_v_heads, head_k_dim, head_v_dim) -> Optional[str]:
    """None when the kernel takes this call, else why not."""
    if qkv.ndim != 3 or conv_state is None or conv_state.ndim != 3:
        return f"qkv {tuple(qkv.shape)} (kernel: [B, T, C] with a conv state [B, K-1, C])"
    B, T, C = qkv.shape
    Hk, Hv, Dk, Dv = (int(n) for n in (num_k_heads, num_v_heads, head_k_dim, head_v_dim))
    if C != 2 * Hk * Dk + Hv * Dv or min(Hk, Hv, Dk, Dv, B, T) < 1:
        return f"qkv width {C} is not 2 x {Hk} x {Dk} + {Hv} x {Dv}"
    if Dk % SIMD_WIDTH or Dv % SIMD_WIDTH or max(Dk, Dv) > MAX_HEAD_DIM:
        return f"head dims {Dk}, {Dv} (kernel: multiples of {SIMD_WIDTH}, at most {MAX_HEAD_DIM})"
    K = conv_state.shape[1] + 1
    if tuple(conv_state.shape) != (B, K - 1, C) or tuple(conv_weight.shape) != (C, K, 1):
        return f"conv state {tuple(conv_state.shape)}, weight {tuple(conv_weight.shape)} (kernel: [B, K-1, C], [C, K, 1])"
    if qkv.dtype not in ACTIVATION_DTYPES:
        return activation_dtype_reason("qkv", qkv.dtype)
    for name, a in (("conv_state", conv_state), ("conv_weight", conv_weight)):
        if a.dtype != qkv.dtype:
            return f"{name} dtype {a.dtype} (kernel: qkv's, {qkv.dtype})"
    if B * (T + K) * C >= MAX_ELEMENTS:
        return "too large for 32-bit indexing"
    return None


def _launch(qkv, conv_state, conv_weight, num_k_heads, num_v_heads, head_k_dim, head_v_dim) -> Launch:
    B, T, _ = qkv.shape
    Hk, Hv, Dk, Dv = (int(n) for n in (num_k_heads, num_v_heads, head_k_dim, head_v_dim))
    inv_scale = Dk**-0.5
    rows = B * T * (2 * Hk + Hv)
    threads = SIMD_GROUPS * SIMD_WIDTH
    return Launch(
        inputs=[qkv, conv_state, conv_weight,
                mx.array([L2_EPS * inv_scale**2, inv_scale**2, inv_scale], dtype=mx.float32)],
        grid=(math.ceil(rows / SIMD_GROUPS) * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(B, T, Hk, Dk), (B, T, Hk, Dk), (B, T, Hv, Dv)],
        output_dtypes=[qkv.dtype] * 3,
        template=[("InT", qkv.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk), ("Hv", Hv),
                  ("CONV_K", conv_state.shape[1] + 1)],
        finish=tuple,
    )


def conv_qk_norm_agree(got, want, *args, **kwargs) -> Optional[str]:
    """None when the kernel's (q, k, v) meet the contract (module docstring),
    else which output is off and by how much. With the call's arguments the
    reference is evaluated on the CPU (``on_cpu``: MLX's CUDA ops round
    SiLU's bf16 steps otherwise); without them, ``want`` is used as given."""
    if args:
        want = on_cpu(conv_qk_norm_reference, *args, **kwargs)
    for name, g, w in zip("qkv", got, want):
        scale = step_scale(w.dtype)
        mismatch = elementwise_mismatch(g, w, rel=2.0**-5 * scale, of_max=2.0**-9 * scale)
        if mismatch is not None:
            return f"{name}: {mismatch}"
    return None


def _sample():
    from .testing import conv_qk_norm_call

    return conv_qk_norm_call(2, 5, 2, 4, 32, 32, seed=3)


def _fuzz(rng):
    """A random chunk: batch 1-2, 1-40 tokens (fewer than the taps too), value/key
    head ratio 1-3, head dims 32-128, conv widths 2-4, bf16 or fp16."""
    from .testing import conv_qk_norm_call

    Hk = int(rng.integers(1, 3))
    return conv_qk_norm_call(int(rng.integers(1, 3)), int(rng.integers(1, 41)), Hk, Hk * int(rng.integers(1, 4)),
                     int(rng.choice([32, 64, 128])), int(rng.choice([32, 64, 96])),
                     K=int(rng.choice([2, 3, 4])), rng=rng,
                     dtype=ACTIVATION_DTYPES[int(rng.integers(len(ACTIVATION_DTYPES)))])


conv_qk_norm_kernel = Kernel(
    name="conv_qk_norm",
    input_names=("qkv", "conv_state", "conv_weight", "scalars"),
    output_names=("q", "k", "v"),
    body=Path(__file__).with_name("conv_qk_norm.metal"),
    launch=_launch,
    reference=conv_qk_norm_reference,
    sample=_sample,
    agree=conv_qk_norm_agree,
)


conv_qk_norm = register(
    LilyOp(
        "conv_qk_norm",
        conv_qk_norm_reference,
        kernel=conv_qk_norm_kernel,
        supports=conv_qk_norm_supports,
        description="DeltaNet prologue: causal conv + SiLU, q/k L2 norm with the readout scale",
        sample=_sample,
        fuzz=_fuzz,
    )
)
