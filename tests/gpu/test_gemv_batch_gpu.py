"""quantized_matvec for B rows of x on the GPU (Metal or CUDA), at the model's
shapes: the kernel against the reference's contract for B = 1, 2, 3, 5, 9 and
16 (every bucket, some with rows past B), and batch invariance bit for bit (a
row alone equals the same row inside batches of 2, 3, 5, 9 and 16, at any
position, whatever the other rows hold); the prologue's output staged whole or
in K tiles of 256, 512, 1024 and 2048 values gives the same bits.

Run on a GPU machine with ``python3 -m pytest tests/gpu -m gpu -q``; without a
GPU every test here skips. Each call asserts that the kernel path was taken
(built, self-checked and first-use checked), not a fallback to the reference.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_lily.kernels import OPS
from mlx_lily.kernels.linear.gemv import (
    quantized_matvec_agree,
    quantized_matvec_kernel,
    quantized_matvec_reference,
)
from mlx_lily.kernels.linear.testing import gemv_weights

pytestmark = pytest.mark.gpu

BATCHES = [1, 2, 3, 5, 9, 16]
HIDDEN = 2048
# Qwen3.5/3.6 MoE's decode calls (tests/test_gemv.py's CUDA compile test):
# (K, rows per segment, bits per segment, prologue, residual). DeltaNet's
# qkv/z/b/a after the input norm, the router with the shared-expert gate after
# the post-attention norm, out_proj with the residual, and attention's o_proj
# behind its sigmoid output gate (16 heads of 256: one half of each head's
# row of a [B, 1, 16, 512] tensor) with the residual.
CALLS = {
    "deltanet": (HIDDEN, (8192, 4096, 32, 32), (4, 4, 4, 4), "norm", False),
    "router": (HIDDEN, (256, 1), (8, 8), "norm", False),
    "out_proj": (4096, (HIDDEN,), (4,), "none", True),
    "o_proj": (4096, (HIDDEN,), (4,), "gate", True),
}
_WEIGHTS: dict = {}


def weights_for(name):
    """Each call's weights, made once per process (lm_head-size arrays take a while)."""
    if name not in _WEIGHTS:
        K, rows, bits, _, _ = CALLS[name]
        _WEIGHTS[name] = gemv_weights(K, rows, bits, seed=sum(rows))
        mx.eval(_WEIGHTS[name])
    return _WEIGHTS[name]


def inputs(name, batch, seed):
    """x [batch, 1, K] and the call's per-row inputs (gate, residual) and norm, as the model passes them."""
    K, rows, _, prologue, residual = CALLS[name]
    keys = mx.random.split(mx.random.key(seed), 4)
    x = mx.random.normal((batch, 1, K), key=keys[0]).astype(mx.bfloat16)
    kwargs = {}
    if prologue == "norm":
        kwargs["norm_weight"] = (1 + 0.2 * mx.random.normal((K,), key=mx.random.key(7))).astype(mx.bfloat16)
        kwargs["eps"] = 1e-6
    elif prologue == "gate":
        both = (2 * mx.random.normal((batch, 1, 16, 2 * K // 16), key=keys[1])).astype(mx.bfloat16)
        kwargs["gate"] = mx.split(both, 2, axis=-1)[1]
    if residual:
        kwargs["residual"] = mx.random.normal((batch, 1, rows[0]), key=keys[2]).astype(mx.bfloat16)
    return x, kwargs


def run_kernel(x, weights, **kwargs):
    op = OPS["quantized_matvec"]
    got = op(x, weights, **kwargs)
    mx.eval(got)
    assert op.last_path == "kernel", op.last_reason
    return got


def raw_bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16 if a.dtype.size == 2 else mx.uint32))


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("name", sorted(CALLS))
def test_b_rows_meet_the_contract_at_real_shapes(backend, name, batch):
    weights = weights_for(name)
    x, kwargs = inputs(name, batch, seed=batch)
    got = run_kernel(x, weights, **kwargs)
    want = quantized_matvec_reference(x, weights, **kwargs)
    mx.eval(want)
    assert [g.shape for g in got] == [(batch, 1, w.shape[0]) for w, _, _ in weights]
    mismatch = quantized_matvec_agree(got, want, x, weights, **kwargs)
    assert mismatch is None, mismatch


def batch_of(picks, x, kwargs, others, other_kwargs):
    """(x, kwargs) of a batch whose row i is row j of x (("x", j)) or of the
    others (("o", j)), with each row's gate and residual."""
    per_row = [n for n in ("gate", "residual") if n in kwargs]
    rows = [(x, kwargs) if source == "x" else (others, other_kwargs) for source, _ in picks]
    xb = mx.concatenate([src[j : j + 1] for (src, _), (_, j) in zip(rows, picks)], axis=0)
    call = {n: v for n, v in kwargs.items() if n not in per_row}
    for n in per_row:
        call[n] = mx.concatenate([kw[n][j : j + 1] for (_, kw), (_, j) in zip(rows, picks)], axis=0)
    return xb, call


@pytest.mark.parametrize("name", sorted(CALLS))
def test_a_row_has_the_same_bits_alone_and_anywhere_in_any_batch(backend, name):
    weights = weights_for(name)
    x, kwargs = inputs(name, 16, seed=100)
    others, other_kwargs = inputs(name, 16, seed=200)

    def run(picks):
        xb, call = batch_of(picks, x, kwargs, others, other_kwargs)
        return run_kernel(xb, weights, **call)

    targets = (0, 6, 15)
    alone = {j: run([("x", j)]) for j in targets}
    batches = [
        [("x", 0), ("o", 1)],
        [("o", 2), ("x", 6)],
        [("x", 15), ("o", 2), ("x", 0)],
        [("o", 3), ("x", 15), ("o", 4), ("x", 0), ("o", 5)],
        [("o", i) for i in range(4)] + [("x", 0), ("o", 5), ("x", 6), ("o", 7), ("x", 15)],
        [("o", i) for i in range(7)] + [("x", 15)] + [("o", i) for i in range(8, 14)] + [("x", 0), ("x", 6)],
        [("x", j) for j in range(16)],
    ]
    for picks in batches:
        got = run(picks)
        for position, (source, j) in enumerate(picks):
            if source != "x" or j not in alone:
                continue
            for s, (g, a) in enumerate(zip(got, alone[j])):
                assert np.array_equal(raw_bits(g[position : position + 1]), raw_bits(a)), (
                    f"{name}: segment {s} of row {j} at position {position} of {len(picks)} "
                    "differs from the row computed alone")


@pytest.mark.parametrize("name", sorted(CALLS))
def test_tiled_and_whole_k_staging_give_the_same_bits(backend, name):
    """One row (the whole of K fits): whole-K staging against tiles of 256,
    512 (halves of 32-value runs), 1024 and 2048 values, bit for bit."""
    weights = weights_for(name)
    x, kwargs = inputs(name, 1, seed=300)
    whole = quantized_matvec_kernel.run_on(backend, x, weights, **kwargs, stage_x=True)
    mx.eval(whole)
    for tile in (256, 512, 1024, 2048):
        tiled = quantized_matvec_kernel.run_on(backend, x, weights, **kwargs, tile=tile)
        mx.eval(tiled)
        for s, (t, w) in enumerate(zip(tiled, whole)):
            assert np.array_equal(raw_bits(t), raw_bits(w)), f"{name}: segment {s}, tiles of {tile}"
