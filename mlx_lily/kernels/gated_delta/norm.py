"""Gated RMSNorm: the norm that closes each Gated DeltaNet layer::

    gated_rms_norm(x, z, weight, eps) -> rms_norm(x, weight, eps) * silu(z)

The reference is stock's (``mx.fast.rms_norm``, then mlx-lm's
``precise_swiglu``), so on the reference path the layer stays stock's to the
bit. The kernel (``gated_rms_norm.metal``) does it in one dispatch, one SIMD
group per row. What it takes, and the contract (``gated_rms_norm_agree``)
with its reasoning: docs/kernel-notes.md#gated-rms-norm.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import mlx.core as mx
from mlx_lm.models.activations import precise_swiglu

from ...toolchain.contracts import elementwise_mismatch, on_cpu

from ...toolchain.kernel import Kernel, Launch, SIMD_WIDTH
from ...toolchain.registry import LilyOp, register
from ..dtypes import ACTIVATION_DTYPES, activation_dtype_reason, step_scale

SIMD_GROUPS = 8
MAX_DV = 256
WEIGHT_DTYPES = (mx.bfloat16, mx.float16, mx.float32)
MAX_ELEMENTS = 2**31


def gated_rms_norm_reference(x: mx.array, z: mx.array, weight: mx.array, eps: float):
    """rms_norm(x) * weight * silu(z), the product taken in fp32."""
    return precise_swiglu(x, z, mx.fast.rms_norm(x, weight, eps))


def gated_rms_norm_supports(x, z, weight, eps) -> Optional[str]:
    """None when the kernel takes this call, else why not."""
    if x.ndim < 1 or x.shape != z.shape:
        return f"x {tuple(x.shape)}, z {tuple(z.shape)} (kernel: the same shape [..., Dv])"
    Dv = x.shape[-1]
    if Dv % SIMD_WIDTH or Dv > MAX_DV:
        return f"Dv={Dv} (kernel: a multiple of {SIMD_WIDTH}, at most {MAX_DV})"
    if x.dtype not in ACTIVATION_DTYPES:
        return activation_dtype_reason("x", x.dtype)
    if z.dtype != x.dtype:
        return f"dtypes {x.dtype}, {z.dtype} (kernel: x's dtype for z)"
    if weight.ndim != 1 or weight.shape[0] != Dv or weight.dtype not in WEIGHT_DTYPES:
        return f"weight {tuple(weight.shape)} {weight.dtype} (kernel: [{Dv}] bfloat16, float16 or float32)"
    if x.size >= MAX_ELEMENTS:
        return "too large for 32-bit indexing"
    return None


def _launch(x, z, weight, eps) -> Launch:
    Dv = x.shape[-1]
    rows = x.size // Dv
    threads = SIMD_GROUPS * SIMD_WIDTH
    return Launch(
        inputs=[x.reshape(rows, Dv), z.reshape(rows, Dv), weight, mx.array([eps], dtype=mx.float32)],
        grid=(max(1, math.ceil(rows / SIMD_GROUPS)) * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(rows, Dv)],
        output_dtypes=[x.dtype],
        template=[("InT", x.dtype), ("NormT", mx.result_type(x.dtype, weight.dtype)), ("Dv", Dv)],
        finish=lambda outputs: outputs[0].reshape(x.shape),
    )


def gated_rms_norm_agree(got, want, *args, **kwargs) -> Optional[str]:
    """None when the kernel's output meets the contract (module docstring);
    with the call's arguments, against the reference evaluated on the CPU
    (``on_cpu``), as the other DeltaNet contracts."""
    if args:
        want = on_cpu(gated_rms_norm_reference, *args, **kwargs)
    scale = step_scale(want.dtype)
    return elementwise_mismatch(got, want, rel=2.0**-6 * scale, of_max=2.0**-10 * scale)


def _sample():
    from .testing import gated_rms_norm_call

    return gated_rms_norm_call((1, 3, 4, 32), seed=6)


def _fuzz(rng):
    """A random call: batch 1-2, 1-40 tokens, 1-5 heads, Dv 32-128, bf16 or fp16
    activations, a bf16, fp16 or fp32 weight."""
    from .testing import gated_rms_norm_call

    shape = (int(rng.integers(1, 3)), int(rng.integers(1, 41)), int(rng.integers(1, 6)),
             int(rng.choice([32, 64, 96, 128])))
    weight = WEIGHT_DTYPES[int(rng.integers(len(WEIGHT_DTYPES)))]
    dtype = ACTIVATION_DTYPES[int(rng.integers(len(ACTIVATION_DTYPES)))]
    return gated_rms_norm_call(shape, weight, rng=rng, dtype=dtype)


gated_rms_norm_kernel = Kernel(
    name="gated_rms_norm",
    input_names=("x", "z", "weight", "scalars"),
    output_names=("out",),
    body=Path(__file__).with_name("gated_rms_norm.metal"),
    launch=_launch,
    reference=gated_rms_norm_reference,
    sample=_sample,
    agree=gated_rms_norm_agree,
)


gated_rms_norm = register(
    LilyOp(
        "gated_rms_norm",
        gated_rms_norm_reference,
        kernel=gated_rms_norm_kernel,
        supports=gated_rms_norm_supports,
        description="RMSNorm * SiLU(gate)",
        sample=_sample,
        fuzz=_fuzz,
    )
)
