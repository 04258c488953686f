"""The batched Gated DeltaNet decode step (gated_delta_decode, B = 1..16) on the GPU.

At Qwen3.6-35B-A3B's shapes (16 key heads, 32 value heads, Dk = Dv = 128,
conv kernel 4): the kernel against the CPU reference with and without padding
masks; each row the same bits alone and inside batches; a padding step keeps
its row's conv and recurrent state. Run with ``python3 -m pytest tests -m gpu -q``.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_lily import kernels as K
from mlx_lily.kernels.gated_delta.decode import MAX_BATCH, gated_delta_decode_agree, gated_delta_decode_kernel
from mlx_lily.kernels.gated_delta.testing import (
    gated_delta_decode_batch,
    gated_delta_decode_inputs,
    gated_delta_decode_rows,
)

pytestmark = pytest.mark.gpu

GDN_HEADS = (16, 32, 128, 128)
MASKS = {1: [False], 2: [True, False], 5: [False, True, True, False, True], 16: [i % 3 != 1 for i in range(16)]}


def same_bits(got, want) -> bool:
    return all(g.dtype == w.dtype and g.shape == w.shape and mx.array_equal(g, w).item() for g, w in zip(got, want))


def masked_rows_kept(args, mask, got) -> list:
    """The padding rows whose conv state or state came back changed."""
    changed = []
    for b, real in enumerate(mask):
        if real:
            continue
        kept_state = args[8][b] if args[8] is not None else mx.zeros_like(got[2][b])
        if not (mx.array_equal(got[1][b], args[4][b]).item() and mx.array_equal(got[2][b], kept_state).item()):
            changed.append(b)
    return changed


@pytest.mark.parametrize("B", [1, 2, 5, MAX_BATCH])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_rows_meet_the_contract_at_real_shapes(backend, B, masked, dtype):
    mask = MASKS[B] if masked else None
    args, kwargs = gated_delta_decode_inputs(*GDN_HEADS, B=B, seed=B, mask=mask, dtype=dtype)
    got = gated_delta_decode_kernel.run_on(backend, *args, **kwargs)
    mx.eval(got)
    # Judged against the CPU's reference (see the op's contract).
    assert gated_delta_decode_agree(got, None, *args, **kwargs) is None
    if mask is not None:
        assert masked_rows_kept(args, mask, got) == []


def test_the_op_takes_the_kernel_for_a_masked_batch(backend):
    args, kwargs = gated_delta_decode_inputs(*GDN_HEADS, B=MAX_BATCH, seed=3, mask=MASKS[16])
    got = K.gated_delta_decode(*args, **kwargs)
    mx.eval(got)
    assert K.gated_delta_decode.last_path == "kernel", K.gated_delta_decode.last_reason
    assert masked_rows_kept(args, MASKS[16], got) == []


@pytest.mark.parametrize("with_state", [True, False])
def test_a_row_is_the_same_bits_in_any_batch_at_real_shapes(backend, with_state):
    calls = gated_delta_decode_rows(*GDN_HEADS, MAX_BATCH, with_state=with_state, seed=200)
    alone = [gated_delta_decode_kernel.run_on(backend, *c) for c in calls]
    mx.eval(alone)
    batches = [
        ([3, 0], None),
        ([0, 3], [True, False]),
        ([7, 2, 3, 11, 5], None),
        ([5, 3, 9, 0, 14], [False, True, True, False, True]),
        (list(range(16)), None),
        (list(range(15, -1, -1)), MASKS[16]),
    ]
    for order, mask in batches:
        args, kwargs = gated_delta_decode_batch([calls[r] for r in order], mask)
        got = gated_delta_decode_kernel.run_on(backend, *args, **kwargs)
        mx.eval(got)
        for position, r in enumerate(order):
            if mask is None or mask[position]:
                mine = tuple(o[position : position + 1] for o in got)
                assert same_bits(mine, alone[r]), f"row {r} at {position} of {order}"
        if mask is not None:
            assert masked_rows_kept(args, mask, got) == []


def test_padding_steps_keep_a_row_s_states_over_steps(backend):
    # Row 1 padding for four steps while row 0 decodes: row 1's states come
    # back as they went in, bit for bit; row 0's go on as they would alone.
    calls = gated_delta_decode_rows(*GDN_HEADS, 2, seed=300)
    args, kwargs = gated_delta_decode_batch(calls, [True, False])
    args, alone = list(args), list(calls[0])
    rng = np.random.default_rng(0)
    for step in range(4):
        got = gated_delta_decode_kernel.run_on(backend, *args, **kwargs)
        mine = gated_delta_decode_kernel.run_on(backend, *alone)
        mx.eval(got, mine)
        assert same_bits(tuple(o[:1] for o in got), mine), f"step {step}: the real row"
        assert mx.array_equal(got[1][1], calls[1][4][0]).item(), f"step {step}: conv state changed"
        assert mx.array_equal(got[2][1], calls[1][8][0]).item(), f"step {step}: state changed"
        # The next token: new activations for both rows, each path's own states.
        fresh, _ = gated_delta_decode_inputs(*GDN_HEADS, B=2, rng=rng)
        args[:4] = fresh[:4]
        alone[:4] = [x[:1] for x in fresh[:4]]
        args[4], args[8] = got[1], got[2]
        alone[4], alone[8] = mine[1], mine[2]
