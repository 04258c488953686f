"""Gated DeltaNet: q/k L2 normalisation and the gated delta-rule recurrence.

Per value head, with an fp32 state S (Dv x Dk) and gates g and beta:
``S <- g * S; d <- (v - S k) * beta; S <- S + d k^T; y <- S q``. The
reference is mlx-lm's own ``gated_delta_update``, so the reference path is
stock. The sequential kernel (``gated_delta.metal``) runs the whole
recurrence, gates included, in one dispatch; long bf16 calls run the chunked
form on matrix tiles instead.

The gates, padding masks, the chunked form's threshold, the kernel's launch
and its contract (``gated_delta_agree``): docs/kernel-notes.md#gated-delta-recurrence.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

from ..._notice import notice_once
from ...toolchain.registry import LilyOp, register
from ...toolchain.kernel import Kernel, KernelGroup, Launch, SIMD_WIDTH
from .chunked import (
    CHUNKED_KERNELS,
    chunked_supports,
    gated_delta_chunked_run,
    piece_end,
)

# Calls of at least this many tokens (one whole chunk) take the chunked
# kernels; shorter ones (decode, short prompts) the sequential scan. Speed
# alone would start at 192 (H200, real shapes, bench/diagnostics/
# gated_delta_chunked.py: the sequential scan 0.18 ms up to 128 tokens, the
# chunked passes 0.20; 0.82 vs 1.7 ms at 2048), but then a call of 64 to 191
# tokens rounds unlike the same tokens inside a longer call, and prefix reuse
# needs every call from one chunk on to give the bits of the longer call it
# could be part of (docs/prefix-reuse.md): at most 0.02 ms a layer.
CHUNKED_FROM = 64
# The chunked kernels multiply bf16 tiles: they take bf16 activations (the
# model's), whose q, k and v are then exact operands. Calls in fp16 or fp32
# keep the sequential kernel and its fp32-level agreement.
CHUNKED_DTYPES = (mx.bfloat16,)


def l2norm_qk_reference(q: mx.array, k: mx.array, inv_scale: float, eps: float = 1e-6):
    return normalize_qk(q, k, inv_scale=inv_scale, eps=eps)


def gated_delta_reference(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, capture: bool = False):
    """q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; a, b [B, T, Hv]; mask [B, T] -> (y, state),
    with ``capture`` (y, state, the state after the call's whole chunks: ``with_piece_state``).

    Stock's ``gated_delta_update``: on the reference path lily and stock agree
    to the bit (bench's numerics rely on it). ``gated_delta_chunked_reference``
    is the same rule in chunks (within ~1e-6 in fp32, no per-token loop); it
    is not the CPU path because on a CPU it is no faster (2 cores, the real
    head shapes, 2048 tokens: 7.3 s against the loop's 5.2 s).
    """
    if capture:
        return with_piece_state(gated_delta_update, q, k, v, a, b, A_log, dt_bias, state, mask)
    return gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, mask)


def with_piece_state(scan, q, k, v, a, b, A_log, dt_bias, state=None, mask=None):
    """(y, state, the state after ``piece_end(T)`` tokens) from a token-by-token
    ``scan`` (the reference or the sequential kernel: cutting one changes no
    bit), run as two calls cut there. Prefix reuse keeps that state as a
    checkpoint (docs/prefix-reuse.md). Before a whole chunk the state is the
    incoming one (zeros for none)."""
    T = q.shape[1]
    cut = piece_end(T)
    if cut in (0, T):
        y, out = scan(q, k, v, a, b, A_log, dt_bias, state, mask)
        if cut == T:
            return y, out, out
        B, Hv, Dv, Dk = q.shape[0], v.shape[2], v.shape[3], q.shape[3]
        return y, out, state if state is not None else mx.zeros((B, Hv, Dv, Dk), mx.float32)
    head = [x[:, :cut] for x in (q, k, v, a, b)]
    tail = [x[:, cut:] for x in (q, k, v, a, b)]
    y1, at_cut = scan(*head, A_log, dt_bias, state, None if mask is None else mask[:, :cut])
    y2, out = scan(*tail, A_log, dt_bias, at_cut, None if mask is None else mask[:, cut:])
    return mx.concatenate([y1, y2], axis=1), out, at_cut


def _sample_recurrence(B=1, T=5, Hk=2, Hv=4, Dk=32, Dv=16, seed=5):
    keys = mx.random.split(mx.random.key(seed), 6)
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

# SIMD groups per threadgroup. Rows are numbered batch, head, dv, so with Dv
# a multiple of 4 a threadgroup's rows share one head's q and k in cache; four
# (of one row each) keep the real decode shape (32 heads x 128 rows) at 1024
# threadgroups, enough to fill a large GPU.
SIMDGROUPS_PER_THREADGROUP = 4
# Each lane keeps Dk * ROWS / 32 state entries, and as many of q and k
# (current and next token), in registers: 8 per lane bounds that at 40 floats.
MAX_KEYS_PER_LANE = 8
# State rows per SIMD group (the body's ROWS): 1, 2 or 4, where Dk and Dv
# allow it (``rows_per_simdgroup``). One row is what the H200 measured (the
# most SIMD groups in flight); more rows, with shorter sums, is the shape of
# Apple GPUs' scans, not measured on one yet: ``python -m
# bench.diagnostics.gated_delta_chunked`` times each choice.
ROW_CHOICES = (1, 2, 4)
SEQUENTIAL_ROWS = 1
MAX_DK = SIMD_WIDTH * MAX_KEYS_PER_LANE
KERNEL_DTYPES = (mx.bfloat16, mx.float16, mx.float32)
# The body indexes with 32-bit unsigned integers.
MAX_ELEMENTS = 2**31


def gated_delta_supports(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, capture=False) -> Optional[str]:
    """None when the kernel takes this call, else why not (``capture`` takes any call)."""
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
    if mask is not None and (tuple(mask.shape) != (B, T) or mask.dtype != mx.bool_):
        return f"mask {tuple(mask.shape)} {mask.dtype} (kernel: [B, T] = {(B, T)} bool)"
    if max(q.size, v.size, B * Hv * Dv * Dk) >= MAX_ELEMENTS:
        return f"too large for 32-bit indexing: q {tuple(q.shape)}, v {tuple(v.shape)}"
    return None


def rows_per_simdgroup(Dk: int, Dv: int, wanted: int = SEQUENTIAL_ROWS) -> int:
    """The most state rows per SIMD group, up to ``wanted``, that Dk (a
    multiple of 32 / rows, at most MAX_KEYS_PER_LANE entries per lane) and Dv
    (a multiple of rows) allow."""
    rows = 1
    for r in ROW_CHOICES:
        if r <= wanted and Dk % (SIMD_WIDTH // r) == 0 and Dk * r <= SIMD_WIDTH * MAX_KEYS_PER_LANE and Dv % r == 0:
            rows = r
    return rows


def _launch_gated_delta(q, k, v, a, b, A_log, dt_bias, state=None, mask=None,
                        rows: int = SEQUENTIAL_ROWS) -> Launch:
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    rows_per_group = rows_per_simdgroup(Dk, Dv, rows)
    groups = B * Hv * Dv // rows_per_group
    has_state, has_mask = state is not None, mask is not None
    # Without a state (mask) the body never reads state_in (mask): a
    # one-element stand-in.
    state_in = state if has_state else mx.zeros((1,), mx.float32)
    mask_in = mask if has_mask else mx.zeros((1,), mx.bool_)
    return Launch(
        inputs=[q, k, v, a, b, A_log.reshape(Hv), dt_bias.reshape(Hv), state_in, mask_in],
        grid=(groups * SIMD_WIDTH, 1, 1),
        threadgroup=(min(SIMDGROUPS_PER_THREADGROUP, groups) * SIMD_WIDTH, 1, 1),
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
            ("HAS_MASK", has_mask),
            ("ROWS", rows_per_group),
        ],
        finish=lambda outputs: (outputs[0], outputs[1]),
    )


# How far the kernel may be from the reference: max |kernel - reference| over
# max |reference|, for y by the coarsest of the activations' and the gates'
# dtypes and for the state by the gates' inputs' (the coarsest of a, b and
# dt_bias).
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
# (simulated on a CPU): y at most 1.3e-2, state 7.6e-3. y inherits that
# rounding whatever its own dtype: with bf16 gates and fp32 or fp16
# activations, y sat up to 7e-3 from that reference (the H200's fuzzing found
# it), so y's bound is by the coarsest of the activations' and gates' dtypes.
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


def gated_delta_agree(
    got, want, q, k, v, a, b, A_log, dt_bias, state=None, mask=None
) -> Optional[str]:
    """None when (y, state) from the kernel meet the op's contract, else the breach."""
    (y, s), (y_ref, s_ref) = got, want
    if y.shape != y_ref.shape or y.dtype != y_ref.dtype:
        return f"y {tuple(y.shape)} {y.dtype} vs reference {tuple(y_ref.shape)} {y_ref.dtype}"
    if mask is not None:  # y at masked steps is outside the contract
        y, y_ref = (mx.where(mask[..., None, None], t, 0) for t in (y, y_ref))
    if s.shape != s_ref.shape or s.dtype != mx.float32:
        return f"state {tuple(s.shape)} {s.dtype} vs reference {tuple(s_ref.shape)} float32"
    # y carries the gates' rounding too: by the coarsest of its inputs' dtypes.
    y_err = _relative_error(y, y_ref)
    y_tol = Y_TOLERANCE.get(_coarser(q.dtype, a.dtype, b.dtype, dt_bias.dtype), 2e-2)
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
    input_names=("q", "k", "v", "a", "b", "A_log", "dt_bias", "state_in", "mask"),
    output_names=("y", "state_out"),
    body=Path(__file__).with_name("gated_delta.metal"),
    launch=_launch_gated_delta,
    reference=gated_delta_reference,
    sample=_sample_recurrence,
    agree=gated_delta_agree,
)


def _sample_chunked():
    """Two chunks of 64 (the second partial), GQA, an incoming state: bf16 as the model runs."""
    return _sample_recurrence(B=1, T=64 + 9, Hk=1, Hv=2, Dk=64, Dv=32, seed=6)


def uses_chunked(q, k, v, a, b, A_log, dt_bias, state=None) -> Optional[str]:
    """None when a call the sequential kernel takes goes to the chunked kernels."""
    if q.shape[1] < CHUNKED_FROM:
        return f"T={q.shape[1]} < CHUNKED_FROM={CHUNKED_FROM}"
    if q.dtype not in CHUNKED_DTYPES:
        return f"q/k/v dtype {q.dtype} (chunked kernels: bfloat16)"
    return chunked_supports(q, k, v, a, b, A_log, dt_bias, state)


class GatedDeltaKernels(KernelGroup):
    """The op's kernels: the sequential scan (``gated_delta_kernel``, also the
    oracle) and, for calls from CHUNKED_FROM tokens, the chunked passes on
    matrix tiles. The op is ready when the sequential kernel passed its
    self-check; the chunked passes are checked once per backend, on their own
    sample against the reference, at their first call, and if they fail (or
    do not build) every call keeps the sequential kernel, with one notice.
    """

    def __init__(self, sequential: Kernel):
        self.sequential = sequential
        self.reference = sequential.reference
        self.sample = sequential.sample
        self.agree = sequential.agree
        self._chunked_checked: dict = {}

    def ready_on(self, backend: str) -> tuple[bool, str]:
        return self.sequential.ready_on(backend)

    def chunked_ready_on(self, backend: str) -> tuple[bool, str]:
        known = self._chunked_checked.get(backend)
        if known is None:
            known = self._chunked_self_check(backend)
            self._chunked_checked[backend] = known
            if not known[0]:
                notice_once(
                    f"kernel-off:gated_delta_chunked:{backend}",
                    f"chunked gated_delta kernels are off on {backend} ({known[1]}); "
                    "long calls run the sequential kernel",
                )
        return known

    def _chunked_self_check(self, backend: str) -> tuple[bool, str]:
        args, _ = _sample_chunked()
        try:
            got = gated_delta_chunked_run(backend, *args)
            mx.eval(got)
        except Exception as exc:  # a build or compile failure surfaces at eval
            return False, f"{backend} chunked kernels failed to run: {type(exc).__name__}: {exc}"[:400]
        want = gated_delta_reference(*args)
        mismatch = gated_delta_agree(got, want, *args)
        if mismatch is not None:
            return False, f"{backend} chunked self-check disagrees with the reference: {mismatch}"
        return True, f"{backend} chunked kernels, self-check passed"

    def path_for(self, backend: str, *args, mask=None, capture=False) -> str:
        """'chunked' or 'sequential': which kernels this call runs.

        Padded batches (a mask) keep the sequential kernel: the chunked passes
        have no masked steps."""
        if len(args) > 8:
            args, mask = args[:8], args[8]
        if mask is None and uses_chunked(*args) is None and self.chunked_ready_on(backend)[0]:
            return "chunked"
        return "sequential"

    def _chunked(self, backend: str, args, capture: bool):
        out = gated_delta_chunked_run(backend, *args[:8], capture=capture)
        if capture and piece_end(args[0].shape[1]) == args[0].shape[1]:
            out = (out[0], out[1], out[1])  # the pass gave the last chunk's start
        return out

    def run_on(self, backend: str, *args, capture: bool = False, **kwargs):
        """``capture``: also the state after the call's whole chunks (``with_piece_state``)."""
        if self.path_for(backend, *args, **kwargs) == "chunked":
            return self._chunked(backend, args, capture)
        if not capture:
            return self.sequential.run_on(backend, *args, **kwargs)
        return with_piece_state(lambda *call: self.sequential.run_on(backend, *call), *args, **kwargs)

    def run_checked(self, backend: str, *args, capture: bool = False, **kwargs):
        """As the op's registry asks: the chunked passes were checked as a
        whole at their first call; the sequential kernel checks each of its
        instantiations at its first use."""
        if self.path_for(backend, *args, **kwargs) == "chunked":
            return self._chunked(backend, args, capture), None
        if not capture:
            return self.sequential.run_checked(backend, *args, **kwargs)
        why_not = []

        def scan(*call):
            out, why = self.sequential.run_checked(backend, *call)
            why_not.append(why)
            return out

        out = with_piece_state(scan, *args, **kwargs)
        return out, next((w for w in why_not if w is not None), None)

    def forget(self) -> None:
        self.sequential.forget()
        for kernel in CHUNKED_KERNELS:
            kernel.forget()
        self._chunked_checked.clear()


gated_delta_kernels = GatedDeltaKernels(gated_delta_kernel)


gated_delta = register(
    LilyOp(
        "gated_delta",
        gated_delta_reference,
        kernel=gated_delta_kernels,
        supports=gated_delta_supports,
        description="gated delta-rule recurrence",
        sample=_sample_recurrence,
        compare=gated_delta_compare,
        fuzz=_fuzz,
    )
)
