"""Gated DeltaNet: q/k L2 normalisation and the gated delta-rule recurrence.

Per value head h, with state S (Dv x Dk, fp32) and gates g = exp(-exp(A_log) *
softplus(a + dt_bias)), beta = sigmoid(b):

    S   <- g * S
    d   <- (v - S k) * beta
    S   <- S + d k^T
    y   <- S q

The reference is mlx-lm's own `gated_delta_update` (its per-token loop on a
CPU or CUDA, its Metal kernel on Apple GPUs), so the reference path is stock.

The kernel (``gated_delta.metal``) runs the whole recurrence, gates included,
in one dispatch: one SIMD group per state row, the row in registers, looping
over the call's tokens. Its contract with the reference, relative to the
reference's largest value (``gated_delta_agree``): y within 3e-2 / 4e-3 / 1e-4
and the final state within 2e-2 / 2.5e-3 / 1e-4 for bf16 / f16 / f32 gate
inputs. The state is fp32, but beta and the gates' softplus are rounded in the
activation dtype as stock rounds them, and a GPU's rounding of those steps can
differ from the CPU's by one step; on the CPU the kernel is within ~1e-7.
"""

from __future__ import annotations

import math
from typing import Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

from ..toolchain.registry import LilyOp, register
from ..toolchain.build import SIMD_WIDTH, Kernel, Launch


def l2norm_qk_reference(q: mx.array, k: mx.array, inv_scale: float, eps: float = 1e-6):
    return normalize_qk(q, k, inv_scale=inv_scale, eps=eps)


def gated_delta_reference(q, k, v, a, b, A_log, dt_bias, state=None):
    """q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; a, b [B, T, Hv] -> (y, state)."""
    return gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, None)


def _sample_qk():
    q = mx.random.normal((1, 4, 2, 32), key=mx.random.key(3)).astype(mx.bfloat16)
    k = mx.random.normal((1, 4, 2, 32), key=mx.random.key(4)).astype(mx.bfloat16)
    return (q, k, 32**-0.5), {}


def _sample_recurrence():
    keys = mx.random.split(mx.random.key(5), 6)
    B, T, Hk, Hv, Dk, Dv = 1, 5, 2, 4, 32, 16
    q, k = mx.random.normal((2, B, T, Hk, Dk), key=keys[0]).astype(mx.bfloat16)
    q, k = normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
    v = mx.random.normal((B, T, Hv, Dv), key=keys[1]).astype(mx.bfloat16)
    a = mx.random.normal((B, T, Hv), key=keys[2]).astype(mx.bfloat16)
    b = mx.random.normal((B, T, Hv), key=keys[3]).astype(mx.bfloat16)
    A_log = mx.log(mx.random.uniform(1, 16, (Hv,), key=keys[4]))
    dt_bias = mx.ones((Hv,))
    state = 0.1 * mx.random.normal((B, Hv, Dv, Dk), key=keys[5])
    return (q, k, v, a, b, A_log, dt_bias, state), {}


# -- the kernel --------------------------------------------------------------

# State rows (one SIMD group each) per threadgroup. Rows are numbered batch,
# head, dv, so with Dv a multiple of 4 a threadgroup's rows share one head's q
# and k in cache; four keep the real decode shape (32 heads x 128 rows) at
# 1024 threadgroups, enough to fill a large GPU.
ROWS_PER_THREADGROUP = 4
# Each lane keeps Dk / 32 state entries, and as many of q and k (current and
# next token), in registers: 8 per lane (Dk = 256) bounds that at 40 floats.
MAX_KEYS_PER_LANE = 8
MAX_DK = SIMD_WIDTH * MAX_KEYS_PER_LANE
KERNEL_DTYPES = (mx.bfloat16, mx.float16, mx.float32)
# The body indexes with 32-bit unsigned integers.
MAX_ELEMENTS = 2**31


def gated_delta_supports(q, k, v, a, b, A_log, dt_bias, state=None) -> Optional[str]:
    """None when the kernel takes this call, else why not."""
    if q.ndim != 4 or k.shape != q.shape:
        return f"q {tuple(q.shape)}, k {tuple(k.shape)} (kernel: both [B, T, Hk, Dk])"
    B, T, Hk, Dk = q.shape
    if v.ndim != 4 or tuple(v.shape[:2]) != (B, T):
        return f"v {tuple(v.shape)} with q {tuple(q.shape)} (kernel: v [B, T, Hv, Dv])"
    Hv, Dv = v.shape[2:]
    if B == 0 or T == 0 or Hk == 0 or Hv == 0 or Dv == 0:
        return f"empty call: q {tuple(q.shape)}, v {tuple(v.shape)}"
    if Dk % SIMD_WIDTH or Dk > MAX_DK:
        return f"Dk={Dk} (kernel: a multiple of {SIMD_WIDTH}, at most {MAX_DK})"
    if Hv % Hk:
        return f"Hv={Hv} not a multiple of Hk={Hk}"
    for name, gate in (("a", a), ("b", b)):
        if tuple(gate.shape) != (B, T, Hv):
            return f"{name} {tuple(gate.shape)} (kernel: [B, T, Hv] = {(B, T, Hv)})"
    for name, param in (("A_log", A_log), ("dt_bias", dt_bias)):
        if param.size != Hv:
            return f"{name} {tuple(param.shape)} (kernel: {Hv} values, one per value head)"
    if q.dtype not in KERNEL_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype} (kernel: one of bfloat16, float16, float32)"
    for name, x in (("a", a), ("b", b), ("A_log", A_log), ("dt_bias", dt_bias)):
        if x.dtype not in KERNEL_DTYPES:
            return f"{name} dtype {x.dtype} (kernel: bfloat16, float16, float32)"
    if state is not None:
        if tuple(state.shape) != (B, Hv, Dv, Dk):
            return f"state {tuple(state.shape)} (kernel: [B, Hv, Dv, Dk] = {(B, Hv, Dv, Dk)})"
        if state.dtype != mx.float32:
            return f"state dtype {state.dtype} (kernel: float32)"
    if max(q.size, v.size, B * Hv * Dv * Dk) >= MAX_ELEMENTS:
        return f"too large for 32-bit indexing: q {tuple(q.shape)}, v {tuple(v.shape)}"
    return None


def _launch_gated_delta(q, k, v, a, b, A_log, dt_bias, state=None) -> Launch:
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    rows = B * Hv * Dv
    has_state = state is not None
    # Without a state the body never reads state_in: a one-element stand-in.
    state_in = state if has_state else mx.zeros((1,), mx.float32)
    return Launch(
        inputs=[q, k, v, a, b, A_log.reshape(Hv), dt_bias.reshape(Hv), state_in],
        grid=(rows * SIMD_WIDTH, 1, 1),
        threadgroup=(min(ROWS_PER_THREADGROUP, rows) * SIMD_WIDTH, 1, 1),
        output_shapes=[(B, T, Hv, Dv), (B, Hv, Dv, Dk)],
        output_dtypes=[q.dtype, mx.float32],
        template=[
            ("InT", q.dtype),
            # The reference's rounding points: a + dt_bias and softplus in
            # their promoted dtype, sigmoid(b) in b's.
            ("SumT", mx.result_type(a.dtype, dt_bias.dtype)),
            ("BetaT", b.dtype),
            ("Dk", Dk),
            ("Dv", Dv),
            ("Hk", Hk),
            ("Hv", Hv),
            ("HAS_STATE", has_state),
        ],
        finish=lambda outputs: (outputs[0], outputs[1]),
    )


# How far the kernel may be from the reference: max |kernel - reference| over
# max |reference|, for y by the activation dtype and for the state by the
# dtype of the gates' inputs (the coarsest of a, b and dt_bias).
#
# With fp32 gates only the summation order differs (measured ~1e-7 for both).
# With 16-bit ones the reference rounds sigmoid(b) (and, for a 16-bit dt_bias,
# softplus) to that dtype by its backend's formula. The kernel rounds where
# MLX's CPU ops do, matching them to the bit (state ~1e-7 then too), but
# MLX's CUDA sigmoid rounds every step in the 16-bit type, and a gate may then
# come out one unit in its last place apart. That moves the token's share of
# the state by up to 2**-7 of itself in bfloat16 (one unit over the smallest
# beta of its binade), 2**-10 in float16, so the state's bound is a few such
# units, and y's adds its own rounding to InT. Measured over 160 random
# bfloat16 cases against stock with its sigmoid rounded the CUDA way
# (simulated on a CPU): y at most 1.3e-2, state 7.6e-3.
Y_TOLERANCE = {mx.bfloat16: 3e-2, mx.float16: 4e-3, mx.float32: 1e-4}
STATE_TOLERANCE = {mx.bfloat16: 2e-2, mx.float16: 2.5e-3, mx.float32: 1e-4}


def _relative_error(got: mx.array, want: mx.array) -> float:
    """max |got - want| / max |want| in float64 (NaN or inf: inf)."""
    g = np.array(got.astype(mx.float32)).astype(np.float64)
    w = np.array(want.astype(mx.float32)).astype(np.float64)
    if g.shape != w.shape or not np.isfinite(g).all():
        return math.inf
    scale = max(float(np.abs(w).max(initial=0.0)), 1e-30)
    return float(np.abs(g - w).max(initial=0.0)) / scale


def _coarser(*dtypes) -> mx.Dtype:
    """The least precise of the dtypes (the one whose tolerance applies)."""
    order = [mx.float32, mx.float16, mx.bfloat16]
    return max(dtypes, key=lambda d: order.index(d) if d in order else 0)


def gated_delta_agree(got, want, q, k, v, a, b, A_log, dt_bias, state=None) -> Optional[str]:
    """None when (y, state) from the kernel meet the op's contract, else the breach."""
    (y, s), (y_ref, s_ref) = got, want
    if y.shape != y_ref.shape or y.dtype != y_ref.dtype:
        return f"y {tuple(y.shape)} {y.dtype} vs reference {tuple(y_ref.shape)} {y_ref.dtype}"
    if s.shape != s_ref.shape or s.dtype != mx.float32:
        return f"state {tuple(s.shape)} {s.dtype} vs reference {tuple(s_ref.shape)} float32"
    y_err, y_tol = _relative_error(y, y_ref), Y_TOLERANCE.get(q.dtype, 2e-2)
    if not y_err <= y_tol:
        return f"y: max |kernel - reference| / max |reference| = {y_err:.3g} (> {y_tol:g})"
    s_err = _relative_error(s, s_ref)
    s_tol = STATE_TOLERANCE.get(_coarser(a.dtype, b.dtype, dt_bias.dtype), 1e-3)
    if not s_err <= s_tol:
        return f"state: max |kernel - reference| / max |reference| = {s_err:.3g} (> {s_tol:g})"
    return None


def gated_delta_compare(got, want) -> tuple[bool, float]:
    """(acceptable, larger relative error of y and state), for doctor.

    Without the inputs, the tolerances follow y's dtype (the activations').
    """
    (y, s), (y_ref, s_ref) = got, want
    y_err, s_err = _relative_error(y, y_ref), _relative_error(s, s_ref)
    y_tol = Y_TOLERANCE.get(y_ref.dtype, 2e-2)
    s_tol = STATE_TOLERANCE.get(y_ref.dtype, 1e-3)
    return (y_err <= y_tol and s_err <= s_tol), max(y_err, s_err)


def _fuzz(rng):
    """A random call the kernel takes: batch, tokens, heads, head dims, dtypes, a state or none."""
    dtypes = KERNEL_DTYPES
    pick = lambda: dtypes[int(rng.integers(len(dtypes)))]  # noqa: E731
    B = int(rng.choice([1, 1, 2]))
    T = int(rng.choice([1, int(rng.integers(2, 33)), int(rng.integers(33, 80))]))
    Hk = int(rng.integers(1, 5))
    Hv = Hk * int(rng.integers(1, 4))
    Dk = int(rng.choice([32, 64, 128, 256]))
    Dv = int(rng.choice([1, 8, 16, 32, 48, 128]))
    in_dtype, gate_dtype = pick(), pick()
    normal = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    q, k = normalize_qk(
        normal(B, T, Hk, Dk).astype(in_dtype), normal(B, T, Hk, Dk).astype(in_dtype),
        inv_scale=Dk**-0.5, eps=1e-6,
    )
    v = normal(B, T, Hv, Dv).astype(in_dtype)
    a, b = normal(B, T, Hv).astype(gate_dtype), normal(B, T, Hv).astype(gate_dtype)
    A_log = mx.log(mx.array(rng.uniform(1, 16, (Hv,)).astype(np.float32))).astype(pick())
    dt_bias = mx.array(rng.uniform(0.5, 1.5, (Hv,)).astype(np.float32)).astype(pick())
    state = 0.1 * normal(B, Hv, Dv, Dk) if rng.random() < 0.5 else None
    return (q, k, v, a, b, A_log, dt_bias, state), {}


gated_delta_kernel = Kernel(
    name="gated_delta",
    input_names=("q", "k", "v", "a", "b", "A_log", "dt_bias", "state_in"),
    output_names=("y", "state_out"),
    body="gated_delta.metal",
    launch=_launch_gated_delta,
    reference=gated_delta_reference,
    sample=_sample_recurrence,
    agree=gated_delta_agree,
)


l2norm_qk = register(
    LilyOp("l2norm_qk", l2norm_qk_reference, description="q/k L2 norm with readout scale")
)
l2norm_qk.sample = _sample_qk

gated_delta = register(
    LilyOp(
        "gated_delta",
        gated_delta_reference,
        kernel=gated_delta_kernel,
        supports=gated_delta_supports,
        description="gated delta-rule recurrence",
        sample=_sample_recurrence,
        compare=gated_delta_compare,
        fuzz=_fuzz,
    )
)
