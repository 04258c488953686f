"""Dense bf16 GEMM on lily's matrix tiles: ``x @ w.T``.

This family exists to prove and measure the tile layer (``lily_tile_*``,
``toolchain/tiles_*.h``) on its own, on a plain GEMM whose speed can be set
beside ``mx.matmul``'s: the grouped expert GEMM, the chunked DeltaNet and flash
attention are built on the same tiles. The op is not used by the model.

The kernel (``matmul_tiled.metal``) stages BM x BK blocks of ``x`` and BN x BK
blocks of ``w`` through threadgroup memory as bf16 in 16-byte chunks (the next
block fetched into registers while the current one is multiplied) and
multiplies them in 16x16 tiles with fp32 accumulation; the output is rounded
once, to ``x``'s dtype.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from ...toolchain.kernel import Kernel, Launch, SIMD_WIDTH
from ...toolchain.registry import LilyOp, register

# Threadgroup block of C and the K step; SIMD groups per threadgroup as WM x WN.
# 128 x 128 with 8 SIMD groups (each 64 x 32: 4 x 2 tiles) keeps the tensor
# units fed from one staged block; small problems use the 64 x 64 block so
# that they still spread over many threadgroups.
LARGE_BLOCK = dict(BM=128, BN=128, BK=32, WM=2, WN=4)
SMALL_BLOCK = dict(BM=64, BN=64, BK=32, WM=2, WN=2)
LARGE_FROM = 2048 * 2048  # output elements from which the large block pays


def matmul_nt_reference(x: mx.array, w: mx.array) -> mx.array:
    """x [M, K], w [N, K] -> x @ w.T [M, N] in x's dtype."""
    return x @ w.T


def matmul_nt_supports(x: mx.array, w: mx.array) -> Optional[str]:
    if x.dtype != mx.bfloat16 or w.dtype != mx.bfloat16:
        return f"dtypes {x.dtype}, {w.dtype} (kernel: bfloat16)"
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
        return f"shapes {tuple(x.shape)} @ {tuple(w.shape)}.T (kernel: [M, K] @ [N, K].T)"
    if x.size == 0 or w.size == 0:
        return "empty operand"
    if x.shape[1] % 8:
        return f"K = {x.shape[1]} (kernel: a multiple of 8, its 16-byte staging chunk)"
    return None


def _launch(x: mx.array, w: mx.array) -> Launch:
    M, N = x.shape[0], w.shape[0]
    block = LARGE_BLOCK if M * N >= LARGE_FROM else SMALL_BLOCK
    threads = SIMD_WIDTH * block["WM"] * block["WN"]
    return Launch(
        inputs=[x, w],
        grid=(math.ceil(N / block["BN"]) * threads, math.ceil(M / block["BM"]), 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(M, N)],
        output_dtypes=[x.dtype],
        template=[("T", x.dtype), *block.items()],
        finish=lambda outputs: outputs[0],
    )


def _sample():
    keys = mx.random.split(mx.random.key(11), 2)
    x = mx.random.normal((37, 88), key=keys[0]).astype(mx.bfloat16)
    w = mx.random.normal((70, 88), key=keys[1]).astype(mx.bfloat16)
    return (x, w), {}


def _fuzz(rng):
    """A random call the kernel takes: M, N any size, K a multiple of 8."""
    M = int(rng.choice([1, int(rng.integers(2, 17)), int(rng.integers(17, 150))]))
    N = int(rng.choice([int(rng.integers(1, 17)), int(rng.integers(17, 150))]))
    K = 8 * int(rng.integers(1, 24))
    x = mx.array(rng.standard_normal((M, K)).astype(np.float32)).astype(mx.bfloat16)
    w = mx.array(rng.standard_normal((N, K)).astype(np.float32)).astype(mx.bfloat16)
    return (x, w), {}


def matmul_nt_agree(got, want, x, w) -> Optional[str]:
    """Within bf16 output rounding: both sides accumulate the same bf16
    products in fp32 (in different orders) and round once to bf16, so they
    differ by at most about one bf16 step of the result (2^-8 relative)."""
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    if got.shape != want.shape:
        return f"shape {got.shape} != reference {want.shape}"
    scale = mx.abs(want).max().item() or 1.0
    err = (mx.abs(got - want).max().item()) / scale
    return None if err <= 8e-3 else f"max |kernel - reference| / max |reference| = {err:.3g}"


matmul_nt_kernel = Kernel(
    name="matmul_tiled",
    input_names=("a", "b"),
    output_names=("c",),
    body=Path(__file__).with_name("matmul_tiled.metal"),
    launch=_launch,
    tiles=True,
    reference=matmul_nt_reference,
    sample=_sample,
    agree=matmul_nt_agree,
)

matmul_nt = register(
    LilyOp(
        "matmul_nt",
        matmul_nt_reference,
        kernel=matmul_nt_kernel,
        supports=matmul_nt_supports,
        description="dense bf16 x @ w.T on matrix tiles (the tile layer's proof; not in the model)",
        sample=_sample,
        fuzz=_fuzz,
        in_model=False,
    )
)
