"""The Gated DeltaNet prefill prologue (mlx_lily/kernels/conv.py):
``conv_qk_norm``'s kernel in the CPU emulator against its reference, the
layer's own op sequence; the contract's judge; what the kernel refuses; the
CUDA build; the layer calling it."""

from __future__ import annotations

import mlx.core as mx
import pytest

import mlx_lily
from mlx_lily import kernels as K
from mlx_lily.kernels.gated_delta.conv import (
    conv_qk_norm_agree,
    conv_qk_norm_kernel,
    conv_qk_norm_reference,
    conv_qk_norm_supports,
)
from mlx_lily.kernels.gated_delta.testing import conv_qk_norm_call

from test_toolchain import emulator_or_skip, nvcc_ptx

# (B, T, Hk, value heads per key head, Dk, Dv, conv width): fewer tokens than
# the taps, a batch of two, ratios 1-3, head dims 32-128, widths 2-4.
SHAPES = [
    (1, 1, 1, 1, 32, 32, 4),
    (1, 2, 2, 3, 64, 32, 4),
    (2, 7, 1, 2, 32, 96, 3),
    (1, 33, 2, 2, 128, 128, 4),
    (2, 5, 3, 1, 64, 64, 2),
]


@pytest.mark.parametrize("B, T, Hk, ratio, Dk, Dv, width", SHAPES)
def test_matches_the_layer_s_sequence_in_the_emulator(B, T, Hk, ratio, Dk, Dv, width):
    emulator_or_skip()
    args, _ = conv_qk_norm_call(B, T, Hk, Hk * ratio, Dk, Dv, K=width, seed=T + Dk)
    assert conv_qk_norm_supports(*args) is None
    got = conv_qk_norm_kernel.emulate(*args)
    want = conv_qk_norm_reference(*args)
    assert conv_qk_norm_agree(got, want) is None
    # Most elements equal the reference to the bit.
    same = sum(int(mx.sum(g == w).item()) for g, w in zip(got, want))
    assert same >= 0.99 * sum(w.size for w in want)


@pytest.mark.parametrize("B, T, Hk, ratio, Dk, Dv, width", SHAPES)
def test_fp16_matches_the_layer_s_sequence_in_the_emulator(B, T, Hk, ratio, Dk, Dv, width):
    # fp16 rounds at the same points as bf16, 8 times finer (a step of 2^-10):
    # the contract's bound is 2^-8 |want| + 2^-12 max|want| (three roundings,
    # each tipped by at most one step by the fp32 sums' order).
    emulator_or_skip()
    args, _ = conv_qk_norm_call(B, T, Hk, Hk * ratio, Dk, Dv, K=width, seed=T + Dk, dtype=mx.float16)
    assert conv_qk_norm_supports(*args) is None
    got = conv_qk_norm_kernel.emulate(*args)
    want = conv_qk_norm_reference(*args)
    assert all(g.dtype == w.dtype == mx.float16 for g, w in zip(got, want))
    assert conv_qk_norm_agree(got, want, *args) is None
    same = sum(int(mx.sum(g == w).item()) for g, w in zip(got, want))
    assert same >= 0.99 * sum(w.size for w in want)
    # Against the same sequence in fp32: a handful of fp16 roundings (the
    # conv sum, sigmoid, SiLU, the norm, the scale) of half a step each.
    oracle = conv_qk_norm_reference(*(a.astype(mx.float32) for a in args[:3]), *args[3:])
    for g, o in zip(got, oracle):
        err = mx.abs(g.astype(mx.float32) - o)
        assert mx.all(err <= 2.0**-7 * mx.abs(o) + 2.0**-11 * mx.abs(o).max()).item()


def test_the_judge_catches_a_shifted_tap_and_a_missing_scale():
    args, _ = conv_qk_norm_call(1, 9, 2, 4, 32, 32, seed=5)
    q, k, v = conv_qk_norm_reference(*args)
    assert conv_qk_norm_agree((q, k, v), (q, k, v)) is None
    assert "q" in conv_qk_norm_agree((q * 1.1, k, v), (q, k, v))
    # The convolution one row late: its own state's last row first.
    qkv, state, weight = args[:3]
    late = conv_qk_norm_reference(qkv[:, :-1], state, weight, *args[3:])
    shifted = tuple(mx.concatenate([w[:, :1], l], axis=1) for w, l in zip((q, k, v), late))
    assert conv_qk_norm_agree(shifted, (q, k, v)) is not None


def test_refuses_what_it_does_not_take():
    args, _ = conv_qk_norm_call(1, 4, 1, 2, 32, 32)
    single = (args[0].astype(mx.float32),) + args[1:]
    assert "bfloat16" in conv_qk_norm_supports(*single)
    mixed = (args[0].astype(mx.float16),) + args[1:]
    assert "conv_state" in conv_qk_norm_supports(*mixed)
    odd, _ = conv_qk_norm_call(1, 4, 1, 1, 48, 32)
    assert "head dims" in conv_qk_norm_supports(*odd)
    wrong = args[:3] + (2,) + args[4:]
    assert "width" in conv_qk_norm_supports(*wrong)


def test_compiles_for_cuda_without_local_memory(tmp_path):
    # The real shape (16 key heads, 32 value heads, dims 128, width 4) and an odd one.
    units = {f"conv_{Hk}": conv_qk_norm_kernel.cuda_translation_unit(*conv_qk_norm_call(1, 8, Hk, Hv, Dk, Dv, K=w)[0])
             for Hk, Hv, Dk, Dv, w in ((16, 32, 128, 128, 4), (3, 9, 64, 96, 3))}
    units["conv_fp16"] = conv_qk_norm_kernel.cuda_translation_unit(
        *conv_qk_norm_call(1, 8, 16, 32, 128, 128, K=4, dtype=mx.float16)[0])
    for text in nvcc_ptx(tmp_path, units).values():
        assert "ld.local" not in text and "st.local" not in text


def test_the_layer_s_prompt_calls_take_its_prologue_and_closing_norm_kernels(demo_checkpoint, monkeypatch):
    # conv_qk_norm here, gated_rms_norm (tests/test_norms.py): the DeltaNet
    # layer's kernels around its recurrence.
    emulator_or_skip()
    from mlx_lm.models.cache import make_prompt_cache

    monkeypatch.setenv("MLX_LILY_KERNEL_BACKEND", "emulator")
    model, _ = mlx_lily.load(str(demo_checkpoint), backend="lily")
    ops = (K.conv_qk_norm, K.gated_rms_norm)
    for op in ops:
        op.last_path = None
    mx.eval(model(mx.array([[5, 9, 300, 41, 7, 12]]), cache=make_prompt_cache(model)))
    for op in ops:
        assert op.last_path == "kernel", (op.name, op.last_reason)


def test_the_judge_takes_the_cpu_s_reference_when_given_the_call():
    # As gated_delta_decode's: a first-use check on a GPU passes the GPU's own
    # reference, which may round SiLU's steps otherwise; the CPU's is the judge.
    args, _ = conv_qk_norm_call(1, 6, 1, 2, 32, 32, seed=9)
    q, k, v = conv_qk_norm_reference(*args)
    off = (q * 1.5, k, v)
    assert conv_qk_norm_agree((q, k, v), off) is not None
    assert conv_qk_norm_agree((q, k, v), off, *args) is None
    assert conv_qk_norm_agree(off, (q, k, v), *args) is not None
