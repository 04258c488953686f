"""The decode GEMV for B rows of x (quantized_matvec at x [B, 1, K], B <= 16:
server decode of B sequences, speculative verification of B tokens).

In the CPU emulator: the kernel against the contract for B = 1, 2, 5 and 16
(each prologue, the residual, 4- and 8-bit, several segments, xin staged in
threadgroup memory or read from device memory); one build per bucket of B
(1, 2, 4, 8, 16), rows past B in a bucket neither read nor written (the
emulator checks every access against its buffer); batch invariance, bit for
bit: a row computed alone equals the same row inside batches of 2, 3, 5, 9
and 16, at any position, whatever the other rows hold; B = 17 runs the
reference and says why; every bucket of the model's calls compiled for CUDA
with nvcc, accumulators in registers.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_lily import kernels as K
from mlx_lily.kernels.linear.gemv import (
    BATCH_BUCKETS,
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
)
from mlx_lily.kernels.linear.testing import gemv_call

from test_toolchain import emulator_or_skip, nvcc_ptx

# K = 576: 5 rows of xin fit the threadgroup budget, 16 do not (the body
# then computes xin where it reads it), so both paths are covered.
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
    # B = 1 keeps its launch; larger buckets take fewer rows per SIMD group
    # (at most 16 accumulators a lane), the same SIMD groups per threadgroup.
    assert launch_choice(12352, "cuda") == (4, None) and launch_choice(257, "cuda") == (1, 16)
    assert [launch_choice(12352, "cuda", b)[0] for b in BATCH_BUCKETS] == [4, 4, 4, 2, 1]
    assert [launch_choice(2048, "cuda", b) for b in BATCH_BUCKETS] == [(2, 8)] * 4 + [(1, 8)]
    assert [launch_choice(300, "metal", b) for b in BATCH_BUCKETS] == [(4, None)] * 3 + [(2, None), (1, None)]
    one, _ = gemv_call(KD, (40, 9), (4, 8), "norm", batch=1)
    many, kwargs = gemv_call(KD, (40, 9), (4, 8), "norm", batch=16)
    a = quantized_matvec_kernel.launch(*one, norm_weight=kwargs["norm_weight"], eps=1e-6)
    b = quantized_matvec_kernel.launch(*many, **kwargs)
    assert a.threadgroup == b.threadgroup and a.grid[0] < b.grid[0]  # 4 and 1 rows per SIMD group
    many_template = dict(b.template)
    assert {name for name, value in a.template if many_template[name] != value} == {"BATCH", "STAGE_X", "ROWS"}
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
    in threadgroup memory (buckets up to 8 here) or not (16, and 5 forced),
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


def _zeros_weights(Kd, rows, bits):
    return tuple(
        (mx.zeros((n, Kd * b // 32), mx.uint32), mx.zeros((n, Kd // 64), mx.bfloat16),
         mx.zeros((n, Kd // 64), mx.bfloat16))
        for n, b in zip(rows, bits)
    )


# o_proj computes its gated xin where it reads it (a bucket of 8 or 16 rows
# of K = 4096 is more than the threadgroup budget); that per-row work is too
# large for nvcc to unroll the batch loop at any rows per SIMD group, so its
# accumulators stay in local memory: slower, the same values.
GATED_IN_LOCAL_MEMORY = {"o_proj_b8", "o_proj_b16"}


def test_every_bucket_of_the_models_calls_compiles_for_cuda(tmp_path):
    """Every bucket of the model's calls, with CUDA's launch choices for it:
    each compiles, loads whole 16-byte weight words, and (but o_proj at 8
    and 16, GATED_IN_LOCAL_MEMORY) keeps its BATCH x ROWS accumulators in
    registers (no local memory in the PTX)."""
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
    units = {}
    for name, (Kd, weights, per_row) in calls.items():
        rows = [int(w.shape[0]) for w, _, _ in weights]
        single_rows, nsg = launch_choice(sum(rows), "cuda")
        nsg = nsg or simdgroups_for(sum(-(-n // single_rows) for n in rows))
        for bucket in BATCH_BUCKETS:
            choice = {"rows_per_simdgroup": launch_choice(sum(rows), "cuda", bucket)[0], "simdgroups": nsg}
            x = mx.zeros((bucket, 1, Kd), mx.bfloat16)
            units[f"{name}_b{bucket}"] = quantized_matvec_kernel.cuda_translation_unit(
                x, weights, **per_row(bucket), **choice)
    for name, text in nvcc_ptx(tmp_path, units).items():
        in_local = "ld.local" in text or "st.local" in text
        assert in_local == (name in GATED_IN_LOCAL_MEMORY), name
        assert "ld.global.v4.u32" in text or "ld.global.nc.v4.u32" in text, name
