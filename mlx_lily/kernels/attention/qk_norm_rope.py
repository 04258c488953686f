"""Full attention's prologue: q/k RMSNorm + partial RoPE, in one launch.

The reference is stock mlx-lm's op sequence (``mx.fast.rms_norm`` of q and
of k, the transposes to [B, H, L, D], the model's rope on each), so on the
reference path the layer stays stock's to the bit. The kernel
(``qk_norm_rope.metal``) computes both outputs in one dispatch, one SIMD
group per (batch, token, head) row; it takes a plain ``nn.RoPE``, and any
other rope class runs the reference.

The launch, the contract (``qk_norm_rope_agree``) with its reasoning, and
negative positions: docs/kernel-notes.md#qk-norm-rope.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ...toolchain.kernel import Kernel, Launch, SIMD_WIDTH
from ...toolchain.registry import LilyOp, register

KERNEL_DTYPES = (mx.bfloat16, mx.float16, mx.float32)
# The body keeps D / 32 values per lane; rms_norm over at most 256.
MAX_HEAD_DIM = 256
# SIMD groups (rows) per threadgroup.
ROWS_PER_GROUP = 4
# Output indices are 32-bit.
MAX_ELEMENTS = 2**31
INT32 = (-(2**31), 2**31 - 1)

# The inverse rms in fp32: the D squares summed in another order than the
# reference's, and rsqrt's last bits (what matters for fp32 outputs).
NORM_ERROR = 2.0**-18
# Metal's fast cos and sin (MLX's rope kernel there) are within 2^-13 of the
# exact values after range reduction; other implementations closer.
COS_SIN_ERROR = 2.0**-12
# Unit roundoff of each output dtype.
UNIT_ROUNDOFF = {mx.bfloat16: 2.0**-8, mx.float16: 2.0**-11, mx.float32: 2.0**-24}


def qk_norm_rope_reference(q, k, q_weight, k_weight, eps, rope, offset):
    """q [B, L, Hq, D], k [B, L, Hkv, D] -> normed, rotated, as [B, H, L, D]."""
    q = mx.fast.rms_norm(q, q_weight, eps).transpose(0, 2, 1, 3)
    k = mx.fast.rms_norm(k, k_weight, eps).transpose(0, 2, 1, 3)
    return rope(q, offset=offset), rope(k, offset=offset)


def qk_norm_rope_supports(q, k, q_weight, k_weight, eps, rope, offset) -> Optional[str]:
    """None when the kernel takes this call, else why not."""
    if type(rope) is not nn.RoPE:
        return f"rope {type(rope).__name__} (kernel: a plain nn.RoPE)"
    if q.ndim != 4 or k.ndim != 4:
        return f"ranks {q.ndim}, {k.ndim} (kernel: [B, L, H, D])"
    B, L, Hq, D = q.shape
    if k.shape[0] != B or k.shape[1] != L or k.shape[3] != D:
        return f"q {tuple(q.shape)}, k {tuple(k.shape)} (kernel: the same B, L, D)"
    if B < 1 or L < 1 or Hq < 1 or k.shape[2] < 1:
        return f"q {tuple(q.shape)}, k {tuple(k.shape)}: empty"
    if D % SIMD_WIDTH or D > MAX_HEAD_DIM:
        return f"head dim {D} (kernel: a multiple of {SIMD_WIDTH}, at most {MAX_HEAD_DIM})"
    dims = rope.dims
    if dims <= 0 or dims % 2 or dims > D:
        return f"rope dims {dims} (kernel: even, at most the head dim {D})"
    if q.dtype != k.dtype or q.dtype not in KERNEL_DTYPES:
        return f"q, k dtypes {q.dtype}, {k.dtype} (kernel: one of bfloat16, float16, float32)"
    if q_weight.dtype != k_weight.dtype or q_weight.dtype not in KERNEL_DTYPES:
        return f"norm weight dtypes {q_weight.dtype}, {k_weight.dtype} (kernel: one of bfloat16, float16, float32)"
    if q_weight.shape != (D,) or k_weight.shape != (D,):
        return f"norm weights {tuple(q_weight.shape)}, {tuple(k_weight.shape)} (kernel: [{D}])"
    if isinstance(offset, mx.array):
        if offset.ndim > 1 or offset.size not in (1, B):
            return f"offset {tuple(offset.shape)} (kernel: one offset, or one per row)"
        if not mx.issubdtype(offset.dtype, mx.integer):
            return f"offset dtype {offset.dtype} (kernel: integer)"
    elif isinstance(offset, (int, np.integer)) and not isinstance(offset, bool):
        if not INT32[0] <= int(offset) <= INT32[1]:
            return f"offset {offset} (kernel: 32-bit)"
    else:
        return f"offset of type {type(offset).__name__} (kernel: int or mx.array)"
    if B * L * (Hq + k.shape[2]) * D >= MAX_ELEMENTS:
        return "too large for 32-bit indexing"
    return None


def _offsets(offset) -> mx.array:
    """The offset as an int32 array of 1 or B values (an input, never a constant)."""
    if not isinstance(offset, mx.array):
        return mx.array([int(offset)], dtype=mx.int32)
    if offset.dtype != mx.int32:
        offset = offset.astype(mx.int32)
    return offset.reshape(1) if offset.ndim == 0 else offset


def _launch(q, k, q_weight, k_weight, eps, rope, offset) -> Launch:
    B, L, Hq, D = q.shape
    Hkv = k.shape[2]
    out_dtype = mx.result_type(q.dtype, q_weight.dtype)
    rows = B * L * (Hq + Hkv)
    threads = ROWS_PER_GROUP * SIMD_WIDTH
    # log2 of the base in fp32, as MLX's rope kernels take it.
    log2_base = float(np.log2(np.float32(rope.base)))
    scalars = mx.array([eps, rope.scale, log2_base], dtype=mx.float32)
    return Launch(
        inputs=[q, k, q_weight, k_weight, _offsets(offset), scalars],
        grid=(SIMD_WIDTH * rows, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(B, Hq, L, D), (B, Hkv, L, D)],
        output_dtypes=[out_dtype, out_dtype],
        template=[
            ("InT", q.dtype),
            ("WT", q_weight.dtype),
            ("OutT", out_dtype),
            ("D", D),
            ("DIMS", int(rope.dims)),
            ("HQ", Hq),
            ("HKV", Hkv),
            ("TRADITIONAL", bool(rope.traditional)),
        ],
        finish=lambda outputs: (outputs[0], outputs[1]),
    )


def _positions(offset, B: int, L: int) -> mx.array:
    """[B, 1, L, 1] positions (offset + token index), fp32."""
    off = offset.astype(mx.float32).reshape(-1) if isinstance(offset, mx.array) else mx.array([float(offset)])
    return (off[:, None] + mx.arange(L, dtype=mx.float32)[None, :]).reshape(-1, 1, L, 1)


def element_bounds(want: mx.array, rope, offset) -> mx.array:
    """The contract's bound on |kernel - reference| per element of one output
    ([B, H, L, D], fp32; see the module docstring)."""
    w = want.astype(mx.float32)
    B, H, L, D = w.shape
    dims, traditional = int(rope.dims), bool(rope.traditional)
    half = dims // 2
    u = UNIT_ROUNDOFF.get(want.dtype, 2.0**-8)
    # 2 steps of the value's magnitude (a step is at most 2u|w|), and the
    # inverse rms's own last bits.
    bound = (4 * u + NORM_ERROR) * mx.abs(w)
    if traditional:
        a, b = w[..., 0:dims:2], w[..., 1:dims:2]
    else:
        a, b = w[..., :half], w[..., half:dims]
    r = mx.sqrt(a * a + b * b)
    exponent = mx.arange(half, dtype=mx.float32) * (math.log(float(rope.base)) / half)
    positions = _positions(offset, B, L)
    theta = mx.abs(float(rope.scale) * positions) * mx.exp(-exponent)
    pair = (4 * u + NORM_ERROR + COS_SIN_ERROR + (8 + 6 * exponent) * 2.0**-24 * theta) * r
    # Negative positions (a left-padded row's padding) are masked out of
    # attention, and MLX's own kernels disagree there (see the docstring).
    pair = mx.where(positions < 0, mx.inf, pair)
    if traditional:
        rotated = mx.stack([pair, pair], axis=-1).reshape(B, H, L, dims)
    else:
        rotated = mx.concatenate([pair, pair], axis=-1)
    return mx.concatenate([rotated, bound[..., dims:]], axis=-1)


def qk_norm_rope_agree(got, want, q, k, q_weight, k_weight, eps, rope, offset) -> Optional[str]:
    """None when the kernel's (q, k) meet the contract (module docstring)."""
    for name, g, w in zip(("q", "k"), got, want):
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"{name}: {tuple(g.shape)} {g.dtype}, reference {tuple(w.shape)} {w.dtype}"
        err = mx.abs(g.astype(mx.float32) - w.astype(mx.float32))
        # NaN (a NaN or inf in the kernel's result) counts as over the bound.
        excess = mx.where(mx.isnan(err), mx.inf, err - element_bounds(w, rope, offset)).reshape(-1)
        at = mx.argmax(excess)
        worst, err_at = excess[at].item(), err.reshape(-1)[at].item()
        if not worst <= 0:
            where = tuple(int(i) for i in np.unravel_index(at.item(), err.shape))
            return f"{name}: |kernel - reference| = {err_at:.3g} at {where}, over the bound by {worst:.3g}"
    return None


def qk_norm_rope_compare(got, want) -> tuple[bool, float]:
    """(within bf16-level error, largest error / largest |reference|), for doctor
    (which has no call arguments to build the per-element bound from)."""
    errors = []
    for g, w in zip(got, want):
        scale = max(mx.abs(w.astype(mx.float32)).max().item(), 1e-6)
        errors.append(mx.abs(g.astype(mx.float32) - w.astype(mx.float32)).max().item() / scale)
    return max(errors) <= 2.0**-5, max(errors)


def _sample():
    from .testing import qk_norm_rope_inputs

    # The layer's shapes, small: a gated q view, 3 query and 1 KV heads, a
    # quarter of the head rotated, a prefill of 3 tokens at offset 5.
    return qk_norm_rope_inputs(1, 3, 3, 1, 64, 16, offset=5, seed=7)


def _fuzz(rng):
    """A random call: B 1-2, L 1-5, odd head counts, D 32-256, dims 16..D,
    offsets 0..40000 as an int or an array (one per row), q gated or plain,
    traditional or not, the dtypes of q/k and of the weights."""
    from .testing import qk_norm_rope_inputs

    B = int(rng.integers(1, 3))
    L = int(rng.integers(1, 6))
    Hkv = int(rng.choice([1, 3]))
    Hq = Hkv * int(rng.choice([1, 3, 5]))
    D = int(rng.choice([32, 64, 96, 128, 256]))
    dims = 2 * int(rng.integers(8, D // 2 + 1))
    if rng.random() < 0.5:
        offset = int(rng.integers(0, 40001))
    else:
        offset = mx.array(rng.integers(0, 40001, size=(B,)).astype(np.int32))
    dtype = KERNEL_DTYPES[int(rng.choice([0, 0, 1, 2]))]
    weight_dtype = dtype if rng.random() < 0.7 else KERNEL_DTYPES[int(rng.integers(3))]
    base = float(rng.choice([1e4, 1e5, 1e7]))
    return qk_norm_rope_inputs(
        B, L, Hq, Hkv, D, dims, offset=offset, traditional=bool(rng.random() < 0.3), base=base,
        dtype=dtype, weight_dtype=weight_dtype, gated=bool(rng.random() < 0.6), rng=rng,
    )


qk_norm_rope_kernel = Kernel(
    name="qk_norm_rope",
    input_names=("q", "k", "q_weight", "k_weight", "offsets", "scalars"),
    output_names=("q_out", "k_out"),
    body=Path(__file__).with_name("qk_norm_rope.metal"),
    launch=_launch,
    reference=qk_norm_rope_reference,
    sample=_sample,
    agree=qk_norm_rope_agree,
    # q is a view of the q projection's output: read in place through its strides.
    row_contiguous=False,
)


qk_norm_rope = register(
    LilyOp(
        "qk_norm_rope",
        qk_norm_rope_reference,
        kernel=qk_norm_rope_kernel,
        supports=qk_norm_rope_supports,
        description="q/k RMSNorm + partial RoPE",
        sample=_sample,
        compare=qk_norm_rope_compare,
        fuzz=_fuzz,
    )
)
