"""MoE routing on the GPU: expert-contiguous row order and the tile map.

The grouped expert GEMMs (``moe_gemm.py``) want the N * K (token, slot) rows
grouped by expert and, since MLX has no indirect dispatch, a grid sized for
the worst case plus a map of which tile of rows belongs to which expert.
``moe_routing.metal`` computes both (``order``, ``offsets``, ``tiles``) in one
dispatch, with no round trip to the host; ``moe_routing_reference`` is the
same in numpy, the ground truth in tests.

The outputs' layout: docs/kernel-notes.md#moe-routing.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from ...toolchain.kernel import Kernel, Launch

# One threadgroup of THREADS (8 SIMD groups) per 8 buckets: each SIMD group
# compacts one bucket, so 256 experts use 33 threadgroups. Must match the body.
THREADS = 256
SIMD_GROUPS = THREADS // 32
NO_BUCKET = 0xFFFFFFFF
# The histogram and its scans live in threadgroup memory, 12 bytes a bucket.
MAX_EXPERTS = 2048
TILE_ROWS = (16, 32, 64)


def tile_rows_for(rows: int, experts: int) -> int:
    """GEMM tile rows for N * K = ``rows`` assignments over ``experts``: the
    smallest tile that holds the average expert's rows (fewer half-empty tiles
    for sparse experts, more weight reuse for busy ones)."""
    average = rows / max(experts, 1)
    for tile in TILE_ROWS:
        if average <= tile:
            return tile
    return TILE_ROWS[-1]


def max_tiles(rows: int, experts: int, tile_m: int) -> int:
    return math.ceil(rows / tile_m) + experts + 1


def moe_routing_supports(indices: mx.array, experts: int, tile_m: int) -> Optional[str]:
    if indices.ndim != 2 or indices.dtype != mx.uint32 or indices.size == 0:
        return f"indices {tuple(indices.shape)} {indices.dtype} (kernel: [N, K] uint32)"
    if not 1 <= experts <= MAX_EXPERTS:
        return f"{experts} experts (kernel: at most {MAX_EXPERTS})"
    if tile_m not in TILE_ROWS:
        return f"tile of {tile_m} rows (kernel: one of {TILE_ROWS})"
    if indices.size >= 2**31:
        return "too many rows for 32-bit indexing"
    return None


def _launch_moe_routing(indices: mx.array, experts: int, tile_m: int) -> Launch:
    rows = indices.size
    buckets = experts + 1
    groups = math.ceil(buckets / SIMD_GROUPS)

    def finish(outputs):
        order, offsets, tiles = outputs
        return order, offsets, tiles.reshape(-1, 3)

    return Launch(
        inputs=[indices],
        grid=(groups * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows,), (buckets + 1,), (3 * max_tiles(rows, experts, tile_m),)],
        output_dtypes=[mx.uint32, mx.uint32, mx.uint32],
        template=[
            ("E", experts),
            ("K", indices.shape[1]),
            ("TILE_M", tile_m),
            ("BUCKETS_PER_THREAD", math.ceil(buckets / THREADS)),
        ],
        finish=finish,
    )


def moe_routing_reference(indices: mx.array, experts: int, tile_m: int):
    """(order, offsets, tiles) as the kernel computes them, in numpy."""
    ids = np.array(indices).reshape(-1).astype(np.int64)
    rows = ids.size
    bucket = np.where(ids < experts, ids, experts)
    order = np.argsort(bucket, kind="stable").astype(np.uint32)
    counts = np.bincount(bucket, minlength=experts + 1)
    offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.uint32)
    tiles = np.zeros((max_tiles(rows, experts, tile_m), 3), np.uint32)
    tiles[:, 0] = NO_BUCKET
    t = 0
    for b in range(experts + 1):
        for begin in range(int(offsets[b]), int(offsets[b + 1]), tile_m):
            tiles[t] = (b, begin, min(begin + tile_m, int(offsets[b + 1])))
            t += 1
    return mx.array(order), mx.array(offsets), mx.array(tiles)


def moe_routing_agree(got, want, *args, **kwargs) -> Optional[str]:
    """The routing is exact: every output equal to the reference's."""
    for name, g, w in zip(("order", "offsets", "tiles"), got, want):
        g, w = np.array(g), np.array(w)
        if g.shape != w.shape or not np.array_equal(g, w):
            return f"{name} differs from the reference"
    return None


def _sample():
    # 24 experts, top-3, 11 tokens: uneven buckets, empty ones, one invalid id.
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 24, size=(11, 3)).astype(np.uint32)
    ids[4, 1] = 0xFFFFFFFF
    return (mx.array(ids), 24, 16), {}


moe_routing_kernel = Kernel(
    name="moe_routing",
    input_names=("indices",),
    output_names=("order", "offsets", "tiles"),
    body=Path(__file__).with_name("moe_routing.metal"),
    launch=_launch_moe_routing,
    reference=moe_routing_reference,
    sample=_sample,
    agree=moe_routing_agree,
)
