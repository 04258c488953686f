"""Batched decode attention (a ``start`` per row: mlx-lm's left-padded
BatchKVCache) on the GPU at the model's shapes, lengths up to 16K: each row
within one bf16 step of float64 attention over its own keys, and bit for bit
the row decoded alone (B = 1, start 0), whatever the batch, the other rows,
its position, its left padding and the view's capacity.

Run with ``python3 -m pytest tests/gpu -m gpu -q``; without a GPU every test
skips. The module's own constants (``SPLIT_FROM``, ``KEY_BLOCK`` ...) decide
each row's key blocks: spans below, at and past each threshold are chosen.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import pytest

import mlx_lily.kernels  # noqa: F401
from mlx_lily.kernels.attention.decode import MAX_BATCH
from mlx_lily.kernels.attention.testing import batch_decode_inputs, decode_request

from test_attention_gpu import assert_within_one_bf16_step, exact

A = sys.modules["mlx_lily.kernels.attention.sdpa"]

pytestmark = pytest.mark.gpu

HQ, HKV, D = 16, 2, 256
CAPACITY = 16384 + 256  # a whole number of BatchKVCache steps past 16K
# One key; just below and at the split; the smallest blocks' last span; larger
# blocks; the fixed block; 16K.
SPANS = (1, A.SPLIT_FROM - 1, A.SPLIT_FROM, 4096, 4097, 8193, 16384)


def request(n, seed):
    return decode_request(n, HQ, HKV, D, seed=seed)


def assert_rows_exact(got, requests):
    for b, (q, k, v) in enumerate(requests):
        assert_within_one_bf16_step(got[b:b + 1], exact(q, k, v, D**-0.5))


@pytest.mark.parametrize("B", [1, 2, 5, MAX_BATCH])
@pytest.mark.parametrize("per_row_ends", [False, True])
def test_batched_decode_at_real_shapes(backend, B, per_row_ends):
    rng = np.random.default_rng(B + 100 * per_row_ends)
    spans = [SPANS[(b + B) % len(SPANS)] for b in range(B)]
    if per_row_ends:
        starts = [int(rng.integers(0, CAPACITY - n + 1)) for n in spans]
    else:
        end = CAPACITY - int(rng.integers(0, 200))
        spans = [min(n, end) for n in spans]
        starts = [end - n for n in spans]
    requests = [request(n, seed=int(rng.integers(1 << 30))) for n in spans]
    args, kwargs = batch_decode_inputs(requests, starts, CAPACITY, per_row_ends=per_row_ends)
    fn, path, why = A.attention.choose(*args, **kwargs)
    assert path == "kernel", why
    got = A.attention(*args, **kwargs)
    assert A.attention.last_path == "kernel", A.attention.last_reason
    assert got.shape == (B, HQ, 1, D)
    assert_rows_exact(got, requests)
    assert A.attention_agree(got, A.attention_reference(*args, **kwargs)) is None


def alone(backend, one):
    n = one[1].shape[2]
    args, kwargs = batch_decode_inputs([one], [0], n)
    return A.run_decode(backend, *args, **kwargs)


@pytest.mark.parametrize("n", SPANS)
def test_a_row_s_bits_do_not_depend_on_the_batch(backend, n):
    A.attention_kernels.ready_on(backend)
    rng = np.random.default_rng(n)
    mine = request(n, seed=n)
    want = alone(backend, mine)
    assert_rows_exact(want, [mine])
    for B, capacity, per_row_ends in ((2, 16384, False), (5, CAPACITY, True), (MAX_BATCH, 16640, False),
                                      (MAX_BATCH, CAPACITY + 256, True), (1, 20000, True)):
        where = int(rng.integers(0, B))
        spans = [int(rng.integers(1, 2048)) for _ in range(B)]
        spans[where] = n
        if per_row_ends:
            starts = [int(rng.integers(0, capacity - s + 1)) for s in spans]
        else:
            end = capacity - int(rng.integers(0, capacity - n + 1))
            spans = [min(s, end) for s in spans]
            starts = [end - s for s in spans]
        requests = [request(s, seed=int(rng.integers(1 << 30))) for s in spans]
        requests[where] = mine
        args, kwargs = batch_decode_inputs(requests, starts, capacity, per_row_ends=per_row_ends)
        got = A.run_decode(backend, *args, **kwargs)
        assert mx.array_equal(got[where:where + 1], want).item(), (B, where, starts[where], capacity)


def test_a_batch_past_max_batch_runs_the_reference(backend):
    requests = [request(3, seed=b) for b in range(MAX_BATCH + 1)]
    args, kwargs = batch_decode_inputs(requests, [1] * (MAX_BATCH + 1), 4)
    fn, path, why = A.attention.choose(*args, **kwargs)
    assert path == "reference" and f"at most {MAX_BATCH}" in why
