"""Quantized matrix-vector products for decode, with fused prologues and
merged projections::

    quantized_matvec(x, weights, norm_weight=None, eps=0.0, gate=None, residual=None)
        -> tuple of S arrays [B, 1, N_s]

One decode token's (of each of B <= MAX_BATCH sequences) dense projections
that read the same input, in ONE dispatch that reads each weight once for
all B rows, with the input's RMSNorm or attention's sigmoid output gate inside
the kernel and the residual add as its epilogue. The reference is stock
mlx-lm's op sequence, to the bit. The arguments, what the kernel takes, and
the contract (``quantized_matvec_agree``): docs/kernel-notes.md#gemv.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from ...toolchain.kernel import Kernel, Launch, SIMD_WIDTH
from ...toolchain.registry import LilyOp, gpu_backend, register
from ..dtypes import ACTIVATION_DTYPES, STEP, activation_dtype_reason

GROUP_SIZE = 64
KERNEL_BITS = (4, 8)
MAX_SEGMENTS = 4
# Rows of x (sequences, one token each) per launch: the body keeps MAX_BATCH
# accumulators per weight row in registers.
MAX_BATCH = 16
# Builds by batch: the body's BATCH is B's bucket (the smallest >= B) and B
# reaches it at run time (layout[8]), so a server meeting every B from 1 to 16
# builds each call shape 5 times, not 16 (each a few seconds of NVRTC on CUDA).
BATCH_BUCKETS = (1, 2, 4, 8, 16)
# One row's prologue output fits threadgroup memory as XT: K bf16 values
# (16 KiB at 8192) or K floats (16 KiB at 4096) with an fp32 norm weight.
MAX_K = 8192
MAX_K_FLOAT = 4096
# Each row's prologue output (xin) is staged in threadgroup memory, as XT: the
# whole of K for all of the bucket's rows where BATCH x K values fit this
# budget (one row always does: MAX_K), else K in tiles of tile_values(bucket,
# XT) = STAGED_X_BYTES / (BATCH x its size) values per row (1024 bf16 values
# at 8 rows, 512 at 16), computed by the whole threadgroup a tile at a time;
# more (e.g. 16 rows at K = 2048) would cost occupancy or exceed Metal's 32
# KiB. Every form gives each lane the same chunks in the same order: the same
# bits.
STAGED_X_BYTES = 16384
# Tile sizes the body takes (values of each row): 256 and 512 (halves of each
# 32-value run of 512 or 1024 values, so that every lane of a 4-bit step
# works), or multiples of 1024 (a 4-bit step's values).
MIN_TILE = 256
# Rows per SIMD group (the body's ROWS) and SIMD groups per threadgroup
# (None: NSG_FOR_BLOCKS). On CUDA by the call's total rows: the merged input
# projections (thousands of rows) take 4 rows per SIMD group; the output
# projections (about 2K rows) 2 rows and 8 SIMD groups; the router with the
# shared gate (a few hundred) 1 row and 16, so that their few rows still
# spread over the GPU. From the kernels' device times on the H200
# (gemv_sweep --device-time, bench/results/2026-11-30-nvidia-h200-ee721d4d52):
# router 17.4 -> 11.2 us, out_proj 14.6 -> 12.2, o_proj 23.4 -> 17.1. Metal
# keeps 4 rows (not measured there). The launcher takes other choices (the
# sweep times them all). 8 rows spill a lane's double-buffered words to local
# memory on CUDA (nvcc, sm_90).
ROWS_CHOICES = (1, 2, 4)
DEFAULT_LAUNCH = (4, None)
CUDA_LAUNCH_FOR_ROWS = ((4096, 4, None), (1024, 2, 8), (0, 1, 16))
# A lane holds BATCH x ROWS fp32 accumulators. On Metal large buckets take
# fewer rows per SIMD group, at most MAX_ACCUMULATORS a lane (not measured
# there). On CUDA every bucket keeps the B = 1 rows: nvcc (sm_90) leaves the
# accumulators past 16 in local memory, yet at 16 rows of x the merged input
# projections ran 168.8 us at 4 rows a SIMD group against 263.6 at 1, the
# output projections 48.3 against 67.2, and at 8 rows of x within 1% either
# way (gemv_sweep --device-time --batch 4/8/16 on the H200,
# bench/results/2026-12-02-nvidia-h200-23957b8951). Either way a weight
# row's dot product is the same lanes' in the same order whatever ROWS is,
# and NSG stays the B = 1 launch's (it orders the norm's sum of squares):
# the same bits.
MAX_ACCUMULATORS = 16
# The body indexes with 32-bit unsigned integers.
MAX_WORDS = 2**31
# Occupancy targets for the SIMD groups per threadgroup: big calls (lm_head,
# DeltaNet's qkv) take 8 (256 threads: the prologue's reads of x and the norm
# weight are shared by 32 rows), smaller ones fewer, so that their few row
# blocks still spread over the GPU's SMs.
NSG_FOR_BLOCKS = ((2048, 8), (512, 4), (0, 2))

_NONE = 0
_NORM = 1
_GATE = 2


# -- reference -------------------------------------------------------------------


def _bits_and_group(x: mx.array, w: mx.array, scales: mx.array) -> tuple[int, int]:
    K = x.shape[-1]
    return w.shape[-1] * 32 // K, K // scales.shape[-1]


def _input_dtype(x, norm_weight) -> mx.Dtype:
    """The matmuls' input (and output) dtype: x's, or rms_norm's result
    (x's dtype promoted with the weight's: fp32 with an fp32 weight)."""
    return x.dtype if norm_weight is None else mx.result_type(x.dtype, norm_weight.dtype)


def prologue_reference(x, norm_weight=None, eps=0.0, gate=None):
    """The matmuls' input as stock computes it."""
    if norm_weight is not None:
        return mx.fast.rms_norm(x, norm_weight, eps)
    if gate is not None:
        return x * mx.sigmoid(gate.reshape(x.shape))
    return x


def quantized_matvec_reference(x, weights, norm_weight=None, eps=0.0, gate=None, residual=None):
    """x [B, 1, K], weights: S triples (w, scales, biases) -> S arrays [B, 1, N_s].

    Stock's sequence: the norm (``mx.fast.rms_norm``) or the output gate
    (``x * mx.sigmoid(gate)``), ``mx.quantized_matmul`` per projection, and
    ``residual + y`` (segment 0 only).
    """
    xin = prologue_reference(x, norm_weight, eps, gate)
    outs = []
    for w, scales, biases in weights:
        bits, group = _bits_and_group(x, w, scales)
        outs.append(
            mx.quantized_matmul(
                xin, w, scales=scales, biases=biases, transpose=True, group_size=group, bits=bits
            )
        )
    if residual is not None:
        outs[0] = residual + outs[0]
    return tuple(outs)


# -- which calls the kernel takes -------------------------------------------------


def quantized_matvec_supports(
    x, weights, norm_weight=None, eps=0.0, gate=None, residual=None
) -> Optional[str]:
    """None when the kernel takes this call, else why not."""
    if x.ndim != 3 or x.shape[1] != 1 or x.shape[0] == 0:
        return f"x {tuple(x.shape)} (kernel: [B, 1, K], one token of each of B sequences)"
    B = x.shape[0]
    if B > MAX_BATCH:
        return f"x {tuple(x.shape)}: B={B} rows (kernel: at most {MAX_BATCH})"
    if x.dtype not in ACTIVATION_DTYPES:
        return activation_dtype_reason("x", x.dtype)
    K = x.shape[-1]
    if K == 0 or K % GROUP_SIZE:
        return f"K={K} (kernel: a positive multiple of {GROUP_SIZE})"
    if not isinstance(weights, (tuple, list)) or not 1 <= len(weights) <= MAX_SEGMENTS:
        n = len(weights) if isinstance(weights, (tuple, list)) else type(weights).__name__
        return f"{n} projections (kernel: 1 to {MAX_SEGMENTS} triples (w, scales, biases))"
    for s, triple in enumerate(weights):
        if not isinstance(triple, (tuple, list)) or len(triple) != 3 or any(a is None for a in triple):
            return f"projection {s}: not a triple (w, scales, biases) (kernel: affine, biases given)"
        w, scales, biases = triple
        if w.ndim != 2 or w.dtype != mx.uint32:
            return f"projection {s}: w {tuple(w.shape)} {w.dtype} (kernel: uint32 [N, K * bits / 32])"
        N = w.shape[0]
        if N == 0 or (w.shape[1] * 32) % K:
            return f"projection {s}: w {tuple(w.shape)} for K={K}"
        bits = w.shape[1] * 32 // K
        if bits not in KERNEL_BITS:
            return f"projection {s}: {bits}-bit (kernel: 4 or 8)"
        for name, a in (("scales", scales), ("biases", biases)):
            if tuple(a.shape) != (N, K // GROUP_SIZE):
                return f"projection {s}: {name} {tuple(a.shape)} (kernel: group {GROUP_SIZE}, [{N}, {K // GROUP_SIZE}])"
            if a.dtype != x.dtype:
                return f"projection {s}: {name} dtype {a.dtype} (kernel: x's, {x.dtype})"
        if N * w.shape[1] >= MAX_WORDS:
            return f"projection {s}: too large for 32-bit indexing"
    if norm_weight is not None and gate is not None:
        return "both a norm and a gate prologue (kernel: at most one)"
    limit = MAX_K
    if norm_weight is not None:
        if tuple(norm_weight.shape) != (K,):
            return f"norm_weight {tuple(norm_weight.shape)} (kernel: [{K}])"
        if norm_weight.dtype not in (x.dtype, mx.float32):
            return f"norm_weight dtype {norm_weight.dtype} (kernel: x's, {x.dtype}, or float32)"
        if _input_dtype(x, norm_weight) == mx.float32:
            limit = MAX_K_FLOAT
    if K > limit:
        return f"K={K} (kernel: at most {limit})"
    if gate is not None:
        if gate.dtype != x.dtype:
            return f"gate dtype {gate.dtype} (kernel: x's, {x.dtype})"
        if gate.ndim == 3:
            if tuple(gate.shape) != (B, 1, K):
                return f"gate {tuple(gate.shape)} (kernel: [{B}, 1, {K}] or [{B}, 1, G, D], G * D = {K})"
        elif gate.ndim != 4 or tuple(gate.shape[:2]) != (B, 1) or gate.shape[2] * gate.shape[3] != K:
            return f"gate {tuple(gate.shape)} (kernel: [{B}, 1, G, D], G * D = {K})"
    if residual is not None:
        if len(weights) != 1:
            return f"a residual with {len(weights)} projections (kernel: one)"
        N = weights[0][0].shape[0]
        if tuple(residual.shape) != (B, 1, N):
            return f"residual {tuple(residual.shape)} (kernel: [{B}, 1, {N}])"
        if residual.dtype != x.dtype:
            return f"residual dtype {residual.dtype} (kernel: x's, {x.dtype})"
    return None


# -- launch -------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _dummies() -> tuple:
    """Stand-ins for the prologue's and epilogue's inputs where a call has
    none (segments past S are left out instead: ``_STAND_INS``)."""
    return (
        mx.zeros((8,), mx.bfloat16),  # norm_weight
        mx.zeros((1, 1, 1, 1), mx.bfloat16),  # gate
        mx.zeros((1, 1, 1), mx.bfloat16),  # residual
    )


@functools.lru_cache(maxsize=256)
def _layout(rows: tuple, per_block: int, batch: int) -> mx.array:
    """Per segment: end in row blocks (of ``per_block`` rows), rows (4
    each); then the rows of x, B (the body's runtime row count)."""
    ends, blocks = [], 0
    for n in rows:
        blocks += -(-n // per_block)
        ends.append(blocks)
    pad = MAX_SEGMENTS - len(rows)
    return mx.array(ends + [blocks] * pad + list(rows) + [0] * pad + [batch], dtype=mx.uint32)


@functools.lru_cache(maxsize=64)
def _scalars(eps: float) -> mx.array:
    return mx.array([eps], dtype=mx.float32)


def call_inputs(x, weights, norm_weight, eps, gate, residual, layout: mx.array) -> tuple:
    """(inputs in INPUT_NAMES order, prologue, XT, OutT) of a call, as both
    GEMV bodies take it: S segments' arrays, dummies for an absent norm
    weight, gate or residual, the gate as [B, 1, G, D]."""
    B, K = x.shape[0], x.shape[-1]
    dummy_h, dummy_gate, dummy_res = _dummies()
    prologue = _NORM if norm_weight is not None else (_GATE if gate is not None else _NONE)
    XT = _input_dtype(x, norm_weight)
    OutT = XT if residual is None else mx.result_type(residual.dtype, XT)  # residual + XT
    inputs = [x]
    for w in weights:
        inputs.extend(w)
    if gate is not None and gate.ndim == 3:
        gate = gate.reshape(B, 1, 1, K)
    inputs += [
        norm_weight if norm_weight is not None else dummy_h,
        gate if gate is not None else dummy_gate,
        residual if residual is not None else dummy_res,
        layout,
        _scalars(float(eps)),
    ]
    return inputs, prologue, XT, OutT


def simdgroups_for(blocks: int) -> int:
    for at_least, nsg in NSG_FOR_BLOCKS:
        if blocks >= at_least:
            return nsg
    return NSG_FOR_BLOCKS[-1][1]


def batch_bucket(batch: int) -> int:
    """The body's BATCH for B rows of x: the smallest of BATCH_BUCKETS >= B."""
    for bucket in BATCH_BUCKETS:
        if batch <= bucket:
            return bucket
    raise ValueError(f"B={batch} rows (kernel: at most {MAX_BATCH})")


def launch_choice(total_rows: int, backend: Optional[str], batch: int = 1) -> tuple:
    """(rows per SIMD group, SIMD groups per threadgroup or None for
    NSG_FOR_BLOCKS) for a call of this many rows on ``backend``, at B =
    ``batch`` rows of x: the B = 1 choice, on Metal with at most
    MAX_ACCUMULATORS / bucket rows per SIMD group."""
    rows, nsg = DEFAULT_LAUNCH
    if backend == "cuda":
        return next(((r, n) for at_least, r, n in CUDA_LAUNCH_FOR_ROWS if total_rows >= at_least),
                    CUDA_LAUNCH_FOR_ROWS[-1][1:])
    return min(rows, max(1, MAX_ACCUMULATORS // batch_bucket(batch))), nsg


def single_row_simdgroups(rows: Sequence[int], backend: Optional[str]) -> int:
    """SIMD groups per threadgroup of the B = 1 launch for segments of
    ``rows`` weight rows on ``backend``: the default at every B, and the
    SIMD groups that sum the norm prologue's squares (NORM_SG) whatever the
    launch. (The MoE decode router launch sums its norm by them too, so
    that its router logits are this GEMV's bits.)"""
    per_block, chosen = launch_choice(sum(rows), backend)
    if chosen is not None:
        return chosen
    return simdgroups_for(sum(-(-n // per_block) for n in rows))


def stages_x(batch: int, K: int, xin_dtype: mx.Dtype) -> bool:
    """Whether the body holds all rows' whole xin in threadgroup memory at
    once (sized for the bucket's rows: the body's array is BATCH * K), rather
    than K in tiles."""
    return batch_bucket(batch) * K * xin_dtype.size <= STAGED_X_BYTES


def tile_values(batch: int, xin_dtype: mx.Dtype) -> int:
    """Values of K per tile for B rows where the whole does not fit: the
    budget's share of each of the bucket's rows (a power of two, 256 to
    8192)."""
    return STAGED_X_BYTES // (batch_bucket(batch) * xin_dtype.size)


def valid_tile(tile: int) -> bool:
    """A TILE the body takes (below K): 256, 512, or a multiple of 1024."""
    return tile in (MIN_TILE, 2 * MIN_TILE) or (tile > 0 and tile % 1024 == 0)


def _launch(x, weights, norm_weight=None, eps=0.0, gate=None, residual=None, *,
            rows_per_simdgroup: Optional[int] = None, simdgroups: Optional[int] = None,
            stage_x: Optional[bool] = None, tile: Optional[int] = None) -> Launch:
    """The call's launch; ``rows_per_simdgroup`` (ROWS_CHOICES) and
    ``simdgroups`` (per threadgroup, 1-32) are tuning choices (default:
    ``launch_choice``; given rows without simdgroups, NSG_FOR_BLOCKS); so
    are ``stage_x`` (True: the whole of K staged at once, where it fits;
    False: K in tiles even where the whole fits) and ``tile`` (values of K
    per tile, ``valid_tile``, within the budget; default ``tile_values``).
    None of them changes a row's sums, so each row is the same bits whatever
    B is (batch invariance): a weight row's dot product is the same lanes'
    in the same order whatever the rows per SIMD group (which the default
    on Metal lowers for large buckets, MAX_ACCUMULATORS) or the SIMD groups, every
    tile form multiplies a lane's chunks in the same order, and the norm's
    sum of squares is ordered by the B = 1 launch's SIMD groups (NORM_SG)
    whatever the launch's, so more SIMD groups (sharing the staging of x
    among more weight rows, for large B) give the same bits. Fewer than the
    B = 1 launch's sum the squares in fewer, another order."""
    B, K = x.shape[0], x.shape[-1]
    bucket = batch_bucket(B)
    rows = tuple(int(w.shape[0]) for w, _, _ in weights)
    blocks_of = lambda per_block: sum(-(-n // per_block) for n in rows)  # noqa: E731
    # The B = 1 launch's SIMD groups: the default at every B, and what orders
    # the norm's sum of squares (NORM_SG) whatever the launch.
    single_nsg = single_row_simdgroups(rows, gpu_backend())
    if rows_per_simdgroup is None:
        rows_per_simdgroup, _ = launch_choice(sum(rows), gpu_backend(), B)
        if simdgroups is None:
            simdgroups = single_nsg
    if rows_per_simdgroup not in ROWS_CHOICES:
        raise ValueError(f"rows_per_simdgroup {rows_per_simdgroup}: one of {ROWS_CHOICES}")
    S = len(weights)
    bits = [int(w.shape[1]) * 32 // K for w, _, _ in weights]
    blocks = blocks_of(rows_per_simdgroup)
    nsg = simdgroups_for(blocks) if simdgroups is None else int(simdgroups)
    if not 1 <= nsg <= 32:
        raise ValueError(f"simdgroups {nsg}: 1 to 32")
    threadgroups = -(-blocks // nsg)
    inputs, prologue, XT, OutT = call_inputs(
        x, weights, norm_weight, eps, gate, residual, _layout(rows, rows_per_simdgroup, B))
    fits = stages_x(B, K, XT)
    if stage_x and not fits:
        raise ValueError(f"stage_x: {bucket} rows (B={B}'s bucket) of K={K} {XT} exceed {STAGED_X_BYTES} bytes")
    if tile is not None and (stage_x or not valid_tile(tile) or bucket * tile * XT.size > STAGED_X_BYTES):
        raise ValueError(f"tile {tile}: 256, 512 or a multiple of 1024, {bucket} rows of it within "
                         f"{STAGED_X_BYTES} bytes, and not with stage_x")
    whole = stage_x if stage_x is not None else (fits and tile is None)
    staged = K if whole else (tile or tile_values(B, XT))
    return Launch(
        inputs=inputs,
        grid=(threadgroups * nsg * SIMD_WIDTH, 1, 1),
        threadgroup=(nsg * SIMD_WIDTH, 1, 1),
        output_shapes=[(B, 1, rows[s]) for s in range(S)],
        output_dtypes=[OutT] * S,
        template=[
            ("XT", XT),
            ("OutT", OutT),
            ("K", K),
            ("S", S),
            *((f"BITS{s}", bits[s] if s < S else 0) for s in range(MAX_SEGMENTS)),
            ("NSG", nsg),
            ("NORM_SG", min(nsg, single_nsg)),
            ("ROWS", rows_per_simdgroup),
            ("PROLOGUE", prologue),
            ("RESIDUAL", residual is not None),
            ("BATCH", bucket),
            ("TILE", min(staged, K)),
        ],
        finish=tuple,
        absent=_ABSENT[S],
    )


# -- contract -----------------------------------------------------------------------


def _f64(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


def _abs_sums(xin_abs, w, scales, biases, bits, group, chunk_values=2**24):
    """sum_k |w_k| |xin_k| per row in fp32, dequantizing a few rows at a time
    (at most chunk_values weights: lm_head's would take 2 GB at once)."""
    K = xin_abs.shape[-1]
    columns = xin_abs.reshape(-1, K).T  # [K, B]
    step = max(1, chunk_values // K)
    parts = []
    for r in range(0, w.shape[0], step):
        dense = mx.dequantize(
            w[r : r + step], scales[r : r + step].astype(mx.float32), biases[r : r + step].astype(mx.float32),
            group_size=group, bits=bits,
        )
        parts.append(mx.abs(dense) @ columns)
        mx.eval(parts[-1])
    return mx.concatenate(parts).T  # [B, N]


def precise_reference(x, weights, norm_weight=None, eps=0.0, gate=None, residual=None):
    """The reference's outputs with its matmuls summed in fp32 (what MLX's GPU
    kernels compute; its CPU kernel sums bf16 inputs in bf16), and per
    segment, per row, (the sum_k |w_k xin_k|, the matmul's own rounded rows):
    for stock's own matmul input xin (the reference's prologue, rounded as
    stock rounds it)."""
    xin = prologue_reference(x, norm_weight, eps, gate)
    xin32 = xin.astype(mx.float32)
    outs, sizes = [], []
    for s, (w, scales, biases) in enumerate(weights):
        bits, group = _bits_and_group(x, w, scales)
        rows = mx.quantized_matmul(
            xin32, w, scales=scales.astype(mx.float32), biases=biases.astype(mx.float32),
            transpose=True, group_size=group, bits=bits,
        ).astype(xin.dtype)
        outs.append(residual + rows if s == 0 and residual is not None else rows)
        sizes.append((_abs_sums(mx.abs(xin32), w, scales, biases, bits, group).reshape(rows.shape), rows))
    return tuple(outs), sizes


def quantized_matvec_agree(got, want, x, weights, norm_weight=None, eps=0.0, gate=None, residual=None) -> Optional[str]:
    """None when the kernel's outputs meet the contract (module docstring),
    else which segment is off and by how much. ``want`` (the reference's
    result) gives the shapes and dtypes; the values are judged against
    ``precise_reference``."""
    if len(got) != len(want):
        return f"{len(got)} outputs (reference: {len(want)})"
    expected, sizes = precise_reference(x, weights, norm_weight, eps, gate, residual)
    for s, (g, w, e, (sums, rows)) in enumerate(zip(got, want, expected, sizes)):
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"segment {s}: {tuple(g.shape)} {g.dtype} (reference: {tuple(w.shape)} {w.dtype})"
        e = _f64(e)
        step = STEP[mx.float16] if w.dtype == mx.float16 else 2.0**-7
        tol = step * np.abs(e) + (2.0**-12 if w.dtype == mx.float16 else 2.0**-10) * _f64(sums)
        if s == 0 and residual is not None:
            tol += step * np.abs(_f64(rows))
        gf = _f64(g)
        err = np.abs(gf - e)
        bad = ~(err <= tol)
        if bad.any():
            row = int(np.argmax(np.where(bad, err - tol, -np.inf).reshape(-1)))
            return (
                f"segment {s}: {int(bad.sum())} of {bad.size} rows off, e.g. row {row}: "
                f"kernel {gf.reshape(-1)[row]:.6g}, fp32 sums {e.reshape(-1)[row]:.6g} "
                f"(tolerance {tol.reshape(-1)[row]:.3g})"
            )
    return None


def quantized_matvec_compare(got, want) -> tuple[bool, float]:
    """(acceptable, largest error relative to the largest value), for doctor,
    which has no inputs to judge with: within 2^-4 of the largest value (MLX's
    CPU kernel sums bf16 in bf16: 0.018 off on the sample; a GPU's reference
    sums in fp32 and is one bf16 step off at most)."""
    worst = 0.0
    for g, w in zip(got, want):
        gf, wf = _f64(g), _f64(w)
        if gf.shape != wf.shape or g.dtype != w.dtype or not np.isfinite(gf).all():
            return False, math.inf
        worst = max(worst, float(np.abs(gf - wf).max(initial=0.0)) / max(float(np.abs(wf).max(initial=0.0)), 1e-30))
    return len(got) == len(want) and worst <= 2.0**-4, worst


# -- the self-check's and the fuzz's calls (inputs from .testing) ---------------------------


def _sample():
    from .testing import gemv_call

    return gemv_call(128, (40, 5), (4, 8), prologue="norm", seed=11)


def _fuzz(rng):
    """A random call: 1-3 rows of x, 1-4 segments of 1-70 rows (not
    multiples of the row blocking), 4- and 8-bit mixed, K up to 512, each
    prologue, a residual."""
    from .testing import gemv_call

    K = int(rng.choice([64, 128, 192, 320, 512]))
    batch = int(rng.choice([1, 1, 2, 3]))
    S = int(rng.integers(1, MAX_SEGMENTS + 1))
    rows = tuple(int(rng.integers(1, 71)) for _ in range(S))
    bits = tuple(int(rng.choice(KERNEL_BITS)) for _ in range(S))
    prologue = ("none", "norm", "gate")[int(rng.integers(3))]
    dtype = ACTIVATION_DTYPES[int(rng.integers(len(ACTIVATION_DTYPES)))]
    norm_dtype = mx.float32 if rng.random() < 0.25 else dtype
    residual = S == 1 and rng.random() < 0.5
    return gemv_call(K, rows, bits, prologue, residual, norm_dtype, rng=rng, dtype=dtype, batch=batch)


def _segment_names(s: int) -> tuple:
    return (f"w{s}", f"scales{s}", f"biases{s}", f"out{s}")


# A call of S projections leaves out segments S..3: no weights passed, no
# outputs allocated. The body touches them only where s < S, so each stands
# for segment 0's array of its kind (``auto``: MLX passes an input of fewer
# than 8 elements to Metal in the constant address space, not device).
_STAND_INS = {
    name: f"auto {name} = {name[:-1]}0;"
    for s in range(1, MAX_SEGMENTS)
    for name in _segment_names(s)
}
_ABSENT = {S: tuple(n for s in range(S, MAX_SEGMENTS) for n in _segment_names(s)) for S in range(1, MAX_SEGMENTS + 1)}


# The kernels' arguments (this body's and gemv_tiles.metal's).
INPUT_NAMES = (
    "x",
    *(name for s in range(MAX_SEGMENTS) for name in _segment_names(s)[:3]),
    "norm_weight", "gate", "residual", "layout", "scalars",
)
OUTPUT_NAMES = tuple(_segment_names(s)[3] for s in range(MAX_SEGMENTS))


quantized_matvec_kernel = Kernel(
    name="quantized_matvec",
    input_names=INPUT_NAMES,
    output_names=OUTPUT_NAMES,
    body=Path(__file__).with_name("gemv.metal"),
    launch=_launch,
    reference=quantized_matvec_reference,
    sample=_sample,
    agree=quantized_matvec_agree,
    row_contiguous=False,
    stand_ins=_STAND_INS,
    # For lily_tile_unpack only (bf16 bit patterns to floats), no matrix tiles.
    tiles=True,
)


quantized_matvec = register(
    LilyOp(
        "quantized_matvec",
        quantized_matvec_reference,
        kernel=quantized_matvec_kernel,
        supports=quantized_matvec_supports,
        description="decode GEMV: merged quantized projections with a fused norm/gate prologue and residual",
        sample=_sample,
        compare=quantized_matvec_compare,
        fuzz=_fuzz,
        in_model=True,
    )
)
