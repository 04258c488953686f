"""The matrix-tile layer (lily_tile_*): the dense tiled GEMM that proves it.

In the CPU emulator (Metal's simdgroup_matrix semantics and per-lane layout)
against an exact ground truth, and compiled for CUDA with nvcc (tensor-core
mma.sync, nothing spilled to local memory) when nvcc is on PATH.
"""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest

from mlx_lily.kernels.linear import matmul
from mlx_lily.kernels.linear.matmul import matmul_nt, matmul_nt_kernel
from mlx_lily.toolchain import lint, sources
from mlx_lily.toolchain.kernel import Kernel, Launch

from test_toolchain import emulator_or_skip, nvcc_ptx


def _operands(M, N, K, seed=0):
    keys = mx.random.split(mx.random.key(seed), 2)
    x = mx.random.normal((M, K), key=keys[0]).astype(mx.bfloat16)
    w = mx.random.normal((N, K), key=keys[1]).astype(mx.bfloat16)
    return x, w


def _exact(x, w) -> np.ndarray:
    """x @ w.T of the bf16 values in float64: the ground truth before rounding."""
    xs = np.array(x.astype(mx.float32)).astype(np.float64)
    ws = np.array(w.astype(mx.float32)).astype(np.float64)
    return xs @ ws.T


def _assert_within_one_bf16_step(got, exact):
    # fp32 accumulation in any order is ~1e-6 relative of the sum's terms; the
    # one rounding to bf16 moves a value by at most half a bf16 step (a step is
    # 2^-7 of the value's binade). Allow one whole step of the larger of the
    # value and a small floor (sums that cancel leave only the fp32 error).
    got = np.array(got.astype(mx.float32)).astype(np.float64)
    step = np.maximum(np.abs(exact), 1e-2 * np.abs(exact).max()) * 2.0**-7
    bad = np.abs(got - exact) > step
    assert not bad.any(), (
        f"{int(bad.sum())} of {bad.size} elements off by more than one bf16 step; "
        f"first at {np.argwhere(bad)[0].tolist()}: {got[bad][0]} vs {exact[bad][0]}"
    )


@pytest.mark.parametrize(
    "M, N, K",
    [
        (16, 16, 16),   # one tile, one K step
        (1, 16, 32),    # a single row: everything but row 0 is guarded
        (37, 70, 88),   # no dimension a multiple of the block; K tail inside a BK step
        (64, 64, 64),   # exactly one small block
        (65, 130, 40),  # a partial block in each direction
        (3, 5, 8),      # K of one staging chunk
    ],
)
def test_tiled_gemm_matches_the_exact_product_in_the_emulator(M, N, K):
    emulator_or_skip()
    x, w = _operands(M, N, K, seed=M + N + K)
    got = matmul_nt_kernel.emulate(x, w)
    assert got.shape == (M, N) and got.dtype == mx.bfloat16
    _assert_within_one_bf16_step(got, _exact(x, w))


def test_the_large_block_matches_too(monkeypatch):
    # 128 x 128 blocks with 8 SIMD groups (each 4 x 2 tiles), forced at a small size.
    emulator_or_skip()
    monkeypatch.setattr(matmul, "LARGE_FROM", 0)
    x, w = _operands(130, 140, 48, seed=5)
    launch = matmul._launch(x, w)
    assert dict(launch.template)["BM"] == 128 and launch.threadgroup == (256, 1, 1)
    _assert_within_one_bf16_step(matmul_nt_kernel.emulate(x, w), _exact(x, w))


def test_tiled_gemm_agrees_with_mx_matmul_bit_for_bit_on_integers():
    # Small integers: every product and partial sum is exact in fp32, so any
    # summation order gives the same, exactly representable result.
    emulator_or_skip()
    keys = mx.random.split(mx.random.key(3), 2)
    x = mx.random.randint(-4, 5, (33, 64), key=keys[0]).astype(mx.bfloat16)
    w = mx.random.randint(-4, 5, (50, 64), key=keys[1]).astype(mx.bfloat16)
    assert mx.array_equal(matmul_nt_kernel.emulate(x, w), x @ w.T).item()


def test_the_op_takes_its_kernel_and_declines_other_dtypes(emulator_backend):
    emulator_or_skip()
    x, w = _operands(20, 24, 32)
    fn, path, why = matmul_nt.choose(x, w)
    assert path == "kernel", why
    _assert_within_one_bf16_step(matmul_nt(x, w), _exact(x, w))
    _, path, why = matmul_nt.choose(x.astype(mx.float32), w.astype(mx.float32))
    assert path == "reference" and "bfloat16" in why
    _, path, why = matmul_nt.choose(x[:, :30], w[:, :30])
    assert path == "reference" and "multiple of 8" in why


def test_the_body_is_in_the_portable_subset_and_simdgroup_matrices_are_not():
    body = matmul_nt_kernel.body
    assert lint.lint_paths([body]) == []
    direct = "simdgroup_matrix<float, 8, 8> m;\nsimdgroup_multiply_accumulate(m, m, m, m);\n"
    assert lint.lint_source(direct), "a body must reach the tiles only through lily_tile_*"


def test_tile_bodies_get_the_tile_api_on_every_backend():
    for backend in ("metal", "emulator", "cuda"):
        header = matmul_nt_kernel.full_header(backend)
        assert "lily_tile_mma" in header
        assert ("mma.sync" in header) == (backend == "cuda")
        assert ("simdgroup_multiply_accumulate" in header) == (backend != "cuda")


def test_the_tiled_gemm_compiles_to_tensor_core_mma_with_nvcc(tmp_path):
    units = {  # the small and the large block
        f"tiled_{M}": matmul_nt_kernel.cuda_translation_unit(
            mx.zeros((M, 256), mx.bfloat16), mx.zeros((M, 256), mx.bfloat16))
        for M in (64, 4096)
    }
    for text in nvcc_ptx(tmp_path, units).values():
        assert re.search(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", text)
        # Accumulators and operand fragments stay in registers.
        assert "ld.local" not in text and "st.local" not in text


def test_pack2_rounds_to_nearest_even_like_mlx():
    # lily_tile_pack2 is how dequantized or computed values enter a staged
    # bf16 block; it must round as MLX's float -> bfloat16 conversion does.
    emulator_or_skip()
    body = """
    uint i = thread_position_in_grid.x;
    if (i < x_shape[0] / 2) {
      out[i] = lily_tile_pack2(x[2 * i], x[2 * i + 1]);
    }
    """
    kernel = Kernel(
        "pack2", ("x",), ("out",),
        lambda x: Launch([x], (x.size // 2, 1, 1), (32, 1, 1), [(x.size // 2,)], [mx.uint32]),
        source=body, tiles=True,
    )
    base = mx.random.normal((512,), key=mx.random.key(4)) * 100
    # Exact ties between two bf16 values: both rounding directions occur.
    ties = mx.array([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -2.0 - 2.0**-7, 0.0, -0.0, 3.0e38, 1e-40, -7.5])
    x = mx.concatenate([base, ties])
    words = np.array(kernel.emulate(x)[0])
    got = np.stack([words & 0xFFFF, words >> 16], axis=1).reshape(-1)
    want = np.array(x.astype(mx.bfloat16).view(mx.uint16)).astype(np.uint32)
    assert (got == want).all()


def test_the_cuda_tile_header_uses_no_pragmas_nvrtc_ignores():
    # MLX builds custom kernels with NVRTC, which ignores push_macro/pop_macro:
    # a header that relied on them left `device` undefined for the body after it.
    text = sources.TILES_CUDA.read_text()
    assert not re.search(r"#\s*pragma\s+(push|pop)_macro", text)
    assert text.rstrip().endswith("#define device")
