"""The Gated DeltaNet's closing norm (mlx_lily/kernels/norms.py):
``gated_rms_norm``'s kernel in the CPU emulator against stock's sequence;
the contract's judge; what the kernel refuses; the CUDA build. The layer
calling it: tests/test_conv_qk_norm.py."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_lily.kernels.gated_delta.norm import (
    gated_rms_norm_agree,
    gated_rms_norm_kernel,
    gated_rms_norm_reference,
    gated_rms_norm_supports,
)
from mlx_lily.kernels.gated_delta.testing import gated_rms_norm_call

from test_toolchain import emulator_or_skip, nvcc_ptx


@pytest.mark.parametrize("shape, weight_dtype", [
    ((1, 1, 1, 32), mx.bfloat16),
    ((2, 7, 3, 64), mx.bfloat16),
    ((1, 33, 5, 128), mx.float32),  # an fp32 weight keeps rms_norm's output fp32
    ((3, 96), mx.bfloat16),
])
def test_matches_stock_s_sequence_in_the_emulator(shape, weight_dtype):
    emulator_or_skip()
    args, _ = gated_rms_norm_call(shape, weight_dtype, seed=sum(shape))
    assert gated_rms_norm_supports(*args) is None
    got = gated_rms_norm_kernel.emulate(*args)
    want = gated_rms_norm_reference(*args)
    assert got.shape == want.shape and got.dtype == want.dtype == mx.bfloat16
    assert gated_rms_norm_agree(got, want) is None
    assert mx.sum(got == want).item() >= 0.99 * want.size


@pytest.mark.parametrize("shape, weight_dtype", [
    ((1, 1, 1, 32), mx.float16),
    ((2, 7, 3, 64), mx.float16),
    ((1, 33, 5, 128), mx.float32),
    ((3, 96), mx.bfloat16),  # a bf16 weight on fp16 activations: the norm in fp32
])
def test_fp16_matches_stock_s_sequence_in_the_emulator(shape, weight_dtype):
    # fp16's step is 2^-10, 8 times finer than bf16's: the contract's bound
    # shrinks by 8 (2^-9 |want| + 2^-13 max|want|), and it is checked here
    # against the fp16 reference and against the same math in fp32.
    emulator_or_skip()
    args, _ = gated_rms_norm_call(shape, weight_dtype, seed=sum(shape), dtype=mx.float16)
    assert gated_rms_norm_supports(*args) is None
    got = gated_rms_norm_kernel.emulate(*args)
    want = gated_rms_norm_reference(*args)
    assert got.dtype == want.dtype == mx.float16
    assert gated_rms_norm_agree(got, want, *args) is None
    assert mx.sum(got == want).item() >= 0.99 * want.size
    x, z, w, eps = args
    oracle = gated_rms_norm_reference(x.astype(mx.float32), z.astype(mx.float32), w.astype(mx.float32), eps)
    err = mx.abs(got.astype(mx.float32) - oracle)
    # Three fp16 roundings (the norm's two, the output's) of at most half a
    # step each, relative, plus the weight's and the gate's own scale.
    assert mx.all(err <= 2.0**-9 * mx.abs(oracle) + 2.0**-13 * mx.abs(oracle).max()).item()


def test_the_judge_catches_a_wrong_weight_and_a_missing_gate():
    x, z, w, eps = gated_rms_norm_call((1, 4, 2, 32), seed=2)[0]
    want = gated_rms_norm_reference(x, z, w, eps)
    assert gated_rms_norm_agree(want, want) is None
    assert gated_rms_norm_agree(gated_rms_norm_reference(x, z, w * 1.1, eps), want) is not None
    assert gated_rms_norm_agree(mx.fast.rms_norm(x, w, eps), want) is not None


def test_refuses_what_it_does_not_take():
    x, z, w, eps = gated_rms_norm_call((1, 2, 2, 32))[0]
    assert "bfloat16" in gated_rms_norm_supports(x.astype(mx.float32), z, w, eps)
    assert "z" in gated_rms_norm_supports(x.astype(mx.float16), z, w, eps)
    x48, z48, w48, _ = gated_rms_norm_call((1, 2, 2, 48))[0]
    assert "Dv=48" in gated_rms_norm_supports(x48, z48, w48, eps)
    assert "weight" in gated_rms_norm_supports(x, z, w[:16], eps)
    assert "same shape" in gated_rms_norm_supports(x, z[:, :1], w, eps)


def test_compiles_for_cuda_without_local_memory(tmp_path):
    units = {f"norm_{dv}_{str(dt).split('.')[-1]}": gated_rms_norm_kernel.cuda_translation_unit(
        *gated_rms_norm_call((1, 8, 32, dv), dt)[0]) for dv, dt in ((128, mx.bfloat16), (64, mx.float32))}
    units.update({f"norm_{dv}_fp16_{str(dt).split('.')[-1]}": gated_rms_norm_kernel.cuda_translation_unit(
        *gated_rms_norm_call((1, 8, 32, dv), dt, dtype=mx.float16)[0]) for dv, dt in ((128, mx.float16), (64, mx.bfloat16))})
    for text in nvcc_ptx(tmp_path, units).values():
        assert "ld.local" not in text and "st.local" not in text


def test_the_judge_takes_the_cpu_s_reference_when_given_the_call():
    args, _ = gated_rms_norm_call((1, 3, 2, 32), seed=4)
    want = gated_rms_norm_reference(*args)
    assert gated_rms_norm_agree(want, want * 1.5) is not None
    assert gated_rms_norm_agree(want, want * 1.5, *args) is None
    assert gated_rms_norm_agree(want * 1.5, want, *args) is not None
