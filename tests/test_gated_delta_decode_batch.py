"""The Gated DeltaNet decode step for batches of rows (gated_delta_decode, B = 1..16).

In the CPU emulator at small shapes: the kernel against the reference with
and without padding masks; each row's bits independent of the batch around
it; a padding step keeps its row's states; more than MAX_BATCH rows fall back
to the reference; one CUDA build for every B, compiled with nvcc.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_lily import kernels as K
from mlx_lily.kernels.gated_delta.decode import (
    MAX_BATCH,
    gated_delta_decode_agree,
    gated_delta_decode_kernel,
    gated_delta_decode_reference,
    gated_delta_decode_supports,
)
from mlx_lily.kernels.gated_delta.testing import (
    gated_delta_decode_batch,
    gated_delta_decode_inputs,
    gated_delta_decode_rows,
)
from mlx_lily.toolchain.registry import BACKEND_ENV

from test_toolchain import emulator_or_skip, nvcc_ptx

# (Hk, Hv, Dk, Dv): two value heads per key head, Dv not a multiple of 32.
HEADS = (1, 2, 32, 8)
MASKS = {1: [False], 2: [True, False], 5: [False, True, True, False, True], 16: [i % 3 != 1 for i in range(16)]}


def rows_call(B, seed, mask=None, with_state=True, heads=HEADS):
    return gated_delta_decode_inputs(*heads, B=B, seed=seed, mask=mask, with_state=with_state)


def pool(n, with_state=True):
    """n one-row calls with one layer's weights and their own activations and states."""
    return gated_delta_decode_rows(*HEADS, n, with_state=with_state, seed=100)


def row(outputs, b):
    return tuple(o[b : b + 1] for o in outputs)


def assert_same_bits(got, want, what):
    for name, g, w in zip(("out", "conv state", "state"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, f"{what}: {name}"
        assert mx.array_equal(g, w).item(), f"{what}: {name} differs"


def assert_masked_rows_kept(args, kwargs, got):
    """A padding row keeps its recurrent state; its conv state is kept, or
    (``padding_shifts_conv``) shifted up by one row with a zero row last."""
    conv_in, state_in = args[4], args[8]
    for b, real in enumerate(np.array(kwargs.get("mask", mx.ones((got[1].shape[0], 1), mx.bool_)))[:, 0]):
        if real:
            continue
        kept_state = state_in[b : b + 1] if state_in is not None else mx.zeros_like(got[2][b : b + 1])
        kept_conv = conv_in[b : b + 1] if conv_in is not None else mx.zeros_like(got[1][b : b + 1])
        if kwargs.get("padding_shifts_conv"):
            kept_conv = mx.concatenate([kept_conv[:, 1:], mx.zeros_like(kept_conv[:, :1])], axis=1)
        assert mx.array_equal(got[1][b : b + 1], kept_conv).item(), f"row {b}: conv state changed"
        assert mx.array_equal(got[2][b : b + 1], kept_state).item(), f"row {b}: state changed"


# -- (a) the contract, with and without padding ----------------------------------------------


@pytest.mark.parametrize("B", [1, 2, 5, 16])
@pytest.mark.parametrize("masked", [False, "keep", "shift"])
def test_rows_meet_the_contract(B, masked):
    emulator_or_skip()
    args, kwargs = rows_call(B, seed=B, mask=MASKS[B] if masked else None)
    if masked == "shift":
        kwargs["padding_shifts_conv"] = True
    assert gated_delta_decode_supports(*args, **kwargs) is None
    got = gated_delta_decode_kernel.emulate(*args, **kwargs)
    want = gated_delta_decode_reference(*args, **kwargs)
    mx.eval(got, want)
    assert gated_delta_decode_agree(got, want) is None
    assert got[0].shape == (B, 1, HEADS[1], HEADS[3]) and got[2].shape == (B, *HEADS[1:2], HEADS[3], HEADS[2])
    assert_masked_rows_kept(args, kwargs, got)


@pytest.mark.parametrize("conv_state", ["none", "zeros"])
def test_a_sequence_start_with_padding(conv_state):
    # No recurrent state yet, a zero (or no) conv state: left padding's first steps.
    emulator_or_skip()
    args, kwargs = rows_call(5, seed=11, mask=MASKS[5], with_state=False)
    args = list(args)
    args[4] = None if conv_state == "none" else mx.zeros_like(args[4])
    assert gated_delta_decode_supports(*args, **kwargs) is None
    got = gated_delta_decode_kernel.emulate(*args, **kwargs)
    want = gated_delta_decode_reference(*args, **kwargs)
    assert gated_delta_decode_agree(got, want) is None
    assert_masked_rows_kept(args, kwargs, got)
    # No conv state is a zero one, to the bit.
    zeros = list(args)
    zeros[4] = mx.zeros((5, 3, args[0].shape[-1]), args[0].dtype)
    assert_same_bits(gated_delta_decode_kernel.emulate(*zeros, **kwargs), got, "conv_state None vs zeros")


def test_the_reference_is_stock_s_masked_step():
    # Stock's layer: the padding step's qkv zeroed before the convolution, the
    # recurrent state kept by gated_delta_update's mask, the conv state's rows
    # taken from the row's end (cache.lengths; a masked row's length is 0).
    from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

    from mlx_lily.kernels.gated_delta.conv import conv1d_silu_reference
    from mlx_lily.kernels.gated_delta.norm import gated_rms_norm_reference

    args, kwargs = rows_call(5, seed=12, mask=MASKS[5])
    qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, state, norm_weight, eps, Hk = args
    mask = kwargs["mask"]
    Hv, Dv, Dk = HEADS[1], HEADS[3], HEADS[2]
    conv_input = mx.concatenate([conv_state, mx.where(mask[..., None], qkv, 0)], axis=1)
    ends = mx.clip(mask[:, 0].astype(mx.int32), 0, 1)
    positions = (ends[:, None] + mx.arange(3))[..., None]
    conv = mx.take_along_axis(conv_input, positions, axis=1)
    q, k, v = mx.split(conv1d_silu_reference(conv_input, conv_weight), [Hk * Dk, 2 * Hk * Dk], axis=-1)
    q, k = normalize_qk(q.reshape(5, 1, Hk, Dk), k.reshape(5, 1, Hk, Dk), inv_scale=Dk**-0.5, eps=1e-6)
    y, s = gated_delta_update(q, k, v.reshape(5, 1, Hv, Dv), a, b, A_log, dt_bias, state, mask, use_kernel=False)
    stock = (gated_rms_norm_reference(y, z, norm_weight, eps), conv, s)
    assert_same_bits(gated_delta_decode_reference(*args, **kwargs), stock, "reference vs stock")
    # A cache without lengths (the server's decode): stock shifts the zeroed
    # row into the conv state; the recurrent state and out as above.
    shifted = (stock[0], conv_input[:, 1:], s)
    assert_same_bits(gated_delta_decode_reference(*args, **kwargs, padding_shifts_conv=True), shifted,
                     "reference vs stock, no lengths")
    # Without a mask: the plain step, as before.
    plain = gated_delta_decode_reference(*args)
    assert_same_bits(gated_delta_decode_reference(*args, mask=mx.ones((5, 1), mx.bool_)), plain, "all real")


# -- (b) a row's bits do not depend on its batch ---------------------------------------------


@pytest.mark.parametrize("with_state", [True, False])
def test_a_row_is_the_same_bits_in_any_batch(with_state):
    emulator_or_skip()
    calls = pool(16, with_state)
    alone = [gated_delta_decode_kernel.emulate(*c) for c in calls]
    mx.eval(alone)
    # (order of rows, padding mask or None): the rows at different
    # positions, beside different neighbours, some of them padding.
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
        got = gated_delta_decode_kernel.emulate(*args, **kwargs)
        mx.eval(got)
        for position, r in enumerate(order):
            if mask is None or mask[position]:
                assert_same_bits(row(got, position), alone[r], f"row {r} at {position} of {order}")
        assert_masked_rows_kept(args, kwargs, got)


def test_one_build_and_one_launch_shape_for_every_batch_size():
    one, _ = rows_call(1, seed=1)
    many, kwargs = rows_call(MAX_BATCH, seed=1, mask=MASKS[16])
    small = gated_delta_decode_kernel.launch(*one)
    large = gated_delta_decode_kernel.launch(*many, **kwargs)
    assert small.template == large.template and small.threadgroup == large.threadgroup
    assert small.grid == (large.grid[0], 1, 1) and large.grid[1] == MAX_BATCH
    assert [x.dtype for x in small.inputs] == [x.dtype for x in large.inputs]


# -- (c) padding keeps the row's states ------------------------------------------------------


def test_a_padding_step_keeps_its_row_s_states_over_steps():
    # Three steps, row 1 padding throughout, row 0 real: row 1's states come
    # back as they went in, row 0's go on as they would alone.
    emulator_or_skip()
    calls = pool(2)
    args, kwargs = gated_delta_decode_batch(calls, [True, False])
    args = list(args)
    alone = list(calls[0])
    for step in range(3):
        got = gated_delta_decode_kernel.emulate(*args, **kwargs)
        mine = gated_delta_decode_kernel.emulate(*alone)
        assert_same_bits(row(got, 0), mine, f"step {step}: the real row")
        assert mx.array_equal(got[1][1], calls[1][4][0]).item()
        assert mx.array_equal(got[2][1], calls[1][8][0]).item()
        args[4], args[8] = got[1], got[2]
        alone[4], alone[8] = mine[1], mine[2]


# -- (d) past MAX_BATCH: the reference -------------------------------------------------------


def test_more_rows_than_max_batch_run_the_reference(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "emulator")
    args, kwargs = rows_call(MAX_BATCH + 1, seed=2, mask=[True] * MAX_BATCH + [False])
    why = gated_delta_decode_supports(*args, **kwargs)
    assert why is not None and f"B={MAX_BATCH + 1}" in why and str(MAX_BATCH) in why
    got = K.gated_delta_decode(*args, **kwargs)
    assert K.gated_delta_decode.last_path == "reference" and f"B={MAX_BATCH + 1}" in K.gated_delta_decode.last_reason
    assert_same_bits(got, gated_delta_decode_reference(*args, **kwargs), "B=17")


def test_supports_names_a_wrong_mask_and_wrong_row_counts():
    args, _ = rows_call(2, seed=3)
    assert "mask" in gated_delta_decode_supports(*args, mask=mx.ones((2,), mx.bool_))
    assert "mask" in gated_delta_decode_supports(*args, mask=mx.ones((2, 1), mx.int32))
    short = list(args)
    short[8] = args[8][:1]
    assert "state" in gated_delta_decode_supports(*short)
    short = list(args)
    short[4] = args[4][:1]
    assert "conv_state" in gated_delta_decode_supports(*short)


# -- (e) CUDA ----------------------------------------------------------------------------------


def test_batched_masked_calls_compile_for_cuda_without_local_memory(tmp_path):
    real = (16, 32, 128, 128)
    one = gated_delta_decode_kernel.cuda_translation_unit(*rows_call(1, seed=0, heads=real)[0])
    args, kwargs = rows_call(MAX_BATCH, seed=0, heads=real, mask=MASKS[16])
    many = gated_delta_decode_kernel.cuda_translation_unit(*args, **kwargs)
    assert one == many  # B is the grid's rows only: one build serves every batch
    for text in nvcc_ptx(tmp_path, {"gdd_batch": many}).values():
        assert "ld.local" not in text and "st.local" not in text


# -- (f) P positions of one stream in one launch (speculative verification) -------------------


@pytest.mark.parametrize("P,with_state,K_conv,dtype", [
    (1, True, 4, mx.bfloat16), (3, True, 4, mx.bfloat16), (5, False, 4, mx.bfloat16),
    (4, True, 2, mx.float16), (6, True, 3, mx.bfloat16), (MAX_BATCH, True, 4, mx.bfloat16),
])
def test_steps_give_each_position_the_one_row_kernel_s_bits(P, with_state, K_conv, dtype):
    # The launch of P positions against P one-row launches, each fed the
    # previous one's conv state and state: every output the same bits, and
    # the contract against the reference.
    from mlx_lily.kernels.gated_delta.decode import gated_delta_decode_steps_agree, gated_delta_decode_steps_kernel
    from mlx_lily.kernels.gated_delta.testing import gated_delta_decode_steps_inputs

    emulator_or_skip()
    args, _ = gated_delta_decode_steps_inputs(2, 4, 32, 8, P, K=K_conv, with_state=with_state, seed=P, dtype=dtype)
    got = gated_delta_decode_steps_kernel.emulate(*args)
    conv, state = args[4], args[8]
    outs, convs, states = [], [], []
    for p in range(P):
        one = list(args)
        one[:4] = [x[p:p + 1] for x in args[:4]]
        one[4], one[8] = conv, state
        out, conv, state = gated_delta_decode_kernel.emulate(*one)
        outs.append(out)
        convs.append(conv)
        states.append(state)
    want = tuple(mx.concatenate(parts, axis=0) for parts in (outs, convs, states))
    assert_same_bits(got, want, f"{P} positions")
    assert gated_delta_decode_steps_agree(got, None, *args) is None


def test_steps_take_one_stream_and_at_most_max_batch_positions():
    from mlx_lily.kernels.gated_delta.decode import gated_delta_decode_steps_supports
    from mlx_lily.kernels.gated_delta.testing import gated_delta_decode_steps_inputs

    args, _ = gated_delta_decode_steps_inputs(2, 4, 32, 8, 3)
    assert gated_delta_decode_steps_supports(*args) is None
    two_streams = list(args)
    two_streams[4] = mx.concatenate([args[4], args[4]], axis=0)
    assert "one stream" in gated_delta_decode_steps_supports(*two_streams)
    two_states = list(args)
    two_states[8] = mx.concatenate([args[8], args[8]], axis=0)
    assert "one stream" in gated_delta_decode_steps_supports(*two_states)
    many, _ = gated_delta_decode_steps_inputs(2, 4, 32, 8, MAX_BATCH + 1)
    assert f"1 to {MAX_BATCH}" in gated_delta_decode_steps_supports(*many)
    # Elsewhere the op runs its reference: the one-row reference per position.
    assert K.gated_delta_decode_steps.choose(*many)[1] == "reference"


def test_steps_compile_for_cuda_without_local_memory(tmp_path):
    from mlx_lily.kernels.gated_delta.decode import gated_delta_decode_steps_kernel
    from mlx_lily.kernels.gated_delta.testing import gated_delta_decode_steps_inputs

    args, _ = gated_delta_decode_steps_inputs(16, 32, 128, 128, 4)
    unit = gated_delta_decode_steps_kernel.cuda_translation_unit(*args)
    for text in nvcc_ptx(tmp_path, {"gdd_steps": unit}).values():
        assert "ld.local" not in text and "st.local" not in text
