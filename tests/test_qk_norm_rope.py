"""The attention prologue in one kernel (qk_norm_rope): q/k RMSNorm + partial RoPE.

In the CPU emulator against the op's reference (stock's rms_norm, transpose
and rope) at small and odd shapes: decode and prefill, the layer's strided q
view, int and per-row array offsets, offsets near 32K and 40K; supports()
refusing the rope variants and shapes it does not take; the contract's
judge rejecting wrong results; compiled for CUDA with nvcc.
"""

from __future__ import annotations

import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.rope_utils import (
    DynamicNTKScalingRoPE,
    Llama3RoPE,
    SuScaledRoPE,
    YarnRoPE,
    initialize_rope,
)

from mlx_lily import kernels as K
from mlx_lily.kernels.attention.qk_norm_rope import (
    element_bounds,
    qk_norm_rope_agree,
    qk_norm_rope_kernel,
    qk_norm_rope_reference,
    qk_norm_rope_supports,
)
from mlx_lily.kernels.attention.testing import qk_norm_rope_inputs

from test_toolchain import emulator_or_skip, nvcc_ptx

# (B, L, Hq, Hkv, D, dims, offset, traditional): decode and prefill, odd head
# counts, head dims 32-256 (96: not a power of two), dims from 16 to all of D.
CASES = [
    pytest.param(1, 1, 3, 1, 256, 64, 7, False, id="decode-real-head-dim"),
    pytest.param(1, 5, 5, 1, 64, 16, 0, False, id="prefill-from-0"),
    pytest.param(1, 3, 3, 3, 96, 22, 11, False, id="odd-D96-dims22"),
    pytest.param(1, 4, 1, 1, 32, 32, 3, False, id="all-of-D-rotated"),
    pytest.param(1, 2, 3, 1, 64, 24, 9, True, id="traditional"),
    pytest.param(1, 1, 5, 1, 128, 32, 32768, False, id="decode-at-32K"),
    pytest.param(1, 3, 3, 1, 256, 64, 40000, False, id="prefill-at-40K"),
]


def check(args):
    """The kernel in the emulator meets the contract against the reference."""
    assert qk_norm_rope_supports(*args) is None
    got = qk_norm_rope_kernel.emulate(*args)
    want = qk_norm_rope_reference(*args)
    mx.eval(got, want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
    mismatch = qk_norm_rope_agree(got, want, *args)
    assert mismatch is None, mismatch
    return got, want


@pytest.mark.parametrize("B, L, Hq, Hkv, D, dims, offset, traditional", CASES)
def test_matches_the_reference_on_the_layer_s_q_view(B, L, Hq, Hkv, D, dims, offset, traditional):
    emulator_or_skip()
    args, _ = qk_norm_rope_inputs(B, L, Hq, Hkv, D, dims, offset=offset, traditional=traditional,
                          seed=D + dims + L)
    # q is the layer's: half of each head's row of the projection, a strided
    # view the kernel reads in place; the same values made contiguous give
    # the same result, bit for bit.
    got, _ = check(args)
    copied = qk_norm_rope_kernel.emulate(mx.contiguous(args[0]), *args[1:])
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, copied))


def test_per_row_array_offsets_as_a_batch_cache_gives_them():
    emulator_or_skip()
    # BatchKVCache: one offset per row, a left-padded row's negative.
    args, _ = qk_norm_rope_inputs(2, 3, 3, 1, 64, 16, offset=mx.array([40000, -2]), seed=1)
    got, want = check(args)
    # Row 1 is rotated by its own positions, not row 0's.
    args0, _ = qk_norm_rope_inputs(2, 3, 3, 1, 64, 16, offset=mx.array([40000, 40000]), seed=1)
    other = qk_norm_rope_kernel.emulate(*args0)
    assert not mx.allclose(other[0][1], got[0][1]).item()
    assert mx.array_equal(other[0][0], got[0][0]).item()


@pytest.mark.parametrize("offset", [mx.array(17), mx.array([17]), mx.array([17], dtype=mx.int64), np.int64(17)])
def test_offset_as_a_scalar_array_or_numpy_int(offset):
    emulator_or_skip()
    args, _ = qk_norm_rope_inputs(1, 2, 3, 1, 32, 16, offset=offset, seed=2)
    got, _ = check(args)
    plain = qk_norm_rope_kernel.emulate(*qk_norm_rope_inputs(1, 2, 3, 1, 32, 16, offset=17, seed=2)[0])
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, plain))


@pytest.mark.parametrize(
    "dtype, weight_dtype",
    [(mx.float16, mx.float16), (mx.float32, mx.float32), (mx.bfloat16, mx.float32)],
)
def test_other_dtypes_and_rms_norm_s_promotion(dtype, weight_dtype):
    emulator_or_skip()
    # bf16 activations with fp32 weights: rms_norm (and so the op) answers in fp32.
    args, _ = qk_norm_rope_inputs(1, 2, 3, 1, 64, 32, offset=1234, dtype=dtype, weight_dtype=weight_dtype,
                          traditional=weight_dtype == mx.float32, seed=3)
    got, _ = check(args)
    assert got[0].dtype == mx.result_type(dtype, weight_dtype)


def test_plain_q_transposed_k_and_a_linearly_scaled_rope():
    emulator_or_skip()
    args, _ = qk_norm_rope_inputs(2, 3, 3, 3, 64, 16, offset=5, gated=False, seed=4)
    q, k, qw, kw, eps, _, offset = args
    # k as a [B, H, L, D] array seen as [B, L, H, D]: strides on every axis.
    k = mx.array(np.ascontiguousarray(np.array(k.astype(mx.float32)).transpose(0, 2, 1, 3)))
    k = k.astype(mx.bfloat16).transpose(0, 2, 1, 3)
    # mlx-lm's "linear" rope scaling is a plain nn.RoPE with scale = 1 / factor.
    rope = initialize_rope(16, 1e6, False, scaling_config={"type": "linear", "factor": 4.0})
    assert type(rope) is nn.RoPE and rope.scale == 0.25
    check((q, k, qw, kw, eps, rope, offset))


def test_the_op_runs_the_kernel_and_falls_back_for_other_ropes(emulator_backend):
    args, _ = qk_norm_rope_inputs(1, 2, 3, 1, 64, 16, offset=3, seed=5)
    got = K.qk_norm_rope(*args)
    assert K.qk_norm_rope.last_path == "kernel", K.qk_norm_rope.last_reason
    assert qk_norm_rope_agree(got, qk_norm_rope_reference(*args), *args) is None
    yarn = YarnRoPE(16, scaling_factor=4.0, base=1e6)
    K.qk_norm_rope(*args[:5], yarn, 3)
    assert K.qk_norm_rope.last_path == "reference"
    assert "YarnRoPE" in K.qk_norm_rope.last_reason


def test_supports_takes_the_model_s_rope_and_refuses_the_rest():
    args, _ = qk_norm_rope_inputs(1, 1, 16, 2, 256, 64, offset=3, base=1e7)
    q, k, qw, kw, eps, rope, offset = args
    assert qk_norm_rope_supports(*args) is None
    # What Qwen3.5/3.6's config makes of its rope: a plain nn.RoPE on 64 of 256.
    model_rope = initialize_rope(
        64, 1e7, False,
        scaling_config={"type": "default", "mrope_section": [11, 11, 10], "rope_theta": 1e7,
                        "partial_rotary_factor": 0.25},
        max_position_embeddings=262144,
    )
    assert qk_norm_rope_supports(q, k, qw, kw, eps, model_rope, offset) is None
    others = [
        Llama3RoPE(64, max_position_embeddings=8192, base=5e5, scaling_config={
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}),
        YarnRoPE(64, scaling_factor=4.0, base=1e7),
        SuScaledRoPE(64, base=1e7),
        DynamicNTKScalingRoPE(64, max_position_embeddings=4096, traditional=False, base=1e7, factor=2.0),
        type("ScaledRoPE", (nn.RoPE,), {})(64, base=1e7),
    ]
    for other in others:
        why = qk_norm_rope_supports(q, k, qw, kw, eps, other, offset)
        assert why is not None and type(other).__name__ in why
    refused = {
        "head dim 48": qk_norm_rope_inputs(1, 1, 3, 1, 48, 16)[0],
        "head dim 512": qk_norm_rope_inputs(1, 1, 1, 1, 512, 64)[0],
        "rope dims 15": (q, k, qw, kw, eps, nn.RoPE(15), offset),
        "rope dims 512": (q, k, qw, kw, eps, nn.RoPE(512), offset),
        "float16": (q, k.astype(mx.float16), qw, kw, eps, rope, offset),
        "norm weight": (q, k, qw, kw.astype(mx.float16), eps, rope, offset),
        "offset (3,)": (q, k, qw, kw, eps, rope, mx.array([1, 2, 3])),
        "offset dtype": (q, k, qw, kw, eps, rope, mx.array([1.0])),
        "offset of type float": (q, k, qw, kw, eps, rope, 1.0),
        "32-bit": (q, k, qw, kw, eps, rope, 2**40),
        "same B, L, D": (q, k[:, :, :, :128], qw, kw, eps, rope, offset),
    }
    for needle, call in refused.items():
        why = qk_norm_rope_supports(*call)
        assert why is not None and needle in why, (needle, why)


def test_agree_rejects_wrong_positions_pairs_and_norms():
    args, _ = qk_norm_rope_inputs(1, 3, 3, 1, 64, 16, offset=100, seed=6)
    q, k, qw, kw, eps, rope, offset = args
    want = qk_norm_rope_reference(*args)
    assert qk_norm_rope_agree(want, want, *args) is None
    # One token late, the other pairing, no weight: each out of contract.
    late = qk_norm_rope_reference(q, k, qw, kw, eps, rope, offset + 1)
    assert "over the bound" in qk_norm_rope_agree(late, want, *args)
    flipped = qk_norm_rope_reference(q, k, qw, kw, eps, nn.RoPE(16, traditional=True, base=1e7), offset)
    assert qk_norm_rope_agree(flipped, want, *args) is not None
    # A left-padded row's negative positions: its rotated values are not
    # judged (MLX's GPU kernels wrap them), from position 0 on they are.
    elsewhere = qk_norm_rope_reference(q, k, qw, kw, eps, rope, 1000)
    for start, judged in ((-3, False), (-1, True)):
        at = mx.array([start])
        padded = qk_norm_rope_reference(q, k, qw, kw, eps, rope, at)
        assert (qk_norm_rope_agree(elsewhere, padded, q, k, qw, kw, eps, rope, at) is not None) == judged
    unweighted = qk_norm_rope_reference(q, k, mx.ones_like(qw), kw, eps, rope, offset)
    assert "q:" in qk_norm_rope_agree(unweighted, want, *args)
    # Three steps of bf16 on one passed-through value are too many; one is not.
    bound = element_bounds(want[1], rope, offset)
    assert bound[0, 0, 0, -1].item() <= 2.0**-5 * abs(want[1][0, 0, 0, -1].item()) + 1e-12
    for steps, ok in ((1, True), (3, False)):
        k_out = np.array(want[1].astype(mx.float32))
        k_out[0, 0, 0, -1] *= 1 + steps * 2.0**-7
        shifted = (want[0], mx.array(k_out).astype(mx.bfloat16))
        assert (qk_norm_rope_agree(shifted, want, *args) is None) == ok


def test_compiles_for_cuda_without_local_memory(tmp_path):
    calls = {
        # The model's shape (16 q, 2 KV heads of 256, 64 rotated), a gated q view.
        "real": qk_norm_rope_inputs(1, 1, 16, 2, 256, 64, offset=5, base=1e7)[0],
        # Small and odd: traditional pairs, fp16 with fp32 weights, per-row offsets.
        "odd": qk_norm_rope_inputs(2, 3, 3, 1, 96, 22, offset=mx.array([1, 2]), traditional=True,
                           dtype=mx.float16, weight_dtype=mx.float32)[0],
    }
    units = {f"qk_norm_rope_{name}": qk_norm_rope_kernel.cuda_translation_unit(*args) for name, args in calls.items()}
    for text in nvcc_ptx(tmp_path, units).values():
        # The row's values stay in registers. The one local array is CUDA's
        # precise sinf/cosf's own: 7 words for reducing angles past ~1e5
        # radians (positions past 1e5 at the first frequency), as in MLX's
        # own rope kernel.
        depots = [int(n) for n in re.findall(r"\.local \.align \d+ \.b8 \s*__local_depot\d+\[(\d+)\]", text)]
        assert sum(depots) <= 28, depots
