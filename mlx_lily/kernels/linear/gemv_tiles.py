"""The decode GEMV on matrix tiles, for batches of rows::

    quantized_matvec_tiles(x, weights, norm_weight=None, eps=0.0, gate=None, residual=None)
        -> tuple of S arrays [B, 1, N_s]

``quantized_matvec``'s contract (the same reference and tolerance, gemv.py)
for 4-bit or 8-bit projections and bf16 activations, computed another way: each
threadgroup reads 16 weight rows once and multiplies them with x, padded to
16 rows, on the GPU's matrix units (``lily_tile_mma``: tensor cores on
NVIDIA, simdgroup matrices on Apple GPUs), so a weight read costs the same
for 1 or 16 rows of x. The row-parallel GEMV (gemv.metal) multiplies every
weight value into B accumulators on the vector units, and at 16 rows its
prologue and multiply-adds, not its reads, set its time (H200: 84 GB/s at
best). Every row is reduced in an order fixed by K and the launch (never
by B): the same bits alone or in any batch of up to 16.

The model's decode calls go through ``decode_matvec``: on CUDA the tile
form for every call it takes, elsewhere the row-parallel GEMV;
``MLX_LILY_GEMV=tiles`` or ``rows`` chooses. One form for every batch size
either way (batch invariance, and the verify pass's equality with plain
decode need it). CUDA's default follows the H200's device times at B = 1, 4
and 16 (bench/results/2026-12-02-nvidia-h200-175d8c2279: tiles with 8 SIMD
groups take 1.74 ms of a token's 80 calls at B = 1 against the row GEMV's
1.91, 4.75 against 9.36 at B = 16); Metal keeps the row GEMV until an Apple
GPU has measured both.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import mlx.core as mx

from ..._notice import notice_once
from ...toolchain.kernel import Kernel, Launch, SIMD_WIDTH
from ...toolchain.registry import LilyOp, kernel_backend, register
from .gemv import (
    INPUT_NAMES,
    OUTPUT_NAMES,
    _ABSENT,
    _STAND_INS,
    MAX_SEGMENTS,
    _input_dtype,
    _layout,
    batch_bucket,
    call_inputs,
    quantized_matvec,
    quantized_matvec_agree,
    quantized_matvec_compare,
    quantized_matvec_reference,
    quantized_matvec_supports,
)

# Output rows per threadgroup: one matrix tile.
TILE_ROWS = 16
# SIMD groups per threadgroup, each a slice of K (its quantization groups in
# order; the slices' sums added in order). A choice per backend and call
# shape, never per B: it orders each row's sums. 8 needs 43.5 KB of
# threadgroup memory (staged xin and q, the slices' sums): within CUDA's
# 48 KB, past Metal's 32. On the H200 8 is the fastest at every B measured.
DEFAULT_SIMDGROUPS = 4
CUDA_DEFAULT_SIMDGROUPS = 8
SIMDGROUP_CHOICES = (1, 2, 4)
CUDA_SIMDGROUP_CHOICES = (1, 2, 4, 8)
# On CUDA, calls of at least this many output rows (the vocabulary's lm_head:
# about 15,500 threadgroups) split K in CUDA_MANY_ROWS_SIMDGROUPS: with that
# many threadgroups a longer loop per SIMD group beats a wider split. H200,
# lm_head at 248,320 x 2048 (bench/results/2026-12-03-nvidia-h200-2b882a1):
# 233.5 us with 2 against 287.8 with 8 at B = 1, 293.8 against 359.4 at B = 4.
# Keyed by the call's rows, never by B, so every B keeps one order.
CUDA_MANY_ROWS = 65536
CUDA_MANY_ROWS_SIMDGROUPS = 2


def simdgroup_choices(backend: Optional[str]) -> tuple:
    """The K splits a backend's threadgroup memory takes."""
    return CUDA_SIMDGROUP_CHOICES if backend == "cuda" else SIMDGROUP_CHOICES


def default_simdgroups(backend: Optional[str], rows: int = 0) -> int:
    """The K split the model's calls of ``rows`` output rows (all segments)
    take on ``backend``."""
    if backend == "cuda":
        return CUDA_MANY_ROWS_SIMDGROUPS if rows >= CUDA_MANY_ROWS else CUDA_DEFAULT_SIMDGROUPS
    return DEFAULT_SIMDGROUPS


# Output tiles per threadgroup: a launch choice that no sum's order depends on
# (each tile's sums run the same way whichever threadgroup computes it), so it
# may follow B. Several tiles share one staging of x and the norm's sums, and
# keep more weight loads in flight a lane, but leave fewer threadgroups to fill
# the GPU and take more registers (H200, nvcc: 118, 128 and 175 a thread at 1,
# 2 and 4 tiles, 16 rows).
TPG_CHOICES = (1, 2, 4)
# CUDA's choice, from the H200's device times (gemv_sweep --device-time
# --tiles, bench/results/2026-12-04-nvidia-h200-3471bcd): calls of at least
# CUDA_TPG_MIN_TILES tiles take 2 a threadgroup, 4 from B's bucket
# CUDA_TPG_WIDE_BUCKET; smaller calls 1. DeltaNet input projections (772
# tiles): 33.4 / 39.9 / 69.8 us at B = 1 / 4 / 16 against 35.2 / 47.0 / 89.9
# with one; attention's (576): 29.6 / 34.5 / 65.4 against 30.9 / 37.2 / 77.5;
# lm_head (15,520): 211.4 / 243.8 / 675.5 against 231.7 (one) / 269.0 (four)
# / 739.7 (two). The router (17 tiles) and the output projections (128) are
# slower with more at every B.
CUDA_TPG_MIN_TILES = 512
CUDA_TPG_WIDE_BUCKET = 8


def default_tiles_per_threadgroup(backend: Optional[str], tiles: int, bucket: int) -> int:
    """The tiles per threadgroup the model's calls of ``tiles`` output tiles
    take at B's ``bucket``: 1 but on CUDA's large calls (above)."""
    if backend != "cuda" or tiles < CUDA_TPG_MIN_TILES:
        return 1
    return 4 if bucket >= CUDA_TPG_WIDE_BUCKET else 2


def default_launch(backend: Optional[str], rows: tuple, batch: int) -> tuple:
    """(SIMD groups splitting K, tiles per threadgroup) that a call of
    ``rows`` output rows (per segment) takes on ``backend`` at ``batch`` rows
    of x by default: ``_launch``'s choice, and the sweep's "tiles_default"."""
    tiles = sum(-(-int(n) // TILE_ROWS) for n in rows)
    return (default_simdgroups(backend, sum(rows)),
            default_tiles_per_threadgroup(backend, tiles, batch_bucket(batch)))


def quantized_matvec_tiles_supports(x, weights, norm_weight=None, eps=0.0, gate=None, residual=None) -> Optional[str]:
    """None when the tile kernel takes this call, else why not: the GEMV's
    limits, every segment 4-bit or every segment 8-bit, and bf16 matmul
    inputs only (the tiles multiply bf16)."""
    why = quantized_matvec_supports(x, weights, norm_weight, eps, gate, residual)
    if why is not None:
        return why
    bits = _bits(x, weights)
    if len(set(bits)) > 1:
        return (f"segments of {' and '.join(f'{b}-bit' for b in sorted(set(bits)))} weights "
                "(tile kernel: one width per call)")
    xt = _input_dtype(x, norm_weight)
    if xt != mx.bfloat16:
        return f"the matmul's input is {xt} (tile kernel: bfloat16)"
    return None


def _bits(x, weights) -> tuple:
    K = x.shape[-1]
    return tuple(int(w.shape[1]) * 32 // K for w, _, _ in weights)


def _launch(x, weights, norm_weight=None, eps=0.0, gate=None, residual=None, *,
            simdgroups: Optional[int] = None, tiles_per_threadgroup: Optional[int] = None) -> Launch:
    """The call's launch; ``simdgroups`` (``simdgroup_choices``, default
    ``default_simdgroups`` of the GPU) splits K, a tuning choice that orders
    the sums: keep one per call shape for batch invariance.
    ``tiles_per_threadgroup`` (TPG_CHOICES, default
    ``default_tiles_per_threadgroup``) changes no bits."""
    B, K = x.shape[0], x.shape[-1]
    rows = tuple(int(w.shape[0]) for w, _, _ in weights)
    default_nsg, default_tpg = default_launch(runs_on(), rows, B)
    nsg = default_nsg if simdgroups is None else int(simdgroups)
    if nsg not in CUDA_SIMDGROUP_CHOICES:
        raise ValueError(f"simdgroups {nsg}: one of {SIMDGROUP_CHOICES} ({CUDA_SIMDGROUP_CHOICES} on CUDA)")
    S = len(weights)
    tiles = sum(-(-n // TILE_ROWS) for n in rows)
    tpg = default_tpg if tiles_per_threadgroup is None else int(tiles_per_threadgroup)
    if tpg not in TPG_CHOICES:
        raise ValueError(f"tiles_per_threadgroup {tpg}: one of {TPG_CHOICES}")
    inputs, prologue, XT, OutT = call_inputs(x, weights, norm_weight, eps, gate, residual,
                                             _layout(rows, TILE_ROWS, B))
    return Launch(
        inputs=inputs,
        grid=(-(-tiles // tpg) * nsg * SIMD_WIDTH, 1, 1),
        threadgroup=(nsg * SIMD_WIDTH, 1, 1),
        output_shapes=[(B, 1, rows[s]) for s in range(S)],
        output_dtypes=[OutT] * S,
        template=[
            ("XT", XT),
            ("OutT", OutT),
            ("K", K),
            ("S", S),
            ("BITS", _bits(x, weights)[0]),
            ("SBT", _scale_bias_dtype(weights)),
            ("NSG", nsg),
            ("TPG", tpg),
            ("PROLOGUE", prologue),
            ("RESIDUAL", residual is not None),
            ("BATCH", batch_bucket(B)),
        ],
        finish=tuple,
        absent=_ABSENT[S],
    )


def _scale_bias_dtype(weights) -> mx.Dtype:
    """The dtype the body holds the scales and biases in between their loads
    and their use: theirs where every segment's share one, else float32
    (exact for each)."""
    dtypes = {a.dtype for _, scales, biases in weights for a in (scales, biases)}
    return dtypes.pop() if len(dtypes) == 1 else mx.float32


def _sample():
    from .testing import gemv_call

    return gemv_call(128, (40, 5), (4, 4), prologue="norm", seed=12)


def _fuzz(rng):
    """A random call: 1-16 rows of x, 1-4 segments of 1-70 rows (not whole
    tiles), all 4-bit or all 8-bit, K up to 512, each prologue, a residual."""
    from .testing import gemv_call

    K = int(rng.choice([64, 128, 192, 320, 512]))
    batch = int(rng.choice([1, 1, 2, 3, 5, 16]))
    S = int(rng.integers(1, MAX_SEGMENTS + 1))
    rows = tuple(int(rng.integers(1, 71)) for _ in range(S))
    prologue = ("none", "norm", "gate")[int(rng.integers(3))]
    residual = S == 1 and rng.random() < 0.5
    bits = int(rng.choice([4, 4, 8]))
    return gemv_call(K, rows, (bits,) * S, prologue, residual, rng=rng, batch=batch)


# Before each loop over a threadgroup's tiles, whose per-tile state sits in
# arrays: nvcc and NVRTC keep such a loop (a barrier in it) rolled and index
# its arrays in local memory; unrolled, they stay in registers. Metal's
# compiler unrolls constant-count loops by itself.
UNROLL_HEADER = """
#if defined(__CUDACC__) || defined(__CUDACC_RTC__)
#define LILY_UNROLL _Pragma("unroll")
#else
#define LILY_UNROLL
#endif
"""

quantized_matvec_tiles_kernel = Kernel(
    name="quantized_matvec_tiles",
    header=UNROLL_HEADER,
    input_names=INPUT_NAMES,
    output_names=OUTPUT_NAMES,
    body=Path(__file__).with_name("gemv_tiles.metal"),
    launch=_launch,
    reference=quantized_matvec_reference,
    sample=_sample,
    agree=quantized_matvec_agree,
    row_contiguous=False,
    stand_ins=_STAND_INS,
    tiles=True,
)


quantized_matvec_tiles = register(
    LilyOp(
        "quantized_matvec_tiles",
        quantized_matvec_reference,
        kernel=quantized_matvec_tiles_kernel,
        supports=quantized_matvec_tiles_supports,
        description="decode GEMV on matrix tiles (B <= 16 rows, 4- or 8-bit, bf16; the model's on CUDA)",
        sample=_sample,
        compare=quantized_matvec_compare,
        fuzz=_fuzz,
        in_model=False,
    )
)


# The model's decode GEMV form: "rows" (gemv.metal) or "tiles" (this file);
# by default tiles on CUDA, rows elsewhere (default_form).
GEMV_ENV = "MLX_LILY_GEMV"
GEMV_FORMS = ("rows", "tiles")


def default_form(backend: Optional[str]) -> str:
    return "tiles" if backend == "cuda" else "rows"


def runs_on() -> Optional[str]:
    """Where the kernels run ('cuda', 'metal', 'emulator' or None): the
    defaults follow it, not the GPU present (the emulator forced on an
    NVIDIA machine takes Metal's limits, and so the row GEMV)."""
    return kernel_backend()[0]


def gemv_form() -> str:
    default = default_form(runs_on())
    form = os.environ.get(GEMV_ENV, "").strip().lower() or default
    if form not in GEMV_FORMS:
        notice_once("gemv-form", f"{GEMV_ENV}={form!r} is not one of {', '.join(GEMV_FORMS)}; using {default!r}")
        return default
    return form


def takes_tiles(x, weights, norm_weight=None, eps=0.0, gate=None, residual=None) -> bool:
    """Whether ``decode_matvec`` gives this call to the tile form."""
    return gemv_form() == "tiles" and quantized_matvec_tiles_supports(x, weights, norm_weight, eps, gate,
                                                                      residual) is None


def decode_matvec(x, weights, norm_weight=None, eps=0.0, gate=None, residual=None):
    """The model's decode GEMV (``quantized_matvec``'s arguments and result):
    in the tile form (``gemv_form``) wherever it takes the call (4- or 8-bit,
    bf16, B <= 16; the same for every B of a call shape), else the
    row-parallel GEMV. Both answer with the same reference where no kernel
    runs."""
    if takes_tiles(x, weights, norm_weight, eps, gate, residual):
        return quantized_matvec_tiles(x, weights, norm_weight=norm_weight, eps=eps, gate=gate, residual=residual)
    return quantized_matvec(x, weights, norm_weight=norm_weight, eps=eps, gate=gate, residual=residual)
