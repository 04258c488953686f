"""quantized_matvec_tiles (the decode GEMV on matrix tiles) on the GPU, at the
model's 4-bit decode calls: the contract for B = 1, 2, 5 and 16, and batch
invariance bit for bit (a row alone equals the same row inside batches of 2,
5 and 16, at any position, whatever the other rows hold). On CUDA this is
the first run of its tensor-core form (the emulator runs Metal's layout).

Run on a GPU machine with ``python3 -m pytest tests/gpu -m gpu -q``; without a
GPU every test here skips. Each call asserts that the kernel path was taken.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_lily.kernels import OPS
from mlx_lily.kernels.linear.gemv import quantized_matvec_agree, quantized_matvec_reference
from test_gemv_batch_gpu import CALLS as GEMV_CALLS
from test_gemv_batch_gpu import batch_of, inputs, raw_bits, weights_for

pytestmark = pytest.mark.gpu

# The 4-bit calls (the router's is 8-bit: the row-parallel GEMV keeps it).
CALLS = sorted(name for name, (_, _, bits, _, _) in GEMV_CALLS.items() if set(bits) == {4})


def run_tiles(x, weights, **kwargs):
    op = OPS["quantized_matvec_tiles"]
    got = op(x, weights, **kwargs)
    mx.eval(got)
    assert op.last_path == "kernel", op.last_reason
    return got


@pytest.mark.parametrize("batch", [1, 2, 5, 16])
@pytest.mark.parametrize("name", CALLS)
def test_the_tile_gemv_meets_the_contract_at_real_shapes(backend, name, batch):
    weights = weights_for(name)
    x, kwargs = inputs(name, batch, seed=batch)
    got = run_tiles(x, weights, **kwargs)
    want = quantized_matvec_reference(x, weights, **kwargs)
    mx.eval(want)
    mismatch = quantized_matvec_agree(got, want, x, weights, **kwargs)
    assert mismatch is None, mismatch


@pytest.mark.parametrize("name", CALLS)
def test_a_row_has_the_same_bits_alone_and_in_any_batch(backend, name):
    weights = weights_for(name)
    x, kwargs = inputs(name, 16, seed=100)
    others, other_kwargs = inputs(name, 16, seed=200)

    def run(picks):
        xb, call = batch_of(picks, x, kwargs, others, other_kwargs)
        return run_tiles(xb, weights, **call)

    alone = {j: run([("x", j)]) for j in (0, 6, 15)}
    batches = [
        [("x", 0), ("o", 1)],
        [("o", 3), ("x", 15), ("o", 4), ("x", 0), ("o", 5)],
        [("o", i) for i in range(7)] + [("x", 15)] + [("o", i) for i in range(8, 14)] + [("x", 0), ("x", 6)],
    ]
    for picks in batches:
        got = run(picks)
        for position, (source, j) in enumerate(picks):
            if source == "x" and j in alone:
                for s, (g, a) in enumerate(zip(got, alone[j])):
                    assert np.array_equal(raw_bits(g[position : position + 1]), raw_bits(a)), (
                        f"{name}: segment {s} of row {j} at position {position} of {len(picks)}")
