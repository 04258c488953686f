"""The MoE decode chain in four launches (moe_decode), one row.

In the CPU emulator against the op's contract (``moe_decode_precise``: stock's
math accumulated in fp32) at small odd shapes; the reference against stock's
own Qwen3NextSparseMoeBlock bit for bit; supports()' refusals; the CUDA
translation units compiled with nvcc.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.qwen3_next import Qwen3NextMLP, Qwen3NextSparseMoeBlock
from mlx_lm.models.switch_layers import SwitchGLU

from mlx_lily import kernels as K
from mlx_lily.kernels.moe.decode import (
    moe_decode_agree,
    moe_decode_combine_kernel,
    moe_decode_down_kernel,
    moe_decode_gate_up_kernel,
    moe_decode_kernel,
    moe_decode_precise,
    moe_decode_reference,
    moe_decode_route_kernel,
    moe_decode_supports,
    ROUTE_NORM_SG,
)
from mlx_lily.kernels.moe.router import router_topk_ground_truth
from mlx_lily.toolchain.registry import BACKEND_ENV
from mlx_lily.kernels.moe.testing import moe_decode_inputs, quantized_moe

from test_toolchain import emulator_or_skip, nvcc_ptx

# (D, E, k, I, shared I, renormalise): 24 experts top-3 at D 192 with a wider
# and a narrower shared expert, top-1 and top-8, odd expert counts.
SHAPES = [
    (192, 24, 3, 64, 128, True),
    (192, 24, 3, 128, 64, False),
    (128, 13, 1, 64, 192, True),
    (64, 40, 8, 64, 64, False),
]


def check(args):
    assert moe_decode_supports(*args) is None
    got = moe_decode_kernel.emulate(*args)
    want = moe_decode_reference(*args)
    mx.eval(got, want)
    mismatch = moe_decode_agree(got, want, *args)
    assert mismatch is None, mismatch
    return got, want


@pytest.mark.parametrize("D, E, k, I, IS, normalize", SHAPES)
def test_kernels_meet_the_contract_in_the_emulator(D, E, k, I, IS, normalize):
    emulator_or_skip()
    args, _ = moe_decode_inputs(D, E, k, I, IS, normalize=normalize, seed=D + E + k)
    got, want = check(args)
    # The reference (stock's CPU ops) stays within the same contract.
    assert moe_decode_agree(want, want, *args) is None


@pytest.mark.parametrize("D, E, k, I, IS, normalize", SHAPES)
def test_fp16_kernels_meet_the_contract_in_the_emulator(D, E, k, I, IS, normalize):
    # fp16 h, logits, norm weight, scales and biases: the kernels round to
    # fp16 where they round to bf16 for bf16 calls; the contract's bound is
    # 2^-10 of each element's magnitudes (bf16's 2^-7, 8 times finer).
    emulator_or_skip()
    args, _ = moe_decode_inputs(D, E, k, I, IS, normalize=normalize, seed=D + E + k, dtype=mx.float16)
    got, want = check(args)
    assert got.dtype == want.dtype == mx.float16
    # Against the same math in fp32 (no rounding but the inputs'): a handful
    # of fp16 roundings of half a step (2^-11) each along the chain.
    precise, magnitude = moe_decode_precise(*args)
    f32 = lambda a: a.astype(mx.float32)  # noqa: E731
    h, logits, gate_logit, norm_weight, eps, top_k, norm_topk, glu, shared = args
    xn = mx.fast.rms_norm(f32(h), f32(norm_weight), eps)
    order, weights, _ = router_topk_ground_truth(logits.reshape(1, -1), top_k, norm_topk)
    y = mx.zeros((1, 1, h.shape[-1]))
    for j, e in enumerate(order[0].tolist()):
        y = y + float(weights[0][j]) * glu(xn, mx.array([[[e]]], mx.uint32)).reshape(1, 1, -1)
    oracle = f32(h) + y + mx.sigmoid(f32(gate_logit)) * shared(xn)
    err = mx.abs(f32(got) - oracle).reshape(-1)
    assert mx.all(err <= 2.0**-8 * (magnitude + mx.abs(oracle).reshape(-1))).item()


def test_routing_outputs_follow_the_router_with_ties():
    emulator_or_skip()
    # Runs of equal logits across the 3rd place: the higher expert index first.
    logits = np.array([1.0, 3.0, 2.0, 3.0, 0.0, 2.0, 2.0, -1.0] * 3)
    args, _ = moe_decode_inputs(192, 24, 3, 64, 128, seed=5, logits=logits)
    xn, inds, scores = moe_decode_route_kernel.emulate(*args[:2], *args[3:7])
    order, weights, _ = router_topk_ground_truth(args[1].reshape(1, 24), 3, True)
    assert inds[0].tolist() == order[0].tolist() == [19, 17, 11]
    assert np.allclose(np.array(scores[0].astype(mx.float32)), weights[0], rtol=1e-2)
    check(args)


def test_a_nan_logits_row_reads_in_range_and_gives_nan():
    emulator_or_skip()
    logits = np.full(24, -np.inf)
    logits[5] = np.nan
    args, _ = moe_decode_inputs(64, 24, 8, 64, 64, seed=6, logits=logits)
    got = moe_decode_kernel.emulate(*args)  # the emulator raises on an out-of-range read
    assert mx.isnan(got).all().item()
    precise, _ = moe_decode_precise(*args)
    assert mx.isnan(precise).all().item()


def test_agree_rejects_a_wrong_output():
    args, _ = moe_decode_inputs(64, 8, 2, 64, 64, seed=7)
    precise, _ = moe_decode_precise(*args)
    assert moe_decode_agree(precise, precise, *args) is None
    off = (precise.astype(mx.float32) + 0.5).astype(mx.bfloat16)
    assert "magnitudes" in moe_decode_agree(off, precise, *args)
    nan = mx.where(mx.arange(64) == 3, mx.array(float("nan")), precise.astype(mx.float32)).astype(mx.bfloat16)
    assert "NaN" in moe_decode_agree(nan, precise, *args)


def test_supports_refuses_what_the_kernels_do_not_take():
    args, _ = moe_decode_inputs(64, 8, 2, 64, 64, seed=8)
    assert moe_decode_supports(*args) is None

    def with_(i, value):
        changed = list(args)
        changed[i] = value
        return moe_decode_supports(*changed)

    h = args[0]
    assert "one token" in with_(0, mx.concatenate([h, h], axis=1))
    assert "one token" in with_(0, mx.concatenate([h, h], axis=0))
    assert "bfloat16" in with_(0, h.astype(mx.float16))
    assert "top_k=9" in with_(5, 9)
    assert "top_k=0" in with_(5, 0)
    # I = 96 cannot be group-64 quantized along the down projection's input:
    # its down projection stays unquantized, as the checkpoints leave it.
    mx.random.seed(1)
    glu = SwitchGLU(64, 96, 8)
    glu.set_dtype(mx.bfloat16)
    nn.quantize(glu, group_size=64, bits=4, class_predicate=lambda p, m: hasattr(m, "to_quantized") and not p.endswith("down_proj"))
    assert "down_proj: SwitchLinear" in with_(7, glu)
    unquantized = Qwen3NextMLP(64, 64)
    assert "QuantizedLinear" in with_(8, unquantized)
    shared8 = Qwen3NextMLP(64, 64)
    shared8.set_dtype(mx.bfloat16)
    nn.quantize(shared8, group_size=64, bits=8)
    assert "8-bit" in with_(8, shared8)
    # D a multiple of 64, at most 4096.
    odd = list(args)
    odd[0] = mx.zeros((1, 1, 96), mx.bfloat16)
    odd[3] = mx.zeros((96,), mx.bfloat16)
    assert "D=96" in moe_decode_supports(*odd)


def _stock_block(D, E, k, I, IS, normalize, seed):
    args = SimpleNamespace(hidden_size=D, moe_intermediate_size=I, shared_expert_intermediate_size=IS,
                           norm_topk_prob=normalize, num_experts=E, num_experts_per_tok=k)
    mx.random.seed(seed)
    block = Qwen3NextSparseMoeBlock(args)
    block.set_dtype(mx.bfloat16)
    # As the real checkpoints: router and shared gate 8-bit, the rest 4-bit, group 64.
    nn.quantize(block, group_size=64, bits=8,
                class_predicate=lambda p, m: isinstance(m, nn.Linear) and p.endswith("gate")
                and not p.endswith("gate_proj"))
    nn.quantize(block, group_size=64, bits=4,
                class_predicate=lambda p, m: hasattr(m, "to_quantized") and not isinstance(m, nn.QuantizedLinear)
                and not p.endswith("gate"))
    mx.eval(block.parameters())
    return block


@pytest.mark.parametrize("normalize", [True, False])
def test_the_reference_is_stock_s_block_to_the_bit(normalize, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "reference")
    D, E, k = 128, 24, 3
    block = _stock_block(D, E, k, 64, 128, normalize, seed=3)
    assert isinstance(block.gate, nn.QuantizedLinear) and block.gate.bits == 8
    assert block.switch_mlp.gate_proj.bits == 4
    rng = np.random.default_rng(3)
    h = mx.array(4 * rng.standard_normal((1, 1, D)).astype(np.float32)).astype(mx.bfloat16)
    w = mx.array(1 + 0.1 * rng.standard_normal(D).astype(np.float32)).astype(mx.bfloat16)
    eps = 1e-6
    xn = mx.fast.rms_norm(h, w, eps)
    stock = h + block(xn)  # the decoder layer: out = h + mlp(post_attention_layernorm(h))
    ours = moe_decode_reference(h, block.gate(xn), block.shared_expert_gate(xn), w, eps, k, normalize,
                                block.switch_mlp, block.shared_expert)
    assert mx.array_equal(stock, ours).item()
    args = (h, block.gate(xn), block.shared_expert_gate(xn), w, eps, k, normalize, block.switch_mlp,
            block.shared_expert)
    assert moe_decode_supports(*args) is None
    # And the op on the reference path.
    assert mx.array_equal(K.moe_decode(*args), stock).item()
    assert K.moe_decode.last_path == "reference"


def test_compiles_for_cuda_without_local_memory(tmp_path, monkeypatch):
    from mlx_lily.kernels.moe import decode

    units = {}
    # The real shape (D 2048, 256 experts top-8, I 512) and a small odd one.
    # The real shape in fp16 too.
    for D, E, k, I, IS, dt in ((2048, 256, 8, 512, 512, mx.bfloat16), (192, 24, 3, 64, 128, mx.bfloat16),
                               (2048, 256, 8, 512, 512, mx.float16)):
        glu, shared = quantized_moe(D, I, IS, E if E < 64 else 2, seed=0, dtype=dt)
        if E >= 64:  # the real shape's arrays, without the real model's memory
            glu = SimpleNamespace(**{n: SimpleNamespace(
                weight=mx.zeros((E, *getattr(glu, n).weight.shape[1:]), mx.uint32),
                scales=mx.zeros((E, *getattr(glu, n).scales.shape[1:]), dt),
                biases=mx.zeros((E, *getattr(glu, n).biases.shape[1:]), dt))
                for n in ("gate_proj", "up_proj", "down_proj")})
        h = mx.zeros((1, 1, D), dt)
        logits = mx.zeros((1, 1, E), dt)
        tag = f"{D}" if dt == mx.bfloat16 else f"{D}_fp16"
        units[f"route_{tag}"] = moe_decode_route_kernel.cuda_translation_unit(
            h, logits, mx.zeros((D,), dt), 1e-6, k, True)
        inds = mx.zeros((1, k), mx.uint32)
        units[f"gate_up_{tag}"] = moe_decode_gate_up_kernel.cuda_translation_unit(
            mx.zeros((1, D), dt), inds, glu, shared)
        units[f"down_{tag}"] = moe_decode_down_kernel.cuda_translation_unit(
            mx.zeros((1, k + 1, max(I, IS)), dt), inds, mx.zeros((1, k), dt), mx.zeros((1, 1, 1), dt), glu, shared)
        units[f"combine_{tag}"] = moe_decode_combine_kernel.cuda_translation_unit(
            h, mx.zeros((1, k + 1, D), dt))
        # The no-residual form (a tensor-parallel rank's partial sum).
        units[f"combine_partial_{tag}"] = moe_decode_combine_kernel.cuda_translation_unit(
            h, mx.zeros((1, k + 1, D), dt), False)
        # Down and the combine as one launch (one row), with and without the residual.
        for residual in (True, False):
            units[f"down_combine_{tag}_{'residual' if residual else 'partial'}"] = \
                decode.moe_decode_down_combine_kernel.cuda_translation_unit(
                    h, mx.zeros((1, k + 1, max(I, IS)), dt), inds, mx.zeros((1, k), dt), mx.zeros((1, 1, 1), dt),
                    glu, shared, residual)
        # Route and gate/up as one launch (a few rows).
        units[f"routed_{tag}"] = decode.moe_decode_route_gate_up_kernel.cuda_translation_unit(
            h, logits, mx.zeros((D,), dt), 1e-6, k, True, glu, shared)
        if D == 2048 and dt == mx.bfloat16:
            # Down's launches on CUDA by the call's rows (CUDA_DOWN_LAUNCH_FOR_BATCH).
            with monkeypatch.context() as m:
                m.setattr(decode, "gpu_backend", lambda: "cuda")
                for B in sorted({at for at, _, _ in decode.CUDA_DOWN_LAUNCH_FOR_BATCH}):
                    rows = mx.zeros((B, k), mx.uint32)
                    units[f"down_{tag}_b{B}"] = moe_decode_down_kernel.cuda_translation_unit(
                        mx.zeros((B, k + 1, max(I, IS)), dt), rows, mx.zeros((B, k), dt), mx.zeros((B, 1, 1), dt),
                        glu, shared)
    for name, text in nvcc_ptx(tmp_path, units, warnings_ok=False).items():
        # Top-k ranks, activations and accumulators stay in registers.
        assert "ld.local" not in text and "st.local" not in text, name
        # No threadgroup memory but the route's NORM_SG partial sums of its
        # norm (one barrier inside a row's threadgroup): no launch waits on
        # another part of its grid.
        shared = re.findall(r"\.shared[^;]*\[(\d+)\]", text)
        if name.startswith("route_"):
            assert [int(n) for n in shared] == [4 * ROUTE_NORM_SG], name
        elif name.startswith("routed_"):
            # Every row's picks, the norm's partial sums and inverse rms, and
            # the one row's normed x (D values, two bytes each).
            D = 2048 if "2048" in name else 192
            assert sorted(int(n) for n in shared) == sorted([4 * decode.MAX_BATCH * 8 if D == 2048 else
                                                             4 * decode.MAX_BATCH * 3, 4 * ROUTE_NORM_SG,
                                                             4 * decode.MAX_BATCH, 2 * D]), (name, shared)
        elif name.startswith("down_combine_"):
            # The slots' terms at the threadgroup's elements (T: two bytes).
            slots = 9 if name.startswith("down_combine_2048") else 4
            assert [int(n) for n in shared] == [2 * slots * decode.COMBINED_DOWN_ROWS], (name, shared)
        else:
            assert not re.search(r"\.shared", text), name


def test_the_launches_take_the_gemv_outputs_as_they_are():
    """h and the router GEMV's two outputs, [1, 1, N] each, reach the kernels
    as the same arrays (the bodies read them flat): a reshape here would put
    a view node per input into every decode token's graph."""
    from mlx_lily.kernels.moe.decode import _launch_combine, _launch_down, _launch_gate_up, _launch_route

    (h, logits, shared_logit, norm_weight, eps, k, normalize, glu, shared), _ = moe_decode_inputs(
        128, 24, 3, 64, 128, seed=5)
    assert h.shape == (1, 1, 128) and logits.shape == (1, 1, 24) and shared_logit.shape == (1, 1, 1)
    route = _launch_route(h, logits, norm_weight, eps, k, normalize)
    assert route.inputs[0] is h and route.inputs[1] is logits
    xn, inds, scores = (mx.zeros(s, dtype=d) for s, d in zip(route.output_shapes, route.output_dtypes))
    gate_up = _launch_gate_up(xn, inds, glu, shared)
    # The weights themselves, not gathered copies (bytes counted by inputs stay honest).
    assert gate_up.inputs[1] is inds
    assert gate_up.inputs[2] is glu.gate_proj.weight and gate_up.inputs[8] is shared.gate_proj.weight
    act = mx.zeros(gate_up.output_shapes[0], dtype=gate_up.output_dtypes[0])
    down = _launch_down(act, inds, scores, shared_logit, glu, shared)
    assert down.inputs[1] is inds and down.inputs[3] is shared_logit
    assert down.inputs[4] is glu.down_proj.weight and down.inputs[7] is shared.down_proj.weight
    terms = mx.zeros(down.output_shapes[0], dtype=down.output_dtypes[0])
    assert terms.shape == (1, k + 1, 128)
    assert _launch_combine(h, terms).inputs[0] is h


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_the_routed_launch_keeps_as_many_threadgroups_resident_as_gate_up_alone(rows, tmp_path):
    """At the real shape, route and gate/up as one launch take no more of an
    SM (sm_90a, 256-thread threadgroups, 64K registers) than gate/up alone:
    its rows' normed x is read from threadgroup memory, as gate/up reads xn,
    not rebuilt from h and the norm weight in its loop (which took the
    routed build to 94 registers a thread, two threadgroups an SM against
    gate/up's four, and its 576 threadgroups at one row into three waves)."""
    import shutil

    from bench.diagnostics.tuning.launch_occupancy import nvcc_resources, resident_per_sm
    from mlx_lily.kernels.moe import decode

    if shutil.which("nvcc") is None:
        pytest.skip("nvcc is not on PATH")
    D, E, k, I, IS, dt = 2048, 256, 8, 512, 512, mx.bfloat16
    glu, shared = quantized_moe(D, I, IS, 2, seed=0, dtype=dt)
    glu = SimpleNamespace(**{n: SimpleNamespace(
        weight=mx.zeros((E, *getattr(glu, n).weight.shape[1:]), mx.uint32),
        scales=mx.zeros((E, *getattr(glu, n).scales.shape[1:]), dt),
        biases=mx.zeros((E, *getattr(glu, n).biases.shape[1:]), dt)) for n in ("gate_proj", "up_proj", "down_proj")})
    units = {
        "gate_up": decode.moe_decode_gate_up_kernel.cuda_translation_unit(
            mx.zeros((rows, D), dt), mx.zeros((rows, k), mx.uint32), glu, shared),
        "routed": decode.moe_decode_route_gate_up_kernel.cuda_translation_unit(
            mx.zeros((rows, 1, D), dt), mx.zeros((rows, 1, E), dt), mx.zeros((D,), dt), 1e-6, k, True, glu, shared),
    }
    assert decode.routes_in_gate_up(1, D, 2) and not decode.routes_in_gate_up(1, 4 * D, 4)
    resident = {}
    for name, unit in units.items():
        used = nvcc_resources(unit, tmp_path, name)  # nvcc sm_90a, as lily's CUDA cache compiles
        assert used["stack"] == 0 and used["registers"] > 0, (name, used)
        resident[name] = resident_per_sm(used["registers"], decode.GATE_UP_SIMD_GROUPS * 32, used["shared"])[0]
    assert resident["routed"] >= resident["gate_up"] >= 4, resident
