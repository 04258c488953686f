"""The full-attention layer's output gate, applied where the attention decode
kernels write their output (``attention(..., gate=)``), in the CPU emulator.

Stock's layer computes ``o_proj(out * mx.sigmoid(gate))``; lily's decode step
applied the gate in the output projection's GEMV prologue, where every
threadgroup computed the sigmoid of every gate value. Now the one-block decode
launch (or the split's combine) applies it once an element, and the
projection runs without a prologue. These tests hold the change to the same
bits: the gated kernels against the ungated kernels then the prologue's
arithmetic (and within a step of stock's two ops), and the projection of a
gated output against the gate prologue's, in both GEMV forms, at 1 to 16
rows.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import pytest

import mlx_lily.kernels  # noqa: F401  (registers the ops)
from mlx_lily import kernels as K
from mlx_lily.kernels.attention.decode import RowForm, batch_check_inputs, rows_check_inputs
from mlx_lily.kernels.attention.testing import bounded_check_inputs, decode_check_inputs, output_gate
from mlx_lily.kernels.linear.gemv_tiles import GEMV_ENV, takes_tiles
from mlx_lily.kernels.linear.testing import gemv_weights

from test_toolchain import emulator_or_skip

A = sys.modules["mlx_lily.kernels.attention.sdpa"]


def kernel_sigmoid(gate: mx.array) -> mx.array:
    """sigmoid(gate) in fp32 as the kernels compute it (and the GEMV's gate
    prologue did): exp(|g|) rounded to the gate's dtype, then 1 / (1 + e)
    for g < 0, else 1 minus that, rounded to the dtype again."""
    dtype, g = gate.dtype, gate.astype(mx.float32)
    # exp correctly rounded to fp32, as the kernels' precise exp gives it
    # (MLX's CPU exp can be an fp32 step off, enough to round another way).
    e = mx.array(np.exp(np.array(mx.abs(g)).astype(np.float64)).astype(np.float32))
    e = e.astype(dtype).astype(mx.float32)
    negative = 1.0 / (1.0 + e)
    return mx.where(g < 0, negative, 1.0 - negative).astype(dtype).astype(mx.float32)


def kernel_gated(out: mx.array, gate: mx.array) -> mx.array:
    """``out`` [B, Hq, 1, D] gated as the kernels gate it: the output as
    rounded, times ``kernel_sigmoid``, rounded once more."""
    B, Hq, _, D = out.shape
    return (out.astype(mx.float32) * kernel_sigmoid(gate.reshape(B, Hq, 1, D))).astype(out.dtype)


def _fp16(args):
    return tuple(a.astype(mx.float16) if isinstance(a, mx.array) and a.dtype == mx.bfloat16 else a for a in args)


# (case, args, kwargs, run_decode's launch choices)
CASES = [
    ("one pass", decode_check_inputs(37, Hq=8, Hkv=2, D=64), {}, {"split_from": 1 << 30}),
    ("split", decode_check_inputs(37, Hq=8, Hkv=2, D=64), {}, {"split_from": 1, "key_block": 8}),
    ("one pass fp16", _fp16(decode_check_inputs(21, Hq=4, Hkv=1, D=32)), {}, {"split_from": 1 << 30}),
    ("split fp16", _fp16(decode_check_inputs(21, Hq=4, Hkv=1, D=32)), {}, {"split_from": 1, "key_block": 8}),
    ("bounded split", bounded_check_inputs(19, 45)[:5], {"length": bounded_check_inputs(19, 45)[5]},
     {"split_from": 1, "key_block": 8}),
    ("batch, one block", batch_check_inputs()[:5], batch_check_inputs()[5], {"row_form": RowForm(1 << 30, 4, 8, 8)}),
    ("batch, split", batch_check_inputs()[:5], batch_check_inputs()[5], {"row_form": RowForm(8, 4, 8, 8)}),
    ("rows of one view", rows_check_inputs([17, 18, 19], 45)[:5], {"length": rows_check_inputs([17, 18, 19], 45)[5]},
     {"split_from": 1, "key_block": 8}),
]


@pytest.mark.parametrize("case, args, kwargs, launch", CASES, ids=[c[0] for c in CASES])
def test_the_gated_kernels_give_stock_s_product_of_the_ungated_output(case, args, kwargs, launch):
    emulator_or_skip()
    q = args[0]
    B, Hq, _, D = q.shape
    gate = output_gate(B, 1, Hq, D, dtype=q.dtype, seed=B + Hq)
    got = A.run_decode("emulator", *args, **kwargs, **launch, gate=gate)
    ungated = A.run_decode("emulator", *args, **kwargs, **launch)
    assert got.dtype == q.dtype and got.shape == q.shape
    assert mx.array_equal(got, kernel_gated(ungated, gate)).item(), case
    # Stock's ``out * mx.sigmoid(gate)`` on the CPU rounds its exp another
    # way: a rare element one step of the sigmoid apart, none further.
    stock = (ungated * mx.sigmoid(gate.reshape(B, Hq, 1, D))).astype(mx.float32)
    assert mx.mean(got.astype(mx.float32) == stock).item() >= 0.99
    assert mx.all(mx.abs(got.astype(mx.float32) - stock) <= 2.0**-6 * mx.abs(stock) + 1e-30).item()
    # Against the op's reference too (its own attention, gated the same way).
    assert A.attention_agree(got, A.attention_reference(*args, **kwargs, gate=gate)) is None
    # The gate is read, not ignored: another gate, other bits.
    other = A.run_decode("emulator", *args, **kwargs, **launch, gate=output_gate(B, 1, Hq, D, q.dtype, seed=99))
    assert not mx.array_equal(got, other).item()


def test_the_op_routes_a_gated_call_and_gates_every_path(emulator_backend):
    q, k, v, scale, mask = decode_check_inputs(23, Hq=8, Hkv=2, D=64)
    gate = output_gate(1, 1, 8, 64)
    got = K.attention(q, k, v, scale, mask, gate=gate)
    assert K.attention.last_path == "kernel"
    assert mx.array_equal(got, kernel_gated(K.attention(q, k, v, scale, mask), gate)).item()
    # A prompt chunk (the prefill kernel) and an explicit mask (the reference)
    # are gated after their attention, as stock's layer gates them.
    L = 5
    qs = mx.random.normal((1, 8, L, 64), key=mx.random.key(3)).astype(mx.bfloat16)
    gate = output_gate(1, L, 8, 64)
    for mask in ("causal", mx.ones((L, 23), dtype=mx.bool_)):
        got = K.attention(qs, k, v, scale, mask, gate=gate)
        want = K.attention(qs, k, v, scale, mask) * mx.sigmoid(gate.transpose(0, 2, 1, 3))
        assert mx.array_equal(got, want).item()
    with pytest.raises(ValueError, match=r"output gate of shape \(1, 1, 8, 64\)"):
        A.attention_reference(qs, k, v, scale, "causal", gate=output_gate(1, 1, 8, 64))


def test_a_gate_the_kernel_cannot_read_says_why():
    q, k, v, scale, mask = decode_check_inputs(9, Hq=4, Hkv=2, D=64)
    assert A.decode_supports(q, k, v, scale, mask, gate=output_gate(1, 1, 4, 64)) is None
    why = A.decode_supports(q, k, v, scale, mask, gate=output_gate(1, 1, 4, 64, dtype=mx.float32))
    assert "output gate" in why and "float32" in why


@pytest.mark.parametrize("form", ["rows", "tiles"])
@pytest.mark.parametrize("B", [1, 3, 16])
def test_the_projection_of_a_gated_output_has_the_gate_prologue_s_bits(emulator_backend, monkeypatch, form, B):
    # The decode step's o_proj + residual before (gate in the GEMV prologue)
    # and now (the attention output already gated): the same bits.
    monkeypatch.setenv(GEMV_ENV, form)
    rng = np.random.default_rng(B)
    Hq, D, hidden = 4, 64, 192
    out = mx.array(rng.standard_normal((B, Hq, 1, D)).astype(np.float32)).astype(mx.bfloat16)
    gate = output_gate(B, 1, Hq, D, seed=B)
    weights = gemv_weights(Hq * D, (hidden,), (4,), rng=rng)
    residual = mx.array(rng.standard_normal((B, 1, hidden)).astype(np.float32)).astype(mx.bfloat16)
    flat = out.reshape(B, 1, Hq * D)
    assert takes_tiles(flat, weights, gate=gate, residual=residual) == (form == "tiles")
    (before,) = K.decode_matvec(flat, weights, gate=gate, residual=residual)
    gated = kernel_gated(out, gate).reshape(B, 1, Hq * D)  # as the attention kernels write it
    (now,) = K.decode_matvec(gated, weights, residual=residual)
    op = K.quantized_matvec_tiles if form == "tiles" else K.quantized_matvec
    assert op.last_path == "kernel", op.last_reason
    assert mx.array_equal(before, now).item()


def test_the_gated_kernels_compile_with_nvcc_and_fit_their_threadgroups(tmp_path):
    # The model's gated launches (one row and a 16-row batch, each form; the
    # gated combine in bf16 and fp16): no stack frame, a threadgroup within
    # an SM's registers.
    import shutil

    from mlx_lily.toolchain import cuda_cache
    from test_attention_kernels import assert_units_fit
    from test_toolchain import _mlx_cuda_include

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    include, which = _mlx_cuda_include(tmp_path)
    units, threads = [], {}
    for B, S, batched in ((1, 64, False), (1, 4096, False), (16, 64, True), (16, 4096, True)):
        q, k = mx.zeros((B, 16, 1, 256), mx.bfloat16), mx.zeros((B, 2, S, 256), mx.bfloat16)
        gate = output_gate(B, 1, 16, 256)
        keywords = {"start": mx.zeros((B,), mx.int32)} if batched else {}
        length = mx.full((B if batched else 1,), S, mx.int32)
        split = S >= A.SPLIT_FROM
        launch = A._launch_decode(q, k, k, 0.1, None, length, split=split, gate=gate, **keywords)
        threads["attention_decode_" + cuda_cache.template_suffix(launch.template)] = launch.threadgroup[0]
        units.append(A.attention_decode_kernel.cuda_translation_unit(q, k, k, 0.1, None, length, split=split,
                                                                     gate=gate, **keywords))
    for dtype in (mx.bfloat16, mx.float16):
        units.append(A.attention_combine_kernel.cuda_translation_unit(
            mx.zeros((16 * 16, 3, 256)), mx.zeros((16 * 16, 3)), dtype, output_gate(16, 1, 16, 256, dtype)))
    assert_units_fit(units, threads, tmp_path / "attention_gated", include, which)
