"""moe_decode's no-residual form (``residual=False``): a tensor-parallel
rank's partial MoE output, which the sharded layer sums across ranks before
adding h (stock's order).

The contract between the two forms, element by element (T the activations'
dtype, bf16 or fp16; "+" of two T arrays computed in fp32 and rounded once,
as MLX adds them):

    moe_decode(..., residual=True) == h + moe_decode(..., residual=False)

to the bit, on the kernels (the combine computes the same rounded MoE output
in both forms and adds h with one rounding, or not) and on the reference
(stock's ops: ``h + moe``). The no-residual form itself meets the chain's
contract (``moe_decode_agree``) against stock's math without h, and its
reference is stock's block (no sharding group) to the bit.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_lily import kernels as K
from mlx_lily.kernels.moe.decode import (
    moe_decode_agree, moe_decode_kernel, moe_decode_precise, moe_decode_reference, moe_decode_supports,
)
from mlx_lily.kernels.moe.testing import moe_decode_inputs
from mlx_lily.toolchain.registry import BACKEND_ENV

from test_moe_decode import _stock_block
from test_toolchain import emulator_or_skip

# (D, E, k, I, shared I, renormalise, rows, dtype)
CASES = [
    (128, 24, 3, 64, 128, True, 1, mx.bfloat16),
    (64, 13, 2, 64, 64, False, 3, mx.bfloat16),
    (128, 24, 3, 128, 64, True, 2, mx.float16),
]


@pytest.mark.parametrize("D, E, k, I, IS, normalize, rows, dtype", CASES)
def test_no_residual_form_meets_the_contract_and_adds_up_to_the_residual_form(D, E, k, I, IS, normalize, rows,
                                                                              dtype):
    emulator_or_skip()
    args, _ = moe_decode_inputs(D, E, k, I, IS, normalize=normalize, seed=D + E + rows, dtype=dtype, rows=rows)
    assert moe_decode_supports(*args, residual=False) is None
    without = moe_decode_kernel.emulate(*args, residual=False)
    with_h = moe_decode_kernel.emulate(*args)
    want = moe_decode_reference(*args, residual=False)
    mx.eval(without, with_h, want)
    assert without.shape == with_h.shape == (rows, 1, D) and without.dtype == with_h.dtype == dtype
    mismatch = moe_decode_agree(without, want, *args, residual=False)
    assert mismatch is None, mismatch
    # The two forms, to the bit (the contract in the module docstring).
    h = args[0]
    assert mx.array_equal(with_h, h + without).item()
    # The same relation holds for the reference and for the precise result.
    assert mx.array_equal(moe_decode_reference(*args), h + want).item()
    precise_with, _ = moe_decode_precise(*args)
    precise_without, _ = moe_decode_precise(*args, residual=False)
    assert mx.array_equal(precise_with, h + precise_without).item()
    # Not a trivial relation: h is not small next to the MoE output.
    assert not mx.array_equal(with_h, without).item()


def test_no_residual_form_does_not_read_h():
    emulator_or_skip()
    args, _ = moe_decode_inputs(64, 8, 2, 64, 64, seed=4, rows=2)
    h = args[0]
    # The combine alone: h full of NaN changes nothing without the residual.
    from mlx_lily.kernels.moe.decode import moe_decode_combine_kernel

    terms = mx.array(np.random.default_rng(4).standard_normal((2, 3, 64)).astype(np.float32)).astype(h.dtype)
    nan_h = mx.full(h.shape, np.nan, dtype=h.dtype)
    plain = moe_decode_combine_kernel.emulate(h, terms, False)
    assert mx.array_equal(moe_decode_combine_kernel.emulate(nan_h, terms, False), plain).item()
    assert mx.isnan(moe_decode_combine_kernel.emulate(nan_h, terms, True)).all().item()
    assert mx.array_equal(moe_decode_combine_kernel.emulate(h, terms, True), h + plain).item()


def test_agree_rejects_a_no_residual_output_that_kept_h():
    args, _ = moe_decode_inputs(64, 8, 2, 64, 64, seed=7)
    with_h, _ = moe_decode_precise(*args)
    without, _ = moe_decode_precise(*args, residual=False)
    assert moe_decode_agree(without, without, *args, residual=False) is None
    assert "magnitudes" in moe_decode_agree(with_h, without, *args, residual=False)


@pytest.mark.parametrize("normalize", [True, False])
def test_the_no_residual_reference_is_stock_s_block_to_the_bit(normalize, monkeypatch):
    """What stock's block returns (a sharded rank's: before its all_sum)."""
    monkeypatch.setenv(BACKEND_ENV, "reference")
    D, E, k = 128, 24, 3
    block = _stock_block(D, E, k, 64, 128, normalize, seed=5)
    rng = np.random.default_rng(5)
    h = mx.array(4 * rng.standard_normal((2, 1, D)).astype(np.float32)).astype(mx.bfloat16)
    w = mx.array(1 + 0.1 * rng.standard_normal(D).astype(np.float32)).astype(mx.bfloat16)
    xn = mx.fast.rms_norm(h, w, 1e-6)
    args = (h, block.gate(xn), block.shared_expert_gate(xn), w, 1e-6, k, normalize, block.switch_mlp,
            block.shared_expert)
    stock = block(xn)
    assert mx.array_equal(moe_decode_reference(*args, residual=False), stock).item()
    assert mx.array_equal(K.moe_decode(*args, residual=False), stock).item()
    assert K.moe_decode.last_path == "reference"
