"""Every lily kernel on the GPU (Metal or CUDA) against its reference.

Run on a GPU machine with ``python3 -m pytest tests -m gpu -q``. Without a
GPU every test here skips. Each test checks that the kernel path was taken
(the kernel built and passed its self-check), not a silent fallback to the
reference. Nothing here needs the CPU emulator or a compiler.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.gated_delta import normalize_qk

from mlx_lily.kernels import OPS
from mlx_lily.kernels.gated_delta.recurrence import (
    CHUNKED_FROM,
    gated_delta,
    gated_delta_agree,
    gated_delta_compare,
    gated_delta_reference,
)
from mlx_lily.kernels.moe.router import (
    router_outputs_agree,
    router_topk,
    router_topk_ground_truth,
    router_topk_reference,
)
from mlx_lily.toolchain.probe import run_subset_probe

pytestmark = pytest.mark.gpu

# Real shapes: Qwen3.5/3.6 MoE routes 8 of 256 experts per token; 1 token is a
# decode step, 2048 a prefill chunk, 7 a ragged count (a partial threadgroup).
ROUTER_ROWS = [1, 7, 2048]
EXPERTS, TOP_K = 256, 8
# Gated DeltaNet at Qwen3.6-35B-A3B's shapes: 16 key heads, 32 value heads,
# Dk = Dv = 128; 1 token a decode step, 2048 a prefill chunk.
GDN_HEADS = (16, 32, 128, 128)
GDN_STEPS = [1, 2048]


def kernel_ops():
    return sorted(name for name, op in OPS.items() if op.kernel is not None)


def test_the_portable_subset_means_the_same_on_this_gpu(backend):
    assert run_subset_probe(backend) == []


@pytest.mark.parametrize("name", kernel_ops())
def test_every_kernel_builds_and_passes_its_self_check(backend, name):
    op = OPS[name]
    ok, why = op.kernel.ready()
    assert ok, why
    assert why.startswith(backend), why
    assert op.planned_path() == ("kernel", why)
    args, kwargs = op.sample()
    got = op(*args, **kwargs)
    mx.eval(got)
    assert op.last_path == "kernel", op.last_reason


@pytest.mark.parametrize("rows", ROUTER_ROWS)
@pytest.mark.parametrize("normalize", [True, False])
def test_router_topk_at_real_shapes(backend, rows, normalize):
    key = mx.random.key(rows)
    # [1, L, E], as the MoE layer passes the gate's output.
    logits = (2 * mx.random.normal((1, rows, EXPERTS), key=key)).astype(mx.bfloat16)
    got = router_topk(logits, TOP_K, normalize)
    mx.eval(got)
    assert router_topk.last_path == "kernel", router_topk.last_reason
    indices, weights = got
    assert indices.shape == (1, rows, TOP_K) and indices.dtype == mx.uint32
    assert weights.shape == (1, rows, TOP_K) and weights.dtype == mx.bfloat16
    want = router_topk_reference(logits, TOP_K, normalize)
    assert router_outputs_agree(got, want, logits, TOP_K, normalize) is None
    # Against the ground truth: the same experts in the same order except between
    # probabilities one rounding step of bf16 apart (the GPU's exp and sums may
    # round an fp32 probability one unit apart from numpy's).
    truth_idx, truth_w, probs = router_topk_ground_truth(logits, TOP_K, normalize)
    idx = np.array(indices).reshape(-1, TOP_K)
    truth_idx, probs = truth_idx.reshape(-1, TOP_K), probs.reshape(-1, EXPERTS)
    r = np.arange(idx.shape[0])[:, None]
    differ = idx != truth_idx
    picked, wanted = probs[r, idx], probs[r, truth_idx]
    assert (np.abs(picked - wanted)[differ] <= 2.0**-8 * np.maximum(picked, wanted)[differ]).all()
    np.testing.assert_allclose(
        np.array(weights.astype(mx.float32)).reshape(-1, TOP_K),
        truth_w.reshape(-1, TOP_K),
        rtol=1e-2,
        atol=1e-4,
    )


def test_router_topk_ties_go_to_the_highest_index(backend):
    rng = np.random.default_rng(0)
    logits = mx.array(rng.integers(0, 3, size=(64, EXPERTS)).astype(np.float32)).astype(mx.bfloat16)
    logits[0] = mx.zeros((EXPERTS,), mx.bfloat16)
    indices, _ = router_topk(logits, TOP_K, True)
    assert router_topk.last_path == "kernel", router_topk.last_reason
    truth_idx, _, _ = router_topk_ground_truth(logits, TOP_K, True)
    np.testing.assert_array_equal(np.array(indices), truth_idx)
    np.testing.assert_array_equal(np.array(indices[0]), np.arange(EXPERTS - 1, EXPERTS - 1 - TOP_K, -1))


def gated_delta_inputs(T, with_state, seed=0):
    """The op's arguments as the layer passes them: bf16 activations, q/k normalised."""
    Hk, Hv, Dk, Dv = GDN_HEADS
    keys = mx.random.split(mx.random.key(seed), 8)
    q = mx.random.normal((1, T, Hk, Dk), key=keys[0]).astype(mx.bfloat16)
    k = mx.random.normal((1, T, Hk, Dk), key=keys[1]).astype(mx.bfloat16)
    q, k = normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
    v = mx.random.normal((1, T, Hv, Dv), key=keys[2]).astype(mx.bfloat16)
    a = mx.random.normal((1, T, Hv), key=keys[3]).astype(mx.bfloat16)
    b = mx.random.normal((1, T, Hv), key=keys[4]).astype(mx.bfloat16)
    A_log = mx.log(mx.random.uniform(1, 16, (Hv,), key=keys[5]))
    dt_bias = mx.random.uniform(0, 2, (Hv,), key=keys[6])
    state = 0.1 * mx.random.normal((1, Hv, Dv, Dk), key=keys[7]) if with_state else None
    return q, k, v, a, b, A_log, dt_bias, state


@pytest.mark.parametrize("T", GDN_STEPS)
@pytest.mark.parametrize("with_state", [True, False], ids=["state", "zero-state"])
def test_gated_delta_at_real_shapes(backend, T, with_state):
    args = gated_delta_inputs(T, with_state, seed=T)
    got = gated_delta(*args)
    mx.eval(got)
    assert gated_delta.last_path == "kernel", gated_delta.last_reason
    y, state = got
    Hk, Hv, Dk, Dv = GDN_HEADS
    assert y.shape == (1, T, Hv, Dv) and y.dtype == mx.bfloat16
    assert state.shape == (1, Hv, Dv, Dk) and state.dtype == mx.float32
    want = gated_delta_reference(*args)
    mx.eval(want)
    assert gated_delta_agree(got, want, *args) is None
    good, err = gated_delta_compare(got, want)
    assert good and err < 2e-2, err


# -- the tile layer: the dense tiled GEMM ------------------------------------------


@pytest.mark.parametrize("M, N, K", [(4096, 4096, 4096), (2048, 1024, 2048), (333, 517, 200)])
def test_tiled_gemm_on_the_gpu_matches_float64(backend, M, N, K):
    from mlx_lily.kernels.linear.matmul import matmul_nt

    keys = mx.random.split(mx.random.key(M + N + K), 2)
    x = mx.random.normal((M, K), key=keys[0]).astype(mx.bfloat16)
    w = mx.random.normal((N, K), key=keys[1]).astype(mx.bfloat16)
    fn, path, why = matmul_nt.choose(x, w)
    assert path == "kernel", why
    got = np.array(fn(x, w).astype(mx.float32)).astype(np.float64)
    exact = np.array(x.astype(mx.float32)).astype(np.float64) @ np.array(
        w.astype(mx.float32)
    ).astype(np.float64).T
    # One bf16 rounding of an fp32 sum: within one bf16 step (2^-7 of the
    # value's binade, or of a floor for sums that cancel).
    step = np.maximum(np.abs(exact), 1e-2 * np.abs(exact).max()) * 2.0**-7
    assert (np.abs(got - exact) <= step).all()


# -- the chunked gated delta rule on the tiles ------------------------------------


def _rel(got, want) -> float:
    got = np.array(got.astype(mx.float32)).astype(np.float64)
    want = np.array(want.astype(mx.float32)).astype(np.float64) if isinstance(want, mx.array) else want
    return float(np.abs(got - want).max() / np.abs(want).max())


@pytest.mark.parametrize("T", [CHUNKED_FROM, CHUNKED_FROM + 1, 1000, 2048, 4096])
@pytest.mark.parametrize("with_state", [True, False], ids=["state", "zero-state"])
def test_gated_delta_chunked_at_real_shapes(backend, T, with_state):
    # Calls from CHUNKED_FROM tokens take the chunked kernels (a whole number
    # of chunks, and one more token); they agree with the op's reference
    # within its contract and with the sequential kernel (the oracle) within
    # the bf16-operand bounds of tests/test_gated_delta_chunked.py.
    from mlx_lily.kernels.gated_delta.recurrence import gated_delta_kernel

    args = gated_delta_inputs(T, with_state, seed=T + 1)
    assert gated_delta.kernel.path_for(backend, *args) == "chunked", gated_delta.kernel.chunked_ready_on(backend)
    got = gated_delta(*args)
    mx.eval(got)
    assert gated_delta.last_path == "kernel", gated_delta.last_reason
    want = gated_delta_reference(*args)
    assert gated_delta_agree(got, want, *args) is None
    oracle = gated_delta_kernel.run_on(backend, *args)
    assert _rel(got[0], oracle[0]) <= 2e-2
    assert _rel(got[1], oracle[1]) <= 1e-2


def test_gated_delta_chunked_against_float64_at_1000_tokens(backend):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_gated_delta_kernel import ground_truth

    args = gated_delta_inputs(1000, True, seed=7)
    y, state = gated_delta(*args)
    with mx.stream(mx.cpu):
        want_y, want_state = ground_truth(*args)
    # bf16 operands in the tiles (see tests/test_gated_delta_chunked.py); the
    # emulator measured y 5.8e-3, state 1.8e-3 at these head sizes.
    assert _rel(y, want_y) <= 2e-2
    assert _rel(state, want_state) <= 1e-2


# -- determinism: lily's path, twice, bit for bit ------------------------------------


def _bits_equal(a, b) -> bool:
    a = a if isinstance(a, (list, tuple)) else [a]
    b = b if isinstance(b, (list, tuple)) else [b]
    return all(mx.array_equal(x, y, equal_nan=True).item() for x, y in zip(a, b))


def test_kernels_are_deterministic_at_real_shapes(backend):
    logits = (2 * mx.random.normal((1, 2048, EXPERTS), key=mx.random.key(3))).astype(mx.bfloat16)
    runs = [router_topk(logits, TOP_K, True) for _ in range(2)]
    mx.eval(runs)
    assert router_topk.last_path == "kernel" and _bits_equal(*runs)
    args = gated_delta_inputs(2048, True, seed=5)
    runs = [gated_delta(*args) for _ in range(2)]
    mx.eval(runs)
    assert gated_delta.last_path == "kernel" and _bits_equal(*runs)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=str)
def test_lily_model_is_deterministic(backend, dtype):
    # Stock mlx-lm on CUDA was seen to differ between two runs of small fp32
    # checkpoints (bench/diagnostics/numerics/determinism.py finds the op); lily's path
    # must not.
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lily.random_checkpoints import build_model
    from mlx_lily.models.qwen3_5_moe import Model

    model, _ = build_model("small-alt", seed=1, dtype=dtype, model_class=Model)
    for op in OPS.values():  # which ops this model runs: the paths below are its own
        op.last_path = op.last_reason = None
    tokens = mx.array([[(i * 2654435761) % 2**32 % 512 for i in range(300)]])  # small-alt: 512 tokens
    runs = []
    for _ in range(2):
        cache = make_prompt_cache(model)
        logits = [model(tokens[:, :256], cache=cache)]
        logits += [model(tokens[:, t : t + 1], cache=cache) for t in range(256, 300)]
        out = mx.concatenate(logits, axis=1)
        mx.eval(out)
        runs.append(out)
    if dtype == mx.bfloat16:  # the kernels' dtype: no kernel the model called was turned off
        ran = {n: (OPS[n].last_path, OPS[n].last_reason) for n in kernel_ops() if OPS[n].last_path is not None}
        assert sum(path == "kernel" for path, _ in ran.values()) >= 5, ran
        # A reference path is by design only for calls a kernel does not take:
        # small-alt's DeltaNet output projection is unquantized, so those
        # layers decode unfused and moe_experts' one-token calls run its
        # reference ("1 tokens (kernel: prefill, ...)"). A self-check or a
        # first-use check that failed says "self-check" or "kernel off".
        off = {n: why for n, (path, why) in ran.items()
               if path != "kernel" and ("kernel off" in why or "self-check" in why)}
        assert not off and all(OPS[n].kernel.ready_on(backend)[0] for n in ran), (off, ran)
    diff = mx.abs(runs[0].astype(mx.float32) - runs[1].astype(mx.float32)).max().item()
    assert _bits_equal(runs[0], runs[1]), f"two runs differ by up to {diff}"


# -- MoE prefill: routing, grouped expert GEMMs, combine at the real shapes -------------

MOE_HIDDEN, MOE_INTER = 2048, 512


@pytest.fixture(scope="module")
def real_experts():
    from mlx_lily.kernels.moe.experts import quantized_experts

    return quantized_experts(MOE_HIDDEN, MOE_INTER, EXPERTS, seed=7)


def moe_inputs(tokens, seed):
    x = mx.random.normal((1, tokens, MOE_HIDDEN), key=mx.random.key(seed)).astype(mx.bfloat16)
    logits = mx.random.normal((1, tokens, EXPERTS), key=mx.random.key(seed + 1))
    inds = mx.argpartition(logits, kth=-TOP_K, axis=-1)[..., -TOP_K:].astype(mx.uint32)
    return x, inds


@pytest.mark.parametrize("tokens", [256, 1024, 2048])  # tiles of 16, 32 and 64 rows
def test_moe_routing_at_real_shapes(backend, tokens):
    from mlx_lily.kernels.moe.routing import (
        moe_routing_agree, moe_routing_kernel, moe_routing_reference, tile_rows_for)

    _, inds = moe_inputs(tokens, tokens)
    ids = inds.reshape(tokens, TOP_K)
    ids[5, 3] = 0xFFFFFFFF  # a NaN router row's id
    args = (ids, EXPERTS, tile_rows_for(tokens * TOP_K, EXPERTS))
    got = moe_routing_kernel.run_on(backend, *args)
    assert moe_routing_agree(got, moe_routing_reference(*args)) is None


@pytest.mark.parametrize("tokens", [256, 1024, 2048])
def test_moe_experts_at_real_shapes_match_stock(backend, real_experts, tokens):
    # On a GPU stock's gather_qmm accumulates in fp32 like the kernel.
    from mlx_lily.kernels.moe.experts import moe_experts
    from mlx_lily.kernels.moe.experts import RELATIVE_TOLERANCE, relative_error

    x, inds = moe_inputs(tokens, tokens)
    got = moe_experts(x, inds, real_experts)
    mx.eval(got)
    assert moe_experts.last_path == "kernel", moe_experts.last_reason
    want = real_experts(x, inds)
    err = relative_error(got, want)
    assert err <= RELATIVE_TOLERANCE, err


def test_moe_experts_match_the_precise_reference(backend, real_experts):
    from mlx_lily.kernels.moe.experts import moe_experts_agree, moe_experts_precise, run_moe_experts

    x, inds = moe_inputs(256, 3)
    inds[0, 7, 2] = 0xFFFFFFFF  # out of range: that slot's output is zero
    got = run_moe_experts(backend, x, inds, real_experts)
    assert moe_experts_agree(got, moe_experts_precise(x, inds, real_experts)) is None
    assert mx.all(got[0, 7, 2] == 0).item()


def test_moe_experts_is_deterministic(backend, real_experts):
    from mlx_lily.kernels.moe.experts import run_moe_experts

    x, inds = moe_inputs(2048, 11)
    first = run_moe_experts(backend, x, inds, real_experts)
    second = run_moe_experts(backend, x, inds, real_experts)
    assert mx.array_equal(first, second).item()


def test_moe_combine_at_real_shapes(backend):
    from mlx_lily.kernels.moe.combine import moe_combine, moe_combine_agree, moe_combine_reference

    keys = mx.random.split(mx.random.key(12), 4)
    y = mx.random.normal((1, 2048, TOP_K, MOE_HIDDEN), key=keys[0]).astype(mx.bfloat16)
    s = mx.softmax(mx.random.normal((1, 2048, TOP_K), key=keys[1]), axis=-1).astype(mx.bfloat16)
    shared = mx.random.normal((1, 2048, MOE_HIDDEN), key=keys[2]).astype(mx.bfloat16)
    gate = mx.random.normal((1, 2048, 1), key=keys[3]).astype(mx.bfloat16)
    got = moe_combine(y, s, shared, gate)
    assert moe_combine.last_path == "kernel", moe_combine.last_reason
    assert moe_combine_agree(got, moe_combine_reference(y, s, shared, gate), y, s, shared, gate) is None


# -- the DeltaNet prologue and closing norm at the real shapes ---------------------------


@pytest.mark.parametrize("T", [1, 193, 2048])
def test_conv_qk_norm_at_real_shapes(backend, T):
    from mlx_lily.kernels.gated_delta.conv import conv_qk_norm_agree, conv_qk_norm_kernel
    from mlx_lily.kernels.gated_delta.testing import conv_qk_norm_call

    args, _ = conv_qk_norm_call(1, T, 16, 32, 128, 128, seed=T)  # Qwen3.6: 16 key, 32 value heads
    got = conv_qk_norm_kernel.run_on(backend, *args)
    mx.eval(got)
    assert conv_qk_norm_agree(got, None, *args) is None  # judged against the CPU's reference


@pytest.mark.parametrize("T", [1, 2048])
def test_gated_rms_norm_at_real_shapes(backend, T):
    from mlx_lily.kernels.gated_delta.norm import gated_rms_norm_agree, gated_rms_norm_kernel
    from mlx_lily.kernels.gated_delta.testing import gated_rms_norm_call

    args, _ = gated_rms_norm_call((1, T, 32, 128), seed=T)
    got = gated_rms_norm_kernel.run_on(backend, *args)
    mx.eval(got)
    assert gated_rms_norm_agree(got, None, *args) is None


# -- fp16 activations ----------------------------------------------------------------------


def _fp16_calls():
    """(op name, a small fp16 call its kernel takes) for each op with fp16 kernels."""
    from mlx_lily.kernels.attention import sdpa as attention_module
    from mlx_lily.kernels.gated_delta.testing import conv_qk_norm_call as conv_call
    from mlx_lily.kernels.gated_delta.testing import gated_delta_decode_inputs as make_decode_inputs
    from mlx_lily.kernels.gated_delta.testing import gated_rms_norm_call as norm_call
    from mlx_lily.kernels.linear.testing import gemv_call
    from mlx_lily.kernels.moe.testing import moe_decode_inputs as make_moe_decode_inputs

    f16 = mx.float16
    q, k, v, scale, mask = attention_module._decode_check_inputs(300, Hq=16, Hkv=2, D=256)
    return [
        ("attention", ((q.astype(f16), k.astype(f16), v.astype(f16), scale, mask), {})),
        ("conv_qk_norm", conv_call(1, 64, 16, 32, 128, 128, seed=1, dtype=f16)),
        ("gated_rms_norm", norm_call((1, 64, 32, 128), seed=2, dtype=f16)),
        ("gated_delta_decode", make_decode_inputs(16, 32, 128, 128, seed=3, dtype=f16)),
        ("quantized_matvec", gemv_call(2048, (4096, 2048, 32, 32), (4, 4, 4, 4), "norm", seed=4, dtype=f16)),
        ("quantized_matvec", gemv_call(4096, (2048,), (4,), "gate", residual=True, seed=5, dtype=f16)),
        ("moe_decode", make_moe_decode_inputs(2048, 64, 8, 512, 512, seed=6, dtype=f16)),
    ]


@pytest.mark.parametrize("index", range(7))
def test_fp16_calls_take_their_kernels_and_pass_the_first_use_check(backend, index):
    # Through the op: the first use of each fp16 instantiation is checked
    # against the reference (moe_decode's two launches are judged here by its
    # contract, as its own self-check judges them).
    name, (args, kwargs) = _fp16_calls()[index]
    op = OPS[name]
    got = op(*args, **kwargs)
    mx.eval(got)
    assert op.last_path == "kernel", op.last_reason
    outputs = got if isinstance(got, (list, tuple)) else [got]
    assert all(o.dtype in (mx.float16, mx.float32) for o in outputs)
    if name == "moe_decode":
        from mlx_lily.kernels.moe.decode import moe_decode_agree

        assert moe_decode_agree(got, got, *args, **kwargs) is None
    elif name == "attention":
        from mlx_lily.kernels.attention.sdpa import attention_agree, attention_reference

        assert attention_agree(got, attention_reference(*args, **kwargs)) is None


def test_fp16_decode_attention_splits_at_long_contexts(backend):
    from mlx_lily.kernels.attention import sdpa as A

    q, k, v, scale, mask = A._decode_check_inputs(5000, Hq=16, Hkv=2, D=256)
    q, k, v = (a.astype(mx.float16) for a in (q, k, v))
    got = A.run_decode(backend, q, k, v, scale, mask)
    assert got.dtype == mx.float16
    assert A.attention_agree(got, A.attention_reference(q, k, v, scale, mask)) is None
