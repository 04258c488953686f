"""The decode GEMV on matrix tiles (quantized_matvec_tiles, gemv_tiles.metal).

In the CPU emulator (Metal's simdgroup-matrix layout): the kernel against
quantized_matvec's contract for B = 1, 3 and 16 rows of x (each prologue,
the residual, several segments, rows not whole tiles, K not a multiple of the
SIMD groups' slices), 4-bit and 8-bit; batch invariance, bit for bit: a row
alone equals the same row inside batches of 2, 5 and 16 at any position,
whatever the other rows hold; every SIMD-group choice within the contract;
every tiles-per-threadgroup choice the same bits; the calls it refuses (4-
and 8-bit segments in one call, fp16 or fp32 matmul inputs). The model's
call shapes compiled for CUDA with nvcc, onto tensor-core mma.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_lily import kernels as K
from mlx_lily.kernels.linear.gemv import quantized_matvec_agree, quantized_matvec_reference
from mlx_lily.kernels.linear.gemv_tiles import (
    SIMDGROUP_CHOICES,
    TPG_CHOICES,
    simdgroup_choices,
    quantized_matvec_tiles_kernel as tiles,
    quantized_matvec_tiles_supports as supports,
)
from mlx_lily.kernels.linear.testing import gemv_call
from test_toolchain import emulator_or_skip, nvcc_ptx

# K = 448: 7 quantization groups, so 4 SIMD groups take slices of 2, 2, 2 and 1.
KD = 448
# (rows per segment, prologue, residual)
CASES = [
    ((40, 7), "norm", False),
    ((33,), "gate", True),
    ((16, 5, 12, 20), "none", False),
]


def raw_bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16 if a.dtype.size == 2 else mx.uint32))


@pytest.mark.parametrize("batch", [1, 3, 16])
@pytest.mark.parametrize("rows, prologue, residual", CASES)
def test_the_tile_gemv_meets_the_contract(batch, rows, prologue, residual):
    emulator_or_skip()
    args, kwargs = gemv_call(KD, rows, (4,) * len(rows), prologue, residual, seed=batch + sum(rows), batch=batch)
    assert supports(*args, **kwargs) is None
    got = tiles.emulate(*args, **kwargs)
    want = quantized_matvec_reference(*args, **kwargs)
    assert [g.shape for g in got] == [w.shape for w in want] and [g.dtype for g in got] == [w.dtype for w in want]
    assert quantized_matvec_agree(got, want, *args, **kwargs) is None


@pytest.mark.parametrize("batch", [1, 3, 16])
@pytest.mark.parametrize("rows, prologue, residual", [((40, 1), "norm", False), ((33,), "gate", True)])
def test_8_bit_calls_meet_the_contract(batch, rows, prologue, residual):
    """The router and shared-expert gate are 8-bit (40 and 1 rows here, as
    the model's 256 and 1 are not whole tiles)."""
    emulator_or_skip()
    args, kwargs = gemv_call(KD, rows, (8,) * len(rows), prologue, residual, seed=7 + batch, batch=batch)
    assert supports(*args, **kwargs) is None
    launch = tiles.launch(*args, **kwargs)
    assert dict(launch.template)["BITS"] == 8
    got = tiles.emulate(*args, **kwargs)
    assert quantized_matvec_agree(got, quantized_matvec_reference(*args, **kwargs), *args, **kwargs) is None


@pytest.mark.parametrize("bits", [4, 8])
def test_every_tiles_per_threadgroup_choice_gives_the_same_bits(bits):
    """5 + 1 + 2 = 8 tiles over segments of 70, 9 and 20 rows: with 2 and 4
    tiles a threadgroup, tiles of two segments share a threadgroup, and with
    4 the last threadgroup has tiles past the call's."""
    emulator_or_skip()
    rows = (70, 9, 20)
    args, kwargs = gemv_call(KD, rows, (bits,) * 3, "norm", False, seed=11, batch=16)
    one = tiles.emulate(*args, tiles_per_threadgroup=1, **kwargs)
    assert quantized_matvec_agree(one, quantized_matvec_reference(*args, **kwargs), *args, **kwargs) is None
    for tpg in TPG_CHOICES[1:]:
        launch = tiles.launch(*args, tiles_per_threadgroup=tpg, **kwargs)
        assert dict(launch.template)["TPG"] == tpg and launch.grid[0] == -(-8 // tpg) * 4 * 32
        got = tiles.emulate(*args, tiles_per_threadgroup=tpg, **kwargs)
        for s in range(3):
            assert np.array_equal(raw_bits(got[s]), raw_bits(one[s])), (tpg, s)
    args, kwargs = gemv_call(KD, (24,), (4,), "gate", True, seed=12, batch=5)
    one = tiles.emulate(*args, tiles_per_threadgroup=1, **kwargs)
    got = tiles.emulate(*args, tiles_per_threadgroup=4, **kwargs)  # 2 tiles, one threadgroup
    assert np.array_equal(raw_bits(got[0]), raw_bits(one[0]))
    with pytest.raises(ValueError, match="tiles_per_threadgroup"):
        tiles.launch(*args, tiles_per_threadgroup=3, **kwargs)


@pytest.mark.parametrize("rows, prologue, residual, bits",
                         [(r, p, res, 4) for r, p, res in CASES[:2]] + [((40, 1), "norm", False, 8)])
def test_a_row_has_the_same_bits_alone_and_in_any_batch(rows, prologue, residual, bits):
    emulator_or_skip()
    args, kwargs = gemv_call(KD, rows, (bits,) * len(rows), prologue, residual, seed=3, batch=16)
    (x, weights) = args
    every = tiles.emulate(x, weights, **kwargs)

    def rows_of(kw, lo, n):
        out = dict(kw)
        for name in ("gate", "residual"):
            if name in out:
                out[name] = out[name][lo : lo + n]
        return out

    for row in (0, 6, 15):
        for batch in (1, 2, 5):
            lo = min(row, 16 - batch)
            got = tiles.emulate(x[lo : lo + batch], weights, **rows_of(kwargs, lo, batch))
            for s in range(len(rows)):
                assert np.array_equal(raw_bits(got[s][row - lo]), raw_bits(every[s][row])), (row, batch, s)
    # Other rows' values do not reach a row.
    noise = mx.array(np.random.default_rng(9).standard_normal(x.shape).astype(np.float32)).astype(x.dtype)
    mixed = mx.concatenate([x[:1], noise[1:]])
    kw = dict(kwargs)
    if "gate" in kw:
        kw["gate"] = mx.concatenate([kwargs["gate"][:1], kwargs["gate"][1:] * 3], axis=0)
    got = tiles.emulate(mixed, weights, **kw)
    assert np.array_equal(raw_bits(got[0][0]), raw_bits(every[0][0]))


@pytest.mark.parametrize("simdgroups", SIMDGROUP_CHOICES)
def test_every_k_split_meets_the_contract(simdgroups):
    emulator_or_skip()
    args, kwargs = gemv_call(KD, (24,), (4,), "norm", False, seed=5, batch=4)
    got = tiles.emulate(*args, simdgroups=simdgroups, **kwargs)
    assert quantized_matvec_agree(got, quantized_matvec_reference(*args, **kwargs), *args, **kwargs) is None


def test_the_calls_it_refuses_say_why():
    args, kwargs = gemv_call(128, (9, 3), (4, 8), "norm", False, seed=1)
    assert "4-bit and 8-bit" in supports(*args, **kwargs)
    assert supports(*gemv_call(128, (9, 3), (8, 8), "norm", False, seed=1)[0]) is None
    args, kwargs = gemv_call(128, (9,), (4,), "none", False, seed=1, dtype=mx.float16)
    assert "float16" in supports(*args, **kwargs)
    args, kwargs = gemv_call(128, (9,), (4,), "norm", False, norm_dtype=mx.float32, seed=1)
    assert "float32" in supports(*args, **kwargs)
    args, kwargs = gemv_call(128, (9,), (4,), batch=17)
    assert "B=17" in supports(*args, **kwargs)
    with pytest.raises(ValueError, match="simdgroups"):
        tiles.launch(*gemv_call(128, (9,), (4,))[0], simdgroups=3)
    assert simdgroup_choices("cuda") == (1, 2, 4, 8) and simdgroup_choices("metal") == SIMDGROUP_CHOICES
    assert not K.OPS["quantized_matvec_tiles"].in_model


def _zeros(K, rows):
    return tuple(
        (mx.zeros((n, K // 8), mx.uint32), mx.zeros((n, K // 64), mx.bfloat16), mx.zeros((n, K // 64), mx.bfloat16))
        for n in rows
    )


def _zeros8(K, rows):
    return tuple(
        (mx.zeros((n, K // 4), mx.uint32), mx.zeros((n, K // 64), mx.bfloat16), mx.zeros((n, K // 64), mx.bfloat16))
        for n in rows
    )


def test_the_models_calls_compile_with_nvcc_onto_tensor_core_mma(tmp_path):
    """The model's GEMV calls (DeltaNet and attention input projections with
    the norm, the gated output projection with the residual, lm_head, the
    8-bit router and shared-expert gate) at B = 1 and 16."""
    units = {}
    for batch in (1, 16):
        x2k = mx.zeros((batch, 1, 2048), mx.bfloat16)
        x4k = mx.zeros((batch, 1, 4096), mx.bfloat16)
        norm = {"norm_weight": mx.ones((2048,), mx.bfloat16), "eps": 1e-6}
        calls = {
            "deltanet_in": (x2k, _zeros(2048, (8192, 4096, 32, 32)), norm),
            "o_proj": (x4k, _zeros(4096, (2048,)), {
                "gate": mx.split(mx.zeros((batch, 1, 16, 512), mx.bfloat16), 2, axis=-1)[1],
                "residual": mx.zeros((batch, 1, 2048), mx.bfloat16)}),
            "lm_head": (x2k, _zeros(2048, (248320,)), {}),
            "router": (x2k, _zeros8(2048, (256, 1)), norm),
        }
        for name, (x, weights, kwargs) in calls.items():
            assert supports(x, weights, **kwargs) is None, name
            # CUDA's default K split (8 SIMD groups, 43.5 KB of shared memory),
            # at 16 rows with 4 tiles a threadgroup.
            units[f"{name}_b{batch}"] = tiles.cuda_translation_unit(
                x, weights, simdgroups=8, tiles_per_threadgroup=1 if batch == 1 else 4, **kwargs)
    # Metal's default split at the output projection's shape.
    x4k = mx.zeros((16, 1, 4096), mx.bfloat16)
    units["out_proj_nsg4"] = tiles.cuda_translation_unit(
        x4k, _zeros(4096, (2048,)), residual=mx.zeros((16, 1, 2048), mx.bfloat16), simdgroups=4)
    for name, text in nvcc_ptx(tmp_path, units).items():
        assert "mma.sync.aligned.m16n8k16" in text, name
        assert "ld.global.v4.u32" in text or "ld.global.nc.v4.u32" in text, name
        # The tiles' per-tile state stays in registers (LILY_UNROLL).
        assert "ld.local" not in text and "st.local" not in text, name


def test_with_the_tiles_form_the_models_batches_keep_each_rows_bits(demo_checkpoint, emulator_backend, monkeypatch):
    """MLX_LILY_GEMV=tiles: the model's decode GEMVs take the tile form at
    every B (the router's 8-bit call too), and a request decodes the same bits alone and in a batch of 5, through
    mlx-lm's BatchGenerator."""
    import mlx_lily
    from test_batch_invariance import alone, assert_same, generate

    monkeypatch.setenv("MLX_LILY_GEMV", "tiles")
    tiles.launched.clear()
    model, _ = mlx_lily.load(str(demo_checkpoint), backend="lily")
    together = generate(model, {0: list(range(5))}, {i: 3 for i in range(5)})
    assert {dict(key[1])["BATCH"] for key in tiles.launched if key[0] == "emulator"} >= {1, 8}  # B = 1 and 5
    for i in (0, 4):
        assert_same(together[i], alone(model, i, 3), f"row {i} of 5")


def test_an_unknown_gemv_form_is_one_notice_and_the_default(monkeypatch, fresh_notices, capsys):
    from mlx_lily.kernels.linear.gemv_tiles import gemv_form

    monkeypatch.setenv("MLX_LILY_GEMV", "mma")
    assert gemv_form() == "rows" and gemv_form() == "rows"
    said = capsys.readouterr().err
    assert said.count("MLX_LILY_GEMV='mma'") == 1


def test_cuda_takes_the_tile_form_with_eight_simdgroups_by_default(monkeypatch):
    """The defaults follow the H200's device times (bench/results/
    2026-12-02-nvidia-h200-175d8c2279): the tile form, 8 SIMD groups, on
    CUDA; the row GEMV on Metal and the CPU; MLX_LILY_GEMV chooses either."""
    from mlx_lily.kernels.linear import gemv_tiles

    monkeypatch.delenv("MLX_LILY_GEMV", raising=False)
    assert gemv_tiles.default_form("cuda") == "tiles"
    assert gemv_tiles.default_form("metal") == gemv_tiles.default_form(None) == "rows"
    assert gemv_tiles.default_simdgroups("cuda") == 8 and gemv_tiles.default_simdgroups("metal") == 4
    args, kwargs = gemv_call(2048, (40, 5), (4, 4), "norm", batch=3, seed=2)
    for backend, form, nsg in (("cuda", "tiles", 8), ("metal", "rows", 4), ("emulator", "rows", 4), (None, "rows", 4)):
        monkeypatch.setattr(gemv_tiles, "runs_on", lambda backend=backend: backend)
        assert gemv_tiles.gemv_form() == form
        launch = tiles.launch(*args, **kwargs)
        assert dict(launch.template)["NSG"] == nsg and launch.threadgroup == (nsg * 32, 1, 1)
    # A call of a vocabulary's rows (lm_head) splits K in 2 on CUDA, at every B.
    assert gemv_tiles.default_simdgroups("cuda", gemv_tiles.CUDA_MANY_ROWS) == 2
    assert gemv_tiles.default_simdgroups("cuda", gemv_tiles.CUDA_MANY_ROWS - 1) == 8
    assert gemv_tiles.default_simdgroups("metal", 10**6) == 4
    monkeypatch.setattr(gemv_tiles, "runs_on", lambda: "cuda")
    for batch in (1, 2, 4, 16):
        x = mx.zeros((batch, 1, 64), dtype=mx.bfloat16)
        w = mx.zeros((gemv_tiles.CUDA_MANY_ROWS, 8), dtype=mx.uint32)
        sb = mx.zeros((gemv_tiles.CUDA_MANY_ROWS, 1), dtype=mx.bfloat16)
        launch = tiles.launch(x, ((w, sb, sb),))
        assert dict(launch.template)["NSG"] == 2 and launch.threadgroup == (64, 1, 1)
    monkeypatch.setenv("MLX_LILY_GEMV", "rows")
    assert gemv_tiles.gemv_form() == "rows"
    monkeypatch.setenv("MLX_LILY_GEMV", "tiles")
    monkeypatch.setattr(gemv_tiles, "runs_on", lambda: "metal")
    assert gemv_tiles.gemv_form() == "tiles"


def test_the_defaults_follow_where_kernels_run_not_the_gpu_present(monkeypatch):
    # The emulator forced on an NVIDIA machine keeps Metal's limits: 8 SIMD
    # groups would not fit its threadgroup memory, so the row GEMV.
    from mlx_lily.kernels.linear import gemv_tiles
    from mlx_lily.toolchain import registry

    monkeypatch.delenv("MLX_LILY_GEMV", raising=False)
    monkeypatch.delenv("MLX_LILY_KERNELS", raising=False)
    monkeypatch.setattr(registry, "gpu_backend", lambda: "cuda")
    monkeypatch.setenv(registry.BACKEND_ENV, "auto")
    assert gemv_tiles.runs_on() == "cuda" and gemv_tiles.gemv_form() == "tiles"
    monkeypatch.setenv(registry.BACKEND_ENV, "emulator")
    assert gemv_tiles.runs_on() == "emulator" and gemv_tiles.gemv_form() == "rows"


def test_tiles_per_threadgroup_follow_the_batch_on_cuda_only(monkeypatch):
    """On CUDA calls of at least CUDA_TPG_MIN_TILES tiles take 2 a
    threadgroup, 4 from B's bucket CUDA_TPG_WIDE_BUCKET; smaller calls, and
    every call elsewhere, one."""
    from mlx_lily.kernels.linear import gemv_tiles

    many, wide = gemv_tiles.CUDA_TPG_MIN_TILES, gemv_tiles.CUDA_TPG_WIDE_BUCKET
    pick = gemv_tiles.default_tiles_per_threadgroup
    assert pick("cuda", many, 1) == pick("cuda", many, wide // 2) == 2
    assert pick("cuda", many, wide) == pick("cuda", 100 * many, 16) == 4
    assert pick("cuda", many - 1, 16) == pick("cuda", many - 1, 1) == 1
    assert pick("metal", 100 * many, 16) == pick(None, 100 * many, 16) == pick("emulator", 100 * many, 16) == 1
    # The model's DeltaNet input projections (772 tiles), the router (17), lm_head (15,520).
    monkeypatch.setattr(gemv_tiles, "runs_on", lambda: "cuda")
    norm = {"norm_weight": mx.ones((2048,), mx.bfloat16), "eps": 1e-6}
    for batch, want in ((1, 2), (4, 2), (5, 4), (16, 4)):
        x = mx.zeros((batch, 1, 2048), mx.bfloat16)
        launch = tiles.launch(x, _zeros(2048, (8192, 4096, 32, 32)), **norm)
        assert dict(launch.template)["TPG"] == want, batch
        assert launch.grid[0] == -(-772 // want) * 8 * 32
        assert dict(tiles.launch(x, _zeros8(2048, (256, 1)), **norm).template)["TPG"] == 1
    launch = tiles.launch(mx.zeros((16, 1, 2048), mx.bfloat16), _zeros(2048, (248320,)))
    assert dict(launch.template)["TPG"] == 4 and dict(launch.template)["NSG"] == 2
