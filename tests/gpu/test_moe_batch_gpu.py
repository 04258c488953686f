"""moe_decode over batches of 1 to 16 rows on the GPU, at the model's shapes.

Run with ``python3 -m pytest tests/gpu -m gpu -q``; without a GPU every test
skips. Shapes: D 2048, 256 experts top-8, experts' and shared I 512, bf16.
Each call checks that the kernel path ran (built, self-checked, first use
checked), not a fallback to the reference. The contract is the op's
(``moe_decode_agree``); batch invariance is bit for bit: a row alone and the
same row inside batches of 2, 5 and 16, at other positions, beside rows that
pick the same experts or disjoint ones.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import numpy as np
import pytest

from mlx_lily.kernels.moe.decode import MAX_BATCH, moe_decode, moe_decode_agree
from mlx_lily.kernels.moe.testing import quantized_moe

pytestmark = pytest.mark.gpu

D, E, TOP_K, I, IS = 2048, 256, 8, 512, 512


@functools.lru_cache(maxsize=1)
def layer():
    """(switch_mlp, shared_expert) at the real shape, 4-bit group 64, built once."""
    return quantized_moe(D, I, IS, E, seed=0)


def picking(experts, rng) -> np.ndarray:
    """A logits row whose top 8 are ``experts`` in that order, by clear margins."""
    row = rng.uniform(-4.0, -1.0, E)
    row[list(experts)] = np.linspace(6.0, 2.0, len(experts))
    return row


def call(logits: np.ndarray, seed: int):
    """moe_decode's arguments for len(logits) rows at the real shape."""
    rng = np.random.default_rng(seed)
    rows = logits.shape[0]
    normal = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    h = (4.0 * normal(rows, 1, D)).astype(mx.bfloat16)
    norm_weight = (1.0 + 0.1 * normal(D)).astype(mx.bfloat16)
    router_logits = mx.array(logits.astype(np.float32)).reshape(rows, 1, E).astype(mx.bfloat16)
    shared_gate_logit = normal(rows, 1, 1).astype(mx.bfloat16)
    glu, shared = layer()
    return (h, router_logits, shared_gate_logit, norm_weight, 1e-6, TOP_K, True, glu, shared)


def through_kernels(args):
    got = moe_decode(*args)
    mx.eval(got)
    assert moe_decode.last_path == "kernel", moe_decode.last_reason
    return got


@pytest.mark.parametrize("rows", [1, 2, 5, 16])
def test_batches_meet_the_contract(backend, rows):
    rng = np.random.default_rng(rows)
    args = call(2.0 * rng.standard_normal((rows, E)), seed=rows)
    got = through_kernels(args)
    assert got.shape == (rows, 1, D) and got.dtype == mx.bfloat16
    mismatch = moe_decode_agree(got, got, *args)
    assert mismatch is None, mismatch


def test_a_row_is_the_same_bits_alone_and_in_any_batch(backend):
    rng = np.random.default_rng(7)
    mine = [5, 90, 17, 200, 33, 64, 128, 255]
    same = [list(reversed(mine)), mine[4:] + mine[:4], mine]
    overlap = [mine[:4] + [1, 2, 3, 4], [6, 7, 8, 9] + mine[4:]]
    disjoint = [list(range(s, s + 8)) for s in (18, 40, 100, 140, 160, 210)]
    rows = [picking(p, rng) for p in same + overlap + disjoint]
    while len(rows) < MAX_BATCH - 1:
        rows.append(2.0 * rng.standard_normal(E))
    at = 11  # the row under test, in the batch of 16
    logits = np.stack(rows[:at] + [picking(mine, rng)] + rows[at:])
    h, lg, sl, w, eps, k, normalize, glu, shared = call(logits, seed=3)

    def run(order):
        idx = mx.array(order)
        return through_kernels((h[idx], lg[idx], sl[idx], w, eps, k, normalize, glu, shared))

    def bits(a):
        return np.array(a.view(mx.uint16))

    alone = run([at])
    batches = [
        [at, 0],                      # 2: first, beside a row of the same experts
        [6, at],                      # 2: second, beside disjoint experts
        [3, 8, at, 1, 4],             # 5: middle, same, overlapping and disjoint
        [5, 6, 7, 8, at],             # 5: last
        list(range(MAX_BATCH)),       # 16: in place
        [at] + [i for i in reversed(range(MAX_BATCH)) if i != at],  # 16: first, the rest reversed
    ]
    for order in batches:
        got = run(order)
        assert np.array_equal(bits(got[order.index(at)]), bits(alone[0])), order
    full = run(list(range(MAX_BATCH)))
    for b in range(MAX_BATCH):
        assert np.array_equal(bits(full[b]), bits(run([b])[0])), b
