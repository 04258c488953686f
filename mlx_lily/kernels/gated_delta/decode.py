"""Gated DeltaNet decode step: everything between the layer's projections and
its output projection, for one token of one sequence, in one dispatch.

The step: the conv state's update, ``conv_qk_norm``, the gates and the
recurrence on the fp32 state (``gated_delta``), and ``gated_rms_norm``. The
reference composes those ops' references as the layer does, so on the
reference path the layer stays stock's to the bit. The kernel
(``gated_delta_decode.metal``) takes bf16 and fp16 decode calls (B = 1, T = 1,
no padding mask); other calls go through the separate ops.

The contract (``gated_delta_decode_agree``), and why it is judged against the
CPU: docs/kernel-notes.md#gated-delta-decode.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import mlx.core as mx

from ...toolchain.contracts import on_cpu

from ...toolchain.kernel import Kernel, Launch, SIMD_WIDTH

from ...toolchain.tracing import contiguous
from ...toolchain.registry import LilyOp, register
from .conv import conv1d_silu_reference
from ..dtypes import ACTIVATION_DTYPES, activation_dtype_reason
from .recurrence import (
    KERNEL_DTYPES,
    MAX_DK,
    STATE_TOLERANCE,
    Y_TOLERANCE,
    _relative_error,
    gated_delta_reference,
    l2norm_qk_reference,
)
from .norm import gated_rms_norm_reference

# The stock L2 norm's epsilon (added to sum(x^2)), as the layer passes it.
L2_EPS = 1e-6
# SIMD groups per threadgroup (one threadgroup per value head): at the real
# shape (Dv = 128) each takes 8 state rows; 16 keep a head's 128 rows x Dk
# loads spread over 512 threads.
MAX_SIMDGROUPS = 16
# Each threadgroup keeps its head's conv outputs and y in threadgroup memory:
# (2 Dk + 2 Dv) floats, at most 4 KiB with Dv <= 256.
MAX_DV = 256
# The body indexes with 32-bit unsigned integers.
MAX_ELEMENTS = 2**31


def gated_delta_decode_reference(
    qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, state, norm_weight, eps, num_k_heads
):
    """qkv [B, T, C], z [B, T, Hv, Dv], a, b [B, T, Hv], conv_state [B, K-1, C]
    (the previous call's last K-1 conv input rows), conv_weight [C, K, 1],
    state [B, Hv, Dv, Dk] fp32 or None -> (out [B, T, Hv, Dv], next conv
    state [B, K-1, C], next state).

    The layer's own sequence of ops (no padding mask), reference for reference.
    """
    B, T, Hv, Dv = z.shape
    n_keep = conv_state.shape[1]
    key_dim = (qkv.shape[-1] - Hv * Dv) // 2
    Dk = key_dim // num_k_heads
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    next_conv = contiguous(conv_input[:, -n_keep:, :])
    conv_out = conv1d_silu_reference(conv_input, conv_weight)
    q, k, v = mx.split(conv_out, [key_dim, 2 * key_dim], axis=-1)
    q = q.reshape(B, T, num_k_heads, Dk)
    k = k.reshape(B, T, num_k_heads, Dk)
    v = v.reshape(B, T, Hv, Dv)
    q, k = l2norm_qk_reference(q, k, Dk**-0.5)
    out, state = gated_delta_reference(q, k, v, a, b, A_log, dt_bias, state, None)
    out = gated_rms_norm_reference(out, z, norm_weight, eps)
    return out, next_conv, state


def gated_delta_decode_supports(
    qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, state, norm_weight, eps, num_k_heads
) -> Optional[str]:
    """None when the kernel takes this call, else why not."""
    if z.ndim != 4 or qkv.ndim != 3:
        return f"qkv {tuple(qkv.shape)}, z {tuple(z.shape)} (kernel: [1, 1, C], [1, 1, Hv, Dv])"
    B, T, Hv, Dv = z.shape
    if (B, T) != (1, 1) or tuple(qkv.shape[:2]) != (1, 1):
        return f"B={B}, T={T} (kernel: one token of one sequence)"
    Hk = int(num_k_heads)
    if Hk <= 0 or Hv == 0 or Dv == 0 or Hv % Hk:
        return f"Hv={Hv}, Hk={Hk} (kernel: Hv a positive multiple of Hk)"
    C = qkv.shape[-1]
    key_dim2 = C - Hv * Dv
    if key_dim2 <= 0 or key_dim2 % (2 * Hk):
        return f"qkv width {C} does not split into q, k ({Hk} heads) and v ({Hv} x {Dv})"
    Dk = key_dim2 // (2 * Hk)
    if Dk % SIMD_WIDTH or Dk > MAX_DK:
        return f"Dk={Dk} (kernel: a multiple of {SIMD_WIDTH}, at most {MAX_DK})"
    if Dv > MAX_DV:
        return f"Dv={Dv} (kernel: at most {MAX_DV})"
    if conv_state is None or conv_state.ndim != 3 or conv_state.shape[0] != 1 or conv_state.shape[2] != C:
        shape = None if conv_state is None else tuple(conv_state.shape)
        return f"conv_state {shape} (kernel: [1, K-1, {C}])"
    K = conv_state.shape[1] + 1
    if K < 2 or tuple(conv_weight.shape) != (C, K, 1):
        return f"conv_weight {tuple(conv_weight.shape)} with {K - 1} conv state rows (kernel: [C, K, 1], K >= 2)"
    if qkv.dtype not in ACTIVATION_DTYPES:
        return activation_dtype_reason("qkv", qkv.dtype)
    for name, x in (("z", z), ("a", a), ("b", b), ("conv_state", conv_state), ("conv_weight", conv_weight)):
        if x.dtype != qkv.dtype:
            return f"{name} dtype {x.dtype} (kernel: qkv's, {qkv.dtype})"
    for name, gate in (("a", a), ("b", b)):
        if tuple(gate.shape) != (1, 1, Hv):
            return f"{name} {tuple(gate.shape)} (kernel: [1, 1, {Hv}])"
    for name, param, n in (("A_log", A_log, Hv), ("dt_bias", dt_bias, Hv), ("norm_weight", norm_weight, Dv)):
        if param.size != n:
            return f"{name} {tuple(param.shape)} (kernel: {n} values)"
        if param.dtype not in KERNEL_DTYPES:
            return f"{name} dtype {param.dtype} (kernel: bfloat16, float16, float32)"
    if state is not None:
        if tuple(state.shape) != (1, Hv, Dv, Dk):
            return f"state {tuple(state.shape)} (kernel: [1, Hv, Dv, Dk] = {(1, Hv, Dv, Dk)})"
        if state.dtype != mx.float32:
            return f"state dtype {state.dtype} (kernel: float32)"
    if max(C * K, Hv * Dv * Dk) >= MAX_ELEMENTS:
        return "too large for 32-bit indexing"
    return None


def _launch(qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, state, norm_weight, eps, num_k_heads) -> Launch:
    _, _, Hv, Dv = z.shape
    Hk = int(num_k_heads)
    C = qkv.shape[-1]
    Dk = (C - Hv * Dv) // (2 * Hk)
    K = conv_state.shape[1] + 1
    nsg = max(1, min(MAX_SIMDGROUPS, Dv))
    has_state = state is not None
    inv_scale = Dk**-0.5
    scalars = mx.array([L2_EPS * inv_scale**2, inv_scale**2, inv_scale, eps], dtype=mx.float32)
    return Launch(
        inputs=[
            qkv, z, a, b, conv_state, conv_weight, A_log.reshape(Hv), dt_bias.reshape(Hv),
            state if has_state else mx.zeros((1,), mx.float32), norm_weight.reshape(Dv), scalars,
        ],
        grid=(nsg * SIMD_WIDTH * Hv, 1, 1),
        threadgroup=(nsg * SIMD_WIDTH, 1, 1),
        output_shapes=[(1, 1, Hv, Dv), tuple(conv_state.shape), (1, Hv, Dv, Dk)],
        output_dtypes=[qkv.dtype, conv_state.dtype, mx.float32],
        template=[
            ("InT", qkv.dtype),
            ("SumT", mx.result_type(a.dtype, dt_bias.dtype)),
            ("BetaT", b.dtype),
            ("NormT", mx.result_type(qkv.dtype, norm_weight.dtype)),
            ("Dk", Dk),
            ("Dv", Dv),
            ("Hk", Hk),
            ("Hv", Hv),
            ("CONV_K", K),
            ("NSG", nsg),
            ("HAS_STATE", has_state),
        ],
        finish=lambda outputs: tuple(outputs),
    )


def gated_delta_decode_agree(got, want, *args, **kwargs) -> Optional[str]:
    """None when the kernel's (out, conv state, state) meet the contract
    (module docstring), else which output is off and by how much. With the
    call's arguments, ``want`` is the CPU's reference; without them (doctor's
    comparison), the one given."""
    if args:
        want = on_cpu(gated_delta_decode_reference, *args, **kwargs)
    (out, conv, s), (out_ref, conv_ref, s_ref) = got, want
    if conv.shape != conv_ref.shape or not mx.array_equal(conv, conv_ref).item():
        return "conv state: not the reference's rows"
    # The activations' dtype sets the bounds (gated_delta's, per dtype).
    y_tol = Y_TOLERANCE.get(out_ref.dtype, Y_TOLERANCE[mx.bfloat16])
    s_tol = STATE_TOLERANCE.get(out_ref.dtype, STATE_TOLERANCE[mx.bfloat16])
    err = _relative_error(out, out_ref)
    if not err <= y_tol:
        return f"out: max |kernel - reference| / max |reference| = {err:.3g} (> {y_tol:g})"
    err = _relative_error(s, s_ref)
    if not err <= s_tol:
        return f"state: max |kernel - reference| / max |reference| = {err:.3g} (> {s_tol:g})"
    return None


def gated_delta_decode_compare(got, want) -> tuple[bool, float]:
    """(acceptable, largest relative error), for doctor."""
    mismatch = gated_delta_decode_agree(got, want)
    errors = [_relative_error(g, w) for g, w in zip(got, want)]
    return mismatch is None, max(errors)


def _sample():
    from .testing import gated_delta_decode_inputs

    return gated_delta_decode_inputs(Hk=2, Hv=4, Dk=32, Dv=32, seed=7)


def _fuzz(rng):
    """A random decode call: heads (value/key ratio 1-3), head dims, conv width,
    a state or none, bf16 or fp16 activations, and the gate/norm parameters' dtypes."""
    from .testing import gated_delta_decode_inputs

    Hk = int(rng.integers(1, 4))
    Hv = Hk * int(rng.integers(1, 4))
    Dk = int(rng.choice([32, 64, 128]))
    Dv = int(rng.choice([8, 32, 48, 64, 128]))
    K = int(rng.choice([2, 4, 4]))
    dtype = ACTIVATION_DTYPES[int(rng.integers(len(ACTIVATION_DTYPES)))]
    args, kwargs = gated_delta_decode_inputs(Hk, Hv, Dk, Dv, K=K, with_state=rng.random() < 0.7, rng=rng, dtype=dtype)
    args = list(args)
    pick = lambda: KERNEL_DTYPES[int(rng.integers(len(KERNEL_DTYPES)))]  # noqa: E731
    args[6], args[7], args[9] = args[6].astype(pick()), args[7].astype(pick()), args[9].astype(pick())
    return tuple(args), kwargs


gated_delta_decode_kernel = Kernel(
    name="gated_delta_decode",
    input_names=(
        "qkv", "z", "a", "b", "conv_state", "conv_weight", "A_log", "dt_bias",
        "state_in", "norm_weight", "scalars",
    ),
    output_names=("out", "conv_state_out", "state_out"),
    body=Path(__file__).with_name("gated_delta_decode.metal"),
    launch=_launch,
    reference=gated_delta_decode_reference,
    sample=_sample,
    agree=gated_delta_decode_agree,
)


gated_delta_decode = register(
    LilyOp(
        "gated_delta_decode",
        gated_delta_decode_reference,
        kernel=gated_delta_decode_kernel,
        supports=gated_delta_decode_supports,
        description="Gated DeltaNet decode step: conv + L2 norm + gates + recurrence + gated norm",
        sample=_sample,
        compare=gated_delta_decode_compare,
        fuzz=_fuzz,
    )
)
