"""Gated DeltaNet decode step: everything between the layer's projections and
its output projection, for one token of each of 1 to MAX_BATCH sequences
(rows), in one dispatch.

The step: the conv state's update, ``conv_qk_norm``, the gates and the
recurrence on the fp32 state (``gated_delta``), and ``gated_rms_norm``. The
reference composes those ops' references as stock's layer does, padding mask
included, so on the reference path the layer stays stock's to the bit. The
kernel (``gated_delta_decode.metal``) takes bf16 and fp16 decode calls (T = 1,
B <= MAX_BATCH, an optional [B, 1] padding mask; the state fp32); other calls
go through the separate ops. Each row is its own threadgroups doing the same
arithmetic whatever B is, so a row's outputs and states are the same bits
alone or in any batch, at any position, beside any rows.

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
# Rows per call: a server's decode batch. Each row is its own threadgroups
# (the weights they share are small), so more rows only lengthen the grid.
MAX_BATCH = 16
# The body indexes with 32-bit unsigned integers.
MAX_ELEMENTS = 2**31


def _heads(z, A_log) -> tuple:
    """(B, T, Hv, Dv) of z, given as [B, T, Hv, Dv] or flat as [B, T, Hv *
    Dv] (Hv: A_log's size). A flat z gives a flat out: the body indexes both
    as rows of Hv * Dv values, so the decode step's graph needs no reshape
    on either side (two view nodes a DeltaNet layer a token)."""
    if z.ndim == 3:
        Hv = int(A_log.size)
        return z.shape[0], z.shape[1], Hv, (z.shape[2] // Hv if Hv else 0)
    return tuple(z.shape)


def gated_delta_decode_reference(
    qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, state, norm_weight, eps, num_k_heads, mask=None,
    padding_shifts_conv=False,
):
    """qkv [B, T, C], z [B, T, Hv, Dv] (or flat, [B, T, Hv * Dv]), a, b [B,
    T, Hv], conv_state [B, K-1, C] (the previous call's last K-1 conv input
    rows; None: zeros, a sequence's start), conv_weight [C, K, 1], state [B,
    Hv, Dv, Dk] fp32 or None, mask [B, 1] bool or None (False: a padding
    step; with T = 1) -> (out [B, T, Hv, Dv] (flat where z is), next conv
    state [B, K-1, C], next state).

    Stock's layer's sequence of ops, reference for reference: a padding
    step's qkv enters the convolution as zeros, its out is computed as for
    any step, and its recurrent state is kept (``gated_delta_update``'s
    mask). Its conv state is kept too, as stock keeps it for a row past its
    length (``cache.lengths``: the K-1 rows from the row's end); with
    ``padding_shifts_conv`` the zero row is shifted in, as stock does for a
    cache without lengths (the server's decode steps).
    """
    B, T, Hv, Dv = _heads(z, A_log)
    flat = z.ndim == 3
    z = z.reshape(B, T, Hv, Dv)
    key_dim = (qkv.shape[-1] - Hv * Dv) // 2
    Dk = key_dim // num_k_heads
    if conv_state is None:
        conv_state = mx.zeros((B, conv_weight.shape[1] - 1, qkv.shape[-1]), dtype=qkv.dtype)
    n_keep = conv_state.shape[1]
    if mask is not None:
        qkv = mx.where(mask[..., None], qkv, 0)
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    next_conv = contiguous(conv_input[:, -n_keep:, :])
    if mask is not None and not padding_shifts_conv:
        next_conv = mx.where(mask[:, -1:, None], next_conv, conv_state)
    conv_out = conv1d_silu_reference(conv_input, conv_weight)
    q, k, v = mx.split(conv_out, [key_dim, 2 * key_dim], axis=-1)
    q = q.reshape(B, T, num_k_heads, Dk)
    k = k.reshape(B, T, num_k_heads, Dk)
    v = v.reshape(B, T, Hv, Dv)
    q, k = l2norm_qk_reference(q, k, Dk**-0.5)
    out, state = gated_delta_reference(q, k, v, a, b, A_log, dt_bias, state, mask)
    out = gated_rms_norm_reference(out, z, norm_weight, eps)
    return (out.reshape(B, T, Hv * Dv) if flat else out), next_conv, state


def gated_delta_decode_supports(
    qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, state, norm_weight, eps, num_k_heads, mask=None,
    padding_shifts_conv=False,
) -> Optional[str]:
    """None when the kernel takes this call, else why not."""
    if z.ndim not in (3, 4) or qkv.ndim != 3:
        return f"qkv {tuple(qkv.shape)}, z {tuple(z.shape)} (kernel: [B, 1, C], [B, 1, Hv, Dv] or [B, 1, Hv * Dv])"
    B, T, Hv, Dv = _heads(z, A_log)
    if z.ndim == 3 and Hv * Dv != z.shape[-1]:
        return f"z {tuple(z.shape)}: not {Hv} heads (A_log's size) of equal width"
    if T != 1 or tuple(qkv.shape[:2]) != (B, 1):
        return f"qkv {tuple(qkv.shape)}, z {tuple(z.shape)}: T={T} (kernel: one token per row)"
    if not 1 <= B <= MAX_BATCH:
        return f"B={B} (kernel: 1 to {MAX_BATCH} rows)"
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
    K = conv_weight.shape[1] if conv_weight.ndim == 3 else 0
    if K < 2 or tuple(conv_weight.shape) != (C, K, 1):
        return f"conv_weight {tuple(conv_weight.shape)} (kernel: [{C}, K, 1], K >= 2)"
    if conv_state is not None and tuple(conv_state.shape) != (B, K - 1, C):
        return f"conv_state {tuple(conv_state.shape)} (kernel: [B, K-1, C] = {(B, K - 1, C)})"
    if qkv.dtype not in ACTIVATION_DTYPES:
        return activation_dtype_reason("qkv", qkv.dtype)
    for name, x in (("z", z), ("a", a), ("b", b), ("conv_state", conv_state), ("conv_weight", conv_weight)):
        if x is not None and x.dtype != qkv.dtype:
            return f"{name} dtype {x.dtype} (kernel: qkv's, {qkv.dtype})"
    for name, gate in (("a", a), ("b", b)):
        if tuple(gate.shape) != (B, 1, Hv):
            return f"{name} {tuple(gate.shape)} (kernel: [B, 1, Hv] = {(B, 1, Hv)})"
    for name, param, n in (("A_log", A_log, Hv), ("dt_bias", dt_bias, Hv), ("norm_weight", norm_weight, Dv)):
        if param.size != n:
            return f"{name} {tuple(param.shape)} (kernel: {n} values)"
        if param.dtype not in KERNEL_DTYPES:
            return f"{name} dtype {param.dtype} (kernel: bfloat16, float16, float32)"
    if state is not None:
        if tuple(state.shape) != (B, Hv, Dv, Dk):
            return f"state {tuple(state.shape)} (kernel: [B, Hv, Dv, Dk] = {(B, Hv, Dv, Dk)})"
        if state.dtype != mx.float32:
            return f"state dtype {state.dtype} (kernel: float32)"
    if mask is not None and (tuple(mask.shape) != (B, 1) or mask.dtype != mx.bool_):
        return f"mask {tuple(mask.shape)} {mask.dtype} (kernel: [B, 1] = {(B, 1)} bool)"
    if max(C * K, B * C * (K - 1), B * Hv * Dv * Dk) >= MAX_ELEMENTS:
        return "too large for 32-bit indexing"
    return None


def _launch(
    qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, state, norm_weight, eps, num_k_heads, mask=None,
    padding_shifts_conv=False,
) -> Launch:
    B, _, Hv, Dv = _heads(z, A_log)
    Hk = int(num_k_heads)
    C = qkv.shape[-1]
    Dk = (C - Hv * Dv) // (2 * Hk)
    K = conv_weight.shape[1]
    if conv_state is None:
        conv_state = mx.zeros((B, K - 1, C), dtype=qkv.dtype)
    # Nothing here depends on B but the grid's rows: one build, the same
    # threadgroups and the same arithmetic per row for every batch size.
    nsg = max(1, min(MAX_SIMDGROUPS, Dv))
    has_state = state is not None
    # Always a mask (all real without one): calls with and without a mask
    # are one build, so a row's bits do not depend on whether its batch has one.
    step_mask = mask.reshape(B) if mask is not None else mx.ones((B,), mx.bool_)
    inv_scale = Dk**-0.5
    scalars = mx.array([L2_EPS * inv_scale**2, inv_scale**2, inv_scale, eps], dtype=mx.float32)
    return Launch(
        inputs=[
            qkv, z, a, b, conv_state, conv_weight, A_log.reshape(Hv), dt_bias.reshape(Hv),
            state if has_state else mx.zeros((1,), mx.float32), norm_weight.reshape(Dv), scalars, step_mask,
        ],
        grid=(nsg * SIMD_WIDTH * Hv, B, 1),
        threadgroup=(nsg * SIMD_WIDTH, 1, 1),
        output_shapes=[(B, 1, *z.shape[2:]), (B, K - 1, C), (B, Hv, Dv, Dk)],
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
            ("PAD_SHIFTS", bool(padding_shifts_conv)),
            ("STEPS", 1),
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
    """Two rows, the second a padding step: the self-check sees both kinds."""
    from .testing import gated_delta_decode_inputs

    return gated_delta_decode_inputs(Hk=2, Hv=4, Dk=32, Dv=32, seed=7, B=2, mask=[True, False])


def _fuzz(rng):
    """A random decode call: 1-3 rows (with padding steps or none; they keep
    or shift the conv state), heads (value/key ratio 1-3), head dims, conv
    width, a state or none, bf16 or fp16 activations, and the gate/norm
    parameters' dtypes."""
    from .testing import gated_delta_decode_inputs

    Hk = int(rng.integers(1, 4))
    Hv = Hk * int(rng.integers(1, 4))
    Dk = int(rng.choice([32, 64, 128]))
    Dv = int(rng.choice([8, 32, 48, 64, 128]))
    K = int(rng.choice([2, 4, 4]))
    dtype = ACTIVATION_DTYPES[int(rng.integers(len(ACTIVATION_DTYPES)))]
    B = int(rng.integers(1, 4))
    mask = list(rng.random(B) < 0.7) if rng.random() < 0.5 else None
    args, kwargs = gated_delta_decode_inputs(
        Hk, Hv, Dk, Dv, K=K, with_state=rng.random() < 0.7, rng=rng, dtype=dtype, B=B, mask=mask)
    args = list(args)
    pick = lambda: KERNEL_DTYPES[int(rng.integers(len(KERNEL_DTYPES)))]  # noqa: E731
    args[6], args[7], args[9] = args[6].astype(pick()), args[7].astype(pick()), args[9].astype(pick())
    if mask is not None and rng.random() < 0.5:
        kwargs = dict(kwargs, padding_shifts_conv=True)
    return tuple(args), kwargs


gated_delta_decode_kernel = Kernel(
    name="gated_delta_decode",
    input_names=(
        "qkv", "z", "a", "b", "conv_state", "conv_weight", "A_log", "dt_bias",
        "state_in", "norm_weight", "scalars", "step_mask",
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


# -- P positions of one stream (speculative verification) ---------------------------


def gated_delta_decode_steps_reference(
    qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, state, norm_weight, eps, num_k_heads,
):
    """qkv [P, 1, C] etc.: P consecutive positions of one stream, conv_state
    [1, K-1, C], state [1, Hv, Dv, Dk] or None -> (out [P, 1, Hv, Dv] (flat
    where z is), the conv state after each position [P, K-1, C], the state
    after each [P, Hv, Dv, Dk]): ``gated_delta_decode`` once per position, in
    order."""
    outs, convs, states = [], [], []
    for p in range(qkv.shape[0]):
        out, conv_state, state = gated_delta_decode_reference(
            qkv[p:p + 1], z[p:p + 1], a[p:p + 1], b[p:p + 1], conv_state, conv_weight, A_log, dt_bias, state,
            norm_weight, eps, num_k_heads)
        outs.append(out)
        convs.append(conv_state)
        states.append(state)
    return tuple(mx.concatenate(parts, axis=0) for parts in (outs, convs, states))


def gated_delta_decode_steps_supports(
    qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, state, norm_weight, eps, num_k_heads,
) -> Optional[str]:
    """None when the kernel takes these P positions in one launch, else why not."""
    P = qkv.shape[0] if qkv.ndim == 3 else 0
    if not 1 <= P <= MAX_BATCH:
        return f"qkv {tuple(qkv.shape)}: {P} positions (kernel: 1 to {MAX_BATCH})"
    K = conv_weight.shape[1] if conv_weight.ndim == 3 else 0
    if conv_state is not None and tuple(conv_state.shape) != (1, K - 1, qkv.shape[-1]):
        return f"conv_state {tuple(conv_state.shape)} (kernel: one stream's, [1, K-1, C])"
    if state is not None and state.shape[0] != 1:
        return f"state {tuple(state.shape)} (kernel: one stream's, [1, Hv, Dv, Dk])"
    # The rest as a call of P rows (each row's checks are the same).
    rows = lambda x: None if x is None else mx.broadcast_to(x, (P, *x.shape[1:]))  # noqa: E731
    return gated_delta_decode_supports(qkv, z, a, b, rows(conv_state), conv_weight, A_log, dt_bias, rows(state),
                                       norm_weight, eps, num_k_heads)


def _launch_steps(
    qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, state, norm_weight, eps, num_k_heads,
) -> Launch:
    P = qkv.shape[0]
    one = _launch(qkv[:1], z[:1], a[:1], b[:1], conv_state, conv_weight, A_log, dt_bias, state, norm_weight, eps,
                  num_k_heads)
    inputs = list(one.inputs)
    inputs[:4] = [qkv, z, a, b]
    inputs[-1] = mx.ones((P,), mx.bool_)  # no padding step among a stream's positions
    C, K = qkv.shape[-1], conv_weight.shape[1]
    return Launch(
        inputs=inputs,
        grid=(one.grid[0], 1, 1),
        threadgroup=one.threadgroup,
        output_shapes=[(P, 1, *z.shape[2:]), (P, K - 1, C), (P, *one.output_shapes[2][1:])],
        output_dtypes=one.output_dtypes,
        template=[(name, P if name == "STEPS" else value) for name, value in one.template],
        finish=lambda outputs: tuple(outputs),
    )


def _steps_sample():
    """Three positions of one stream with a state."""
    from .testing import gated_delta_decode_steps_inputs

    return gated_delta_decode_steps_inputs(Hk=2, Hv=4, Dk=32, Dv=32, P=3, seed=9)


def _steps_fuzz(rng):
    """A random stream of 1 to 5 positions: heads (value/key ratio 1-3), head
    dims, conv width, a state or none, bf16 or fp16, the gate/norm
    parameters' dtypes."""
    from .testing import gated_delta_decode_steps_inputs

    Hk = int(rng.integers(1, 4))
    Hv = Hk * int(rng.integers(1, 4))
    args, kwargs = gated_delta_decode_steps_inputs(
        Hk, Hv, int(rng.choice([32, 64])), int(rng.choice([8, 32, 48])), int(rng.integers(1, 6)),
        K=int(rng.choice([2, 3, 4])), with_state=rng.random() < 0.7, seed=int(rng.integers(1 << 30)),
        dtype=ACTIVATION_DTYPES[int(rng.integers(len(ACTIVATION_DTYPES)))])
    args = list(args)
    pick = lambda: KERNEL_DTYPES[int(rng.integers(len(KERNEL_DTYPES)))]  # noqa: E731
    args[6], args[7], args[9] = args[6].astype(pick()), args[7].astype(pick()), args[9].astype(pick())
    return tuple(args), kwargs


def gated_delta_decode_steps_agree(got, want, *args, **kwargs) -> Optional[str]:
    """Each position against the reference's, as ``gated_delta_decode_agree`` judges one."""
    if args:
        want = on_cpu(gated_delta_decode_steps_reference, *args, **kwargs)
    for p in range(got[0].shape[0]):
        mismatch = gated_delta_decode_agree(tuple(g[p:p + 1] for g in got), tuple(w[p:p + 1] for w in want))
        if mismatch is not None:
            return f"position {p}: {mismatch}"
    return None


gated_delta_decode_steps_kernel = Kernel(
    name="gated_delta_decode_steps",
    input_names=gated_delta_decode_kernel.input_names,
    output_names=gated_delta_decode_kernel.output_names,
    body=Path(__file__).with_name("gated_delta_decode.metal"),
    launch=_launch_steps,
    reference=gated_delta_decode_steps_reference,
    sample=_steps_sample,
    agree=gated_delta_decode_steps_agree,
)


gated_delta_decode_steps = register(
    LilyOp(
        "gated_delta_decode_steps",
        gated_delta_decode_steps_reference,
        kernel=gated_delta_decode_steps_kernel,
        supports=gated_delta_decode_steps_supports,
        description="Gated DeltaNet decode of P positions of one stream in order (speculative verification)",
        sample=_steps_sample,
        compare=gated_delta_decode_compare,
        fuzz=_steps_fuzz,
        # Only the speculative verification pass calls it, not a plain prefill or decode.
        in_model=False,
    )
)
