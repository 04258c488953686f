"""Activation dtypes lily's kernels take, and their rounding step.

The model's activations are the checkpoint's float dtype (its scales, norms
and embeddings). The kernels take bf16 and fp16 activations, accumulate in
fp32 and keep the recurrent state in fp32; fp32 activations run the
references.

Tolerances scale with the dtype's step: a value rounded to bf16 (8
significant bits) is within 2^-8 of itself relative, one step of 2^-7 at
most; fp16 keeps 11 significant bits, so the same rounding is 2^3 = 8 times
finer (a step of 2^-10). A contract written for bf16 as a number of steps
holds for fp16 with each step term divided by 8, as long as the fp32 sums'
own error (about 2^-24 per term) stays below it, which it does at the
kernels' sizes.
"""

from __future__ import annotations

import mlx.core as mx

ACTIVATION_DTYPES = (mx.bfloat16, mx.float16)

# One rounding step, relative to the value (the largest relative spacing of
# the dtype's numbers: 2^-(significant bits - 1)).
STEP = {mx.bfloat16: 2.0**-7, mx.float16: 2.0**-10, mx.float32: 2.0**-23}


def step_scale(dtype) -> float:
    """How much finer ``dtype``'s rounding is than bf16's (1 for bf16, 1/8 for
    fp16): a bf16 tolerance made of rounding steps, times this."""
    return STEP.get(dtype, STEP[mx.bfloat16]) / STEP[mx.bfloat16]


def dtype_names(dtypes=ACTIVATION_DTYPES) -> str:
    return " and ".join(str(d).rsplit(".", 1)[-1] for d in dtypes)


def activation_dtype_reason(name: str, dtype) -> str:
    """Why a call in ``dtype`` runs the reference."""
    return f"{name} dtype {str(dtype).rsplit('.', 1)[-1]} (kernel: {dtype_names()})"


# Ops of the model whose kernels do not take these activation dtypes (other
# dtypes than these and bf16: every op listed for fp32). fp16: the matrix
# tiles (lily_tile_*) multiply bf16 only, so the MoE prefill GEMMs and the
# prefill attention keep their references.
REFERENCE_FOR = {
    mx.float32: ("attention", "conv_qk_norm", "gated_rms_norm", "gated_delta_decode", "quantized_matvec",
                 "moe_experts", "moe_decode"),
    mx.float16: ("attention (prompt calls)", "moe_experts"),
}


def embedding_dtype(embedding) -> mx.Dtype:
    """The activations' dtype a token embedding gives: a quantized one's
    scales', else its weight's."""
    scales = getattr(embedding, "scales", None)
    return scales.dtype if isinstance(scales, mx.array) else embedding.weight.dtype


def reference_notice(dtype) -> None:
    """One notice per process and dtype naming the ops that run their
    references at these activations (none for bf16)."""
    if dtype == mx.bfloat16:
        return
    name = str(dtype).rsplit(".", 1)[-1]
    ops = REFERENCE_FOR.get(dtype, REFERENCE_FOR[mx.float32])
    why = ("their matrix tiles take bfloat16 only" if dtype == mx.float16
           else f"kernels take {dtype_names()}")
    from .._notice import notice_once

    notice_once(f"activation-dtype:{name}",
                f"{name} activations: {', '.join(ops)} run their pure-MLX references ({why})")
