"""The decode GEMV for B rows of x (quantized_matvec at x [B, 1, K], B <= 16:
server decode of B sequences, speculative verification of B tokens).

In the CPU emulator: the kernel against the contract for B = 1, 2, 5 and 16
(each prologue, the residual, 4- and 8-bit, several segments, xin staged
whole or in K tiles); one build per bucket of B
(1, 2, 4, 8, 16), rows past B in a bucket neither read nor written (the
emulator checks every access against its buffer); batch invariance, bit for
bit: a row computed alone equals the same row inside batches of 2, 3, 5, 9
and 16, at any position, whatever the other rows hold; B = 17 runs the
reference and says why; every bucket of the model's calls compiled for CUDA
with nvcc, accumulators in registers; K tiles keep each lane's order (checked
in Python on the body's geometry) and give the bits of whole-K staging.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_lily import kernels as K
from mlx_lily.kernels.linear.gemv import (
    BATCH_BUCKETS,
    MAX_ACCUMULATORS,
    MAX_BATCH,
    batch_bucket,
    STAGED_X_BYTES,
    launch_choice,
    simdgroups_for,
    quantized_matvec_agree,
    quantized_matvec_kernel,
    quantized_matvec_reference,
    quantized_matvec_supports,
    stages_x,
    tile_values,
    valid_tile,
)
from mlx_lily.kernels.linear.testing import gemv_call

from test_toolchain import emulator_or_skip, nvcc_ptx

# K = 576: 5 rows of xin fit the threadgroup budget, 16 do not (the body
# then stages K in two tiles of 512 values, the second partly past K), so
# both forms are covered.
KD = 576
# (rows per segment, bits per segment, prologue, residual)
CASES = [
    ((7, 33), (4, 8), "norm", False),
    ((9,), (4,), "gate", True),
    ((5, 3, 12), (8, 4, 8), "none", False),
]


def raw_bits(a: mx.array) -> np.ndarray:
    """The values' bit patterns (equal bits, not equal values: -0 != 0)."""
    return np.array(a.view(mx.uint16 if a.dtype.size == 2 else mx.uint32))


def same_bits(a: mx.array, b: mx.array) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(raw_bits(a), raw_bits(b))


def test_the_batch_limits():
    assert MAX_BATCH == 16
    assert stages_x(1, 8192, mx.bfloat16) and stages_x(1, 4096, mx.float32)
    assert stages_x(5, KD, mx.bfloat16) and not stages_x(16, KD, mx.bfloat16)
    assert not stages_x(2, STAGED_X_BYTES // 2 + 64, mx.bfloat16)
    # Staging is sized for the bucket: 3 rows of K = 4096 are 4 rows' memory.
    assert stages_x(2, 4096, mx.bfloat16) and not stages_x(3, 4096, mx.bfloat16)
    assert BATCH_BUCKETS == (1, 2, 4, 8, 16)
    assert [batch_bucket(b) for b in range(1, 17)] == [1, 2, 4, 4] + [8] * 4 + [16] * 8
    # B = 1 keeps its launch. On CUDA every bucket takes it (measured faster
    # at 16 rows with the accumulators in local memory); on Metal larger
    # buckets take fewer rows per SIMD group (at most 16 accumulators a lane),
    # the same SIMD groups per threadgroup.
    assert launch_choice(12352, "cuda") == (4, None) and launch_choice(257, "cuda") == (1, 16)
    assert [launch_choice(12352, "cuda", b) for b in BATCH_BUCKETS] == [(4, None)] * 5
    assert [launch_choice(2048, "cuda", b) for b in BATCH_BUCKETS] == [(2, 8)] * 5
    assert [launch_choice(300, "metal", b) for b in BATCH_BUCKETS] == [(4, None)] * 3 + [(2, None), (1, None)]
    one, _ = gemv_call(KD, (40, 9), (4, 8), "norm", batch=1)
    many, kwargs = gemv_call(KD, (40, 9), (4, 8), "norm", batch=16)
    a = quantized_matvec_kernel.launch(*one, norm_weight=kwargs["norm_weight"], eps=1e-6)
    b = quantized_matvec_kernel.launch(*many, **kwargs)
    assert a.threadgroup == b.threadgroup and a.grid[0] < b.grid[0]  # 4 and 1 rows per SIMD group
    many_template = dict(b.template)
    assert {name for name, value in a.template if many_template[name] != value} == {"BATCH", "TILE", "ROWS"}
    assert b.output_shapes == [(16, 1, 40), (16, 1, 9)]


def test_one_build_serves_each_bucket():
    """The build (template, input dtypes) is the bucket's: 16 batch sizes, 5
    builds; B reaches the body at run time (layout's last word)."""
    builds = {}
    for batch in range(1, MAX_BATCH + 1):
        args, kwargs = gemv_call(KD, (40, 9), (4, 8), "norm", batch=batch)
        launch = quantized_matvec_kernel.launch(*args, **kwargs)
        builds.setdefault(launch.instance("cuda"), []).append(batch)
        assert ("BATCH", batch_bucket(batch)) in launch.template
        assert launch.inputs[-2].tolist()[-1] == batch  # layout: ..., B
        assert launch.output_shapes == [(batch, 1, 40), (batch, 1, 9)]
    assert sorted(builds.values()) == [[1], [2], [3, 4], [5, 6, 7, 8], list(range(9, 17))]


@pytest.mark.parametrize("batch", [3, 9])
def test_rows_past_b_in_a_bucket_are_neither_read_nor_written(batch):
    """x, gate and residual of exactly B rows and outputs of exactly B rows:
    the emulator raises on any access past a buffer, so the bucket's rows
    past B read nothing and write nothing; the B real rows meet the contract."""
    emulator_or_skip()
    for rows, bits, prologue, residual in CASES[:2]:
        args, kwargs = gemv_call(KD, rows, bits, prologue, residual, seed=40 + batch, batch=batch)
        got = quantized_matvec_kernel.emulate(*args, **kwargs)
        assert [g.shape for g in got] == [(batch, 1, n) for n in rows]
        want = quantized_matvec_reference(*args, **kwargs)
        assert quantized_matvec_agree(got, want, *args, **kwargs) is None


@pytest.mark.parametrize("batch", [1, 2, 5, 16])
@pytest.mark.parametrize("rows, bits, prologue, residual", CASES)
def test_matches_the_reference_for_b_rows(batch, rows, bits, prologue, residual):
    emulator_or_skip()
    args, kwargs = gemv_call(KD, rows, bits, prologue, residual, seed=batch + sum(rows), batch=batch)
    assert quantized_matvec_supports(*args, **kwargs) is None
    got = quantized_matvec_kernel.emulate(*args, **kwargs)
    want = quantized_matvec_reference(*args, **kwargs)
    mx.eval(got, want)
    assert [g.shape for g in got] == [(batch, 1, n) for n in rows]
    mismatch = quantized_matvec_agree(got, want, *args, **kwargs)
    assert mismatch is None, mismatch


def test_fp16_and_an_fp32_norm_weight_for_b_rows():
    emulator_or_skip()
    for dtype, norm_dtype in ((mx.float16, None), (mx.bfloat16, mx.float32)):
        args, kwargs = gemv_call(192, (11, 4), (4, 8), "norm", norm_dtype=norm_dtype, seed=2, dtype=dtype, batch=3)
        got = quantized_matvec_kernel.emulate(*args, **kwargs)
        want = quantized_matvec_reference(*args, **kwargs)
        assert all(g.dtype == w.dtype for g, w in zip(got, want))
        assert quantized_matvec_agree(got, want, *args, **kwargs) is None


@pytest.mark.parametrize("rows, bits, prologue, residual", CASES[:2])
def test_a_row_has_the_same_bits_alone_and_anywhere_in_any_batch(rows, bits, prologue, residual):
    """Row b's outputs depend on row b's inputs only: the same bits at B = 1,
    and in batches of 2, 3, 5, 9 and 16 (every bucket, and rows past B in
    three of them) at different positions among other rows, with xin staged
    whole (buckets up to 8 here) or in K tiles (16; stage_x=False at 5 asks
    for tiles, which at K = 576 are one, the whole),
    and 4, 2 or 1 weight rows per SIMD group (the bucket's)."""
    emulator_or_skip()
    (x, weights), kwargs = gemv_call(KD, rows, bits, prologue, residual, seed=31, batch=16)
    # Other rows of the same shapes, other values.
    rng = np.random.default_rng(32)
    other = lambda a: mx.array((3 * rng.standard_normal(a.shape)).astype(np.float32)).astype(a.dtype)  # noqa: E731
    others = other(x)
    other_kwargs = {name: other(kwargs[name]) for name in ("gate", "residual") if name in kwargs}
    shared = {k: v for k, v in kwargs.items() if k in ("norm_weight", "eps")}

    def run(picks_from, **options):
        """A batch whose row i is row j of x (("x", j)) or of the others (("o", j))."""
        xs, per_row = [], {"gate": [], "residual": []}
        for source, j in picks_from:
            xs.append((x if source == "x" else others)[j : j + 1])
            for name in per_row:
                if name in kwargs:
                    per_row[name].append((kwargs if source == "x" else other_kwargs)[name][j : j + 1])
        call = dict(shared, **{n: mx.concatenate(v, axis=0) for n, v in per_row.items() if v})
        return quantized_matvec_kernel.emulate(mx.concatenate(xs, axis=0), weights, **call, **options)

    targets = (0, 6, 15)
    alone = {j: run([("x", j)]) for j in targets}
    batches = [
        # (picks, options): target rows of x at their positions among the others' rows.
        ([("x", 0), ("o", 1)], {}),
        ([("o", 2), ("x", 6)], {}),
        ([("x", 15), ("o", 2), ("x", 0)], {}),
        ([("o", 3), ("x", 15), ("o", 4), ("x", 0), ("o", 5)], {}),
        ([("x", 6), ("o", 7), ("o", 8), ("o", 9), ("x", 15)], {"stage_x": False}),
        ([("o", i) for i in range(4)] + [("x", 0), ("o", 5), ("x", 6), ("o", 7), ("x", 15)], {}),
        ([("o", i) for i in range(7)] + [("x", 15)] + [("o", i) for i in range(8, 14)] + [("x", 0), ("x", 6)], {}),
    ]
    for picks, options in batches:
        got = run(picks, **options)
        for position, (source, j) in enumerate(picks):
            if source != "x":
                continue
            for s, (g, a) in enumerate(zip(got, alone[j])):
                assert same_bits(g[position : position + 1], a), (len(picks), position, j, s)
    # The whole batch of 16 agrees with the reference too.
    full = quantized_matvec_kernel.emulate(x, weights, **kwargs)
    assert quantized_matvec_agree(full, quantized_matvec_reference(x, weights, **kwargs), x, weights, **kwargs) is None
    for j in targets:
        assert all(same_bits(f[j : j + 1], a) for f, a in zip(full, alone[j]))


def test_seventeen_rows_run_the_reference_and_say_why(emulator_backend, fresh_notices):
    args, kwargs = gemv_call(128, (6, 3), (4, 8), "gate", seed=12, batch=MAX_BATCH + 1)
    assert "at most 16" in quantized_matvec_supports(*args, **kwargs)
    got = K.quantized_matvec(*args, **kwargs)
    assert K.quantized_matvec.last_path == "reference"
    assert "B=17" in K.quantized_matvec.last_reason and "at most 16" in K.quantized_matvec.last_reason
    want = quantized_matvec_reference(*args, **kwargs)
    assert all(same_bits(g, w) for g, w in zip(got, want))
    # 16 rows take the kernel through the registry.
    args, kwargs = gemv_call(128, (6, 3), (4, 8), "gate", seed=12, batch=MAX_BATCH)
    got = K.quantized_matvec(*args, **kwargs)
    assert K.quantized_matvec.last_path == "kernel", K.quantized_matvec.last_reason
    assert quantized_matvec_agree(got, quantized_matvec_reference(*args, **kwargs), *args, **kwargs) is None


def test_per_row_inputs_must_have_b_rows():
    (x, weights), kwargs = gemv_call(128, (6,), (4,), "gate", residual=True, seed=13, batch=3)
    assert quantized_matvec_supports(x, weights, **kwargs) is None
    assert "gate (1, 1" in quantized_matvec_supports(x, weights, gate=kwargs["gate"][:1])
    assert "residual (2, 1, 6)" in quantized_matvec_supports(x, weights, residual=kwargs["residual"][:2])
    assert "one token" in quantized_matvec_supports(mx.zeros((3, 2, 128), mx.bfloat16), weights)
    with pytest.raises(ValueError, match="stage_x"):
        big = mx.zeros((16, 1, 1024), mx.bfloat16)
        quantized_matvec_kernel.launch(big, gemv_call(1024, (4,), (4,))[0][1], stage_x=True)


def _template(launch) -> dict:
    return dict(launch.template)


def _tile_of(k, K, tile):
    """The body's tile of value k (gemv.metal's tile_of)."""
    if tile >= K:
        return 0
    parts = 1 if tile >= 1024 else 2
    block = tile * parts
    tiles = -(-K // block) * parts
    return min((k // block) * parts + (k % 32) // (32 // parts), tiles - 1), tiles


def test_tiles_keep_each_lanes_order():
    """The body's tile geometry, in Python: for every tile size and K the
    launcher may pick (K a whole number of tiles or not), each lane's chunks
    (8 values; units of 32 values at 4 bits, 16 at 8 bits, step by step) lie
    in nondecreasing tiles, each chunk in exactly one tile, and a unit's
    chunks in the step range the body walks for that tile: so tiling never
    changes the order of any accumulator's fma."""
    assert [tile_values(b, mx.bfloat16) for b in BATCH_BUCKETS] == [8192, 4096, 2048, 1024, 512]
    assert [tile_values(b, mx.float32) for b in BATCH_BUCKETS] == [4096, 2048, 1024, 512, 256]
    assert all(valid_tile(t) for t in (256, 512, 1024, 2048, 3072, 4096, 8192))
    assert not any(valid_tile(t) for t in (0, 64, 128, 384, 768, 1536))
    for K in (64, 576, 1024, 2048, 2112, 4096, 4160):
        for tile in (256, 512, 1024, 2048, 4096):
            if tile >= K:
                continue
            _, tiles = _tile_of(0, K, tile)
            assert tiles * tile >= K
            parts = 1 if tile >= 1024 else 2
            block = tile * parts
            for values in (32, 16):
                span = 32 * values
                steps = -(-K // span)
                for lane in range(32):
                    seen = []
                    for s in range(steps):
                        k0 = (s * 32 + lane) * values
                        for c in range(values // 8):
                            t = _tile_of(k0 + 8 * c, K, tile)[0]
                            s_begin = (t // parts) * block // span
                            s_end = steps if t + 1 == tiles else min(steps, -(-((t // parts + 1) * block) // span))
                            assert s_begin <= s < s_end, (K, tile, values, lane, s, c)
                            seen.append(t)
                    assert seen == sorted(seen), (K, tile, values, lane)
    # K = 2112 is not a whole number of tiles at any of these sizes.
    assert all(2112 % tile for tile in (256, 512, 1024, 2048))


def test_the_tile_forms():
    """Whole K where the bucket's rows fit; else tiles of the budget's share
    (o_proj and out_proj from 3 rows, the DeltaNet projections at 16);
    the stage_x and tile options and their limits."""
    one, kwargs = gemv_call(4096, (8,), (4,), "gate", residual=True, batch=2)
    assert _template(quantized_matvec_kernel.launch(*one, **kwargs))["TILE"] == 4096
    for batch, tile in ((4, 2048), (8, 1024), (16, 512)):
        args, kwargs = gemv_call(4096, (8,), (4,), "gate", residual=True, batch=batch)
        assert _template(quantized_matvec_kernel.launch(*args, **kwargs))["TILE"] == tile
    args, kwargs = gemv_call(2048, (8,), (4,), "norm", batch=16)
    assert _template(quantized_matvec_kernel.launch(*args, **kwargs))["TILE"] == 512
    args, kwargs = gemv_call(2048, (8,), (4,), "norm", batch=2)
    forms = [_template(quantized_matvec_kernel.launch(*args, **kwargs, **option))["TILE"]
             for option in ({}, {"stage_x": True}, {"stage_x": False}, {"tile": 256}, {"tile": 1024})]
    assert forms == [2048, 2048, 2048, 256, 1024]
    for bad in ({"tile": 128}, {"tile": 768}, {"tile": 8192}, {"tile": 512, "stage_x": True}):
        with pytest.raises(ValueError, match="tile"):
            quantized_matvec_kernel.launch(*args, **kwargs, **bad)


# K = 2112: 3 steps of a 4-bit lane, 5 of an 8-bit one; no tile size divides it.
KT = 2112


@pytest.mark.parametrize("batch", [1, 5, 16])
def test_more_simdgroups_than_the_default_give_the_same_bits(batch):
    """A launch with more SIMD groups per threadgroup than the B = 1 launch's
    (sharing the staging of x among more weight rows, a tuning choice for
    large batches) gives every row the default's bits: the norm's sum of
    squares keeps the B = 1 launch's order (NORM_SG), and the dot products
    never depended on the SIMD groups. Fewer still meet the contract."""
    emulator_or_skip()
    (x, weights), kwargs = gemv_call(KD, (40, 9), (4, 8), "norm", seed=7, batch=batch)
    launch = quantized_matvec_kernel.launch(x, weights, **kwargs)
    default = dict(launch.template)["NSG"]
    assert dict(launch.template)["NORM_SG"] == default
    want = quantized_matvec_kernel.emulate(x, weights, **kwargs)
    for nsg in (2 * default, 4 * default):
        more = quantized_matvec_kernel.launch(x, weights, **kwargs, simdgroups=nsg)
        assert (dict(more.template)["NSG"], dict(more.template)["NORM_SG"]) == (nsg, default)
        got = quantized_matvec_kernel.emulate(x, weights, **kwargs, simdgroups=nsg)
        assert all(same_bits(g, w) for g, w in zip(got, want)), nsg
    fewer = quantized_matvec_kernel.emulate(x, weights, **kwargs, simdgroups=1)
    reference = quantized_matvec_reference(x, weights, **kwargs)
    assert quantized_matvec_agree(fewer, reference, x, weights, **kwargs) is None


@pytest.mark.parametrize("norm_dtype", [None, mx.float32])
def test_tiled_and_whole_k_staging_give_the_same_bits(norm_dtype):
    """B = 2 (1 with fp32 xin; the whole of K fits): whole-K staging and tiles of 256, 512
    (halves of 32-value runs) and 1024 values (runs), K not a whole number of
    tiles, 4- and 8-bit segments, all the same bits; and each row equals
    itself alone (B = 1, whole K) and inside 16 rows (tiles of 512 values, or
    256 with the fp32 xin of an fp32 norm weight), which meet the contract."""
    emulator_or_skip()
    (x, weights), kwargs = gemv_call(KT, (40, 9), (4, 8), "norm", norm_dtype=norm_dtype, seed=5, batch=16)
    pair = x[3:5] if norm_dtype is None else x[3:4]  # what fits whole: 2 rows of bf16, 1 of fp32
    whole = quantized_matvec_kernel.emulate(pair, weights, **kwargs, stage_x=True)
    for tile in (256, 512, 1024):
        tiled = quantized_matvec_kernel.emulate(pair, weights, **kwargs, tile=tile)
        assert all(same_bits(a, b) for a, b in zip(tiled, whole)), tile
    full = quantized_matvec_kernel.emulate(x, weights, **kwargs)
    want = quantized_matvec_reference(x, weights, **kwargs)
    assert quantized_matvec_agree(full, want, x, weights, **kwargs) is None
    for j in (3, 4):
        alone = quantized_matvec_kernel.emulate(x[j : j + 1], weights, **kwargs)
        assert all(same_bits(f[j : j + 1], a) for f, a in zip(full, alone))
        if j - 3 < pair.shape[0]:
            assert all(same_bits(w[j - 3 : j - 2], a) for w, a in zip(whole, alone))


def test_gated_rows_in_several_tiles():
    """o_proj's form: the gate prologue and the residual at 8 and 16 rows of
    K = 4096 (4 tiles of 1024 values, 8 of 512) meet the contract, and each
    row is the same bits as alone."""
    emulator_or_skip()
    (x, weights), kwargs = gemv_call(4096, (6,), (4,), "gate", residual=True, seed=8, batch=9)
    got = quantized_matvec_kernel.emulate(x, weights, **kwargs)
    assert quantized_matvec_agree(got, quantized_matvec_reference(x, weights, **kwargs), x, weights, **kwargs) is None
    for j in (0, 8):
        one = {n: v[j : j + 1] for n, v in kwargs.items() if n in ("gate", "residual")}
        alone = quantized_matvec_kernel.emulate(x[j : j + 1], weights, **one)
        assert all(same_bits(g[j : j + 1], a) for g, a in zip(got, alone))
        tiled = quantized_matvec_kernel.emulate(x[j : j + 1], weights, **one, tile=512)
        assert all(same_bits(t, a) for t, a in zip(tiled, alone))


def _zeros_weights(Kd, rows, bits):
    return tuple(
        (mx.zeros((n, Kd * b // 32), mx.uint32), mx.zeros((n, Kd // 64), mx.bfloat16),
         mx.zeros((n, Kd // 64), mx.bfloat16))
        for n, b in zip(rows, bits)
    )


def test_every_bucket_of_the_models_calls_compiles_for_cuda(tmp_path):
    """Every bucket of the model's calls, with CUDA's launch choices for it:
    each compiles, loads whole 16-byte weight words, and keeps its BATCH x
    ROWS accumulators in registers (no local memory in the PTX) where they
    are at most MAX_ACCUMULATORS (past it CUDA's choice keeps the B = 1 rows,
    at 16 rows of x with accumulators in local memory: measured faster on
    the H200), o_proj's gated input at 8 and 16 rows included (staged in
    K tiles)."""
    norm = {"norm_weight": mx.ones((2048,), mx.bfloat16), "eps": 1e-6}
    calls = {  # name: (K, weights, prologue and residual for B rows)
        "deltanet": (2048, _zeros_weights(2048, (8192, 4096, 32, 32), (4, 4, 4, 4)), lambda b: norm),
        "router": (2048, _zeros_weights(2048, (256, 1), (8, 8)), lambda b: norm),
        "out_proj": (4096, _zeros_weights(4096, (2048,), (4,)),
                     lambda b: {"residual": mx.zeros((b, 1, 2048), mx.bfloat16)}),
        "o_proj": (4096, _zeros_weights(4096, (2048,), (4,)),
                   lambda b: {"gate": mx.split(mx.zeros((b, 1, 16, 512), mx.bfloat16), 2, axis=-1)[1],
                              "residual": mx.zeros((b, 1, 2048), mx.bfloat16)}),
    }
    units, accumulators = {}, {}
    for name, (Kd, weights, per_row) in calls.items():
        rows = [int(w.shape[0]) for w, _, _ in weights]
        single_rows, nsg = launch_choice(sum(rows), "cuda")
        nsg = nsg or simdgroups_for(sum(-(-n // single_rows) for n in rows))
        for bucket in BATCH_BUCKETS:
            choice = {"rows_per_simdgroup": launch_choice(sum(rows), "cuda", bucket)[0], "simdgroups": nsg}
            x = mx.zeros((bucket, 1, Kd), mx.bfloat16)
            units[f"{name}_b{bucket}"] = quantized_matvec_kernel.cuda_translation_unit(
                x, weights, **per_row(bucket), **choice)
            accumulators[f"{name}_b{bucket}"] = bucket * choice["rows_per_simdgroup"]
    assert accumulators["deltanet_b16"] == 64 and accumulators["out_proj_b8"] == 16
    for name, text in nvcc_ptx(tmp_path, units).items():
        in_local = "ld.local" in text or "st.local" in text
        if accumulators[name] <= MAX_ACCUMULATORS:
            assert not in_local, name
        assert "ld.global.v4.u32" in text or "ld.global.nc.v4.u32" in text, name
