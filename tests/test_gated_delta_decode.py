"""The Gated DeltaNet decode step in one kernel (gated_delta_decode).

In the CPU emulator against the op's reference (the layer's own op sequence)
at small odd shapes, over several consecutive steps that carry the conv state
and the recurrent state; in the model on the demo checkpoint (the decode steps
take the kernel, greedy tokens are stock's); compiled for CUDA with nvcc.
"""

from __future__ import annotations

import re

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import mlx_lily
from mlx_lily import kernels as K
from mlx_lily.kernels.gated_delta.decode import (
    gated_delta_decode_agree,
    gated_delta_decode_kernel,
    gated_delta_decode_reference,
    gated_delta_decode_supports,
)
from mlx_lily.toolchain.registry import BACKEND_ENV, LilyOp
from mlx_lily.kernels.gated_delta.testing import gated_delta_decode_inputs

from test_model import TOKENS, greedy
from test_toolchain import emulator_or_skip, nvcc_ptx

# (Hk, value heads per key head, Dk, Dv): odd head counts, ratios 1-3.
SHAPES = [(1, 1, 32, 32), (1, 3, 64, 32), (2, 2, 32, 64), (3, 1, 64, 64), (3, 3, 32, 32), (2, 3, 64, 64)]


def run_steps(Hk, ratio, Dk, Dv, steps, with_state, seed, dtype=mx.bfloat16):
    """`steps` decode steps through the kernel and through the reference,
    each carrying its own conv and recurrent state; every step's outputs
    meet the contract, and the conv states are equal throughout."""
    rng = np.random.default_rng(seed)
    args, _ = gated_delta_decode_inputs(Hk, Hk * ratio, Dk, Dv, with_state=with_state, rng=rng, dtype=dtype)
    args = list(args)
    kernel_conv, kernel_state = args[4], args[8]
    for step in range(steps):
        if step:
            fresh, _ = gated_delta_decode_inputs(Hk, Hk * ratio, Dk, Dv, rng=rng, dtype=dtype)
            args[:4] = fresh[:4]  # a new token's qkv, z, a, b
        kernel_args = tuple(args[:4]) + (kernel_conv,) + tuple(args[5:8]) + (kernel_state,) + tuple(args[9:])
        assert gated_delta_decode_supports(*kernel_args) is None
        got = gated_delta_decode_kernel.emulate(*kernel_args)
        want = gated_delta_decode_reference(*args)
        mx.eval(got, want)
        mismatch = gated_delta_decode_agree(got, want)
        assert mismatch is None, f"step {step}: {mismatch}"
        # Each path goes on from its own state (the kernel's error may grow).
        kernel_conv, kernel_state = got[1], got[2]
        args[4], args[8] = want[1], want[2]
    return got, want


@pytest.mark.parametrize("Hk, ratio, Dk, Dv", SHAPES)
def test_steps_carry_conv_and_recurrent_state(Hk, ratio, Dk, Dv):
    emulator_or_skip()
    run_steps(Hk, ratio, Dk, Dv, steps=3, with_state=True, seed=Hk * 10 + ratio + Dk + Dv)


@pytest.mark.parametrize("Hk, ratio, Dk, Dv", SHAPES[:4])
def test_fp16_steps_carry_conv_and_recurrent_state(Hk, ratio, Dk, Dv):
    # Judged with gated_delta's fp16 bounds (out within 4e-3, state within
    # 2.5e-3 of the reference's largest value: bf16's 3e-2 and 2e-2 scaled by
    # fp16's 8 times finer step, with room for the fp32 sums' order).
    emulator_or_skip()
    got, want = run_steps(Hk, ratio, Dk, Dv, steps=3, with_state=True, seed=Hk + Dk + Dv, dtype=mx.float16)
    assert got[0].dtype == want[0].dtype == got[1].dtype == mx.float16 and got[2].dtype == mx.float32


def test_from_a_zero_state():
    emulator_or_skip()
    # No recurrent state yet (the kernel's HAS_STATE=false) and a zero conv state.
    args, _ = gated_delta_decode_inputs(2, 4, 32, 32, with_state=False, seed=3)
    args = list(args)
    args[4] = mx.zeros_like(args[4])
    got = gated_delta_decode_kernel.emulate(*args)
    want = gated_delta_decode_reference(*args)
    assert gated_delta_decode_agree(got, want) is None
    run_steps(2, 2, 32, 64, steps=3, with_state=False, seed=4)


def test_agree_rejects_a_wrong_conv_state_and_a_wrong_output():
    args, _ = gated_delta_decode_inputs(1, 2, 32, 32, seed=5)
    want = gated_delta_decode_reference(*args)
    out, conv, state = want
    assert gated_delta_decode_agree(want, want) is None
    assert "conv state" in gated_delta_decode_agree((out, conv + 1, state), want)
    assert "out" in gated_delta_decode_agree((out * 1.1, conv, state), want)
    assert "state" in gated_delta_decode_agree((out, conv, state * 1.1), want)


def _cuda_case():
    """A decode call captured on the H200 (small-alt, bf16, after a 256-token
    prompt) and MLX's CUDA ops' result for it (the reference run there)."""
    import pathlib

    data = np.load(pathlib.Path(__file__).parent / "data" / "gated_delta_decode_cuda_case.npz")
    dtypes = {"mlx.core.bfloat16": mx.bfloat16, "mlx.core.float32": mx.float32}
    names = ("qkv", "z", "a", "b", "conv_state", "conv_weight", "A_log", "dt_bias", "state", "norm_weight")
    args = tuple(mx.array(data["in_" + n]).astype(dtypes[str(data["dtype_" + n])]) for n in names)
    args += (float(data["eps"]), int(data["hk"]))
    cuda_ops = tuple(mx.array(data[f"ref_gpu_{i}"]) for i in range(3))
    return args, cuda_ops


def test_agree_judges_against_the_cpu_s_rounding_not_another_device_s():
    emulator_or_skip()
    args, cuda_ops = _cuda_case()
    got = gated_delta_decode_kernel.emulate(*args)
    cuda_ops = (cuda_ops[0].astype(mx.bfloat16), cuda_ops[1].astype(mx.bfloat16), cuda_ops[2])
    # As given, CUDA's result is far from the kernel's ...
    assert gated_delta_decode_agree(got, cuda_ops) is not None
    # ... and from the same step in fp32, which the kernel is close to.
    f32 = tuple(a.astype(mx.float32) if isinstance(a, mx.array) else a for a in args)
    oracle = gated_delta_decode_reference(*f32)[0]

    def off(y):
        return (mx.abs(y.astype(mx.float32) - oracle).max() / mx.abs(oracle).max()).item()

    assert off(cuda_ops[0]) > 0.15 and off(got[0]) < 0.05
    # With the call's arguments the CPU reference judges: the kernel passes,
    # and a wrong output still fails.
    assert gated_delta_decode_agree(got, cuda_ops, *args) is None
    out, conv, state = got
    assert "out" in gated_delta_decode_agree((out * 1.1, conv, state), cuda_ops, *args)


def test_a_flat_z_gives_a_flat_out_with_the_same_bits():
    # The decode step passes z as the GEMV gives it, [B, 1, Hv * Dv], and
    # takes out so (no view node either side): the same bits as by heads, on
    # the kernel (one step of two rows, one a padding step; and the P
    # positions of a speculative round) and on the reference.
    from mlx_lily.kernels.gated_delta.decode import gated_delta_decode_steps_kernel, gated_delta_decode_steps_reference
    from mlx_lily.kernels.gated_delta.testing import gated_delta_decode_steps_inputs

    emulator_or_skip()
    args, kwargs = gated_delta_decode_inputs(2, 4, 32, 64, seed=21, B=2, mask=[True, False])
    B, _, Hv, Dv = args[1].shape
    flat = (args[0], args[1].reshape(B, 1, Hv * Dv)) + tuple(args[2:])
    assert gated_delta_decode_supports(*flat, **kwargs) is None
    for run in (gated_delta_decode_kernel.emulate, gated_delta_decode_reference):
        heads, flat_out = run(*args, **kwargs), run(*flat, **kwargs)
        mx.eval(heads, flat_out)
        assert heads[0].shape == (B, 1, Hv, Dv) and flat_out[0].shape == (B, 1, Hv * Dv)
        assert mx.array_equal(heads[0].reshape(B, 1, -1), flat_out[0]).item()
        for h, f in zip(heads[1:], flat_out[1:]):
            assert mx.array_equal(h, f).item()
    steps, _ = gated_delta_decode_steps_inputs(Hk=2, Hv=4, Dk=32, Dv=32, P=3, seed=22)
    P = steps[1].shape[0]
    flat_steps = (steps[0], steps[1].reshape(P, 1, -1)) + tuple(steps[2:])
    for run in (gated_delta_decode_steps_kernel.emulate, gated_delta_decode_steps_reference):
        heads, flat_out = run(*steps), run(*flat_steps)
        mx.eval(heads, flat_out)
        assert flat_out[0].shape == (P, 1, 4 * 32)
        assert all(mx.array_equal(h.reshape(f.shape), f).item() for h, f in zip(heads, flat_out))
    # A flat z whose width is not A_log's heads of one width is refused by name.
    odd = (args[0], args[1].reshape(B, 1, Hv * Dv)[..., :-1]) + tuple(args[2:])
    assert "A_log" in gated_delta_decode_supports(*odd, **kwargs)


def test_supports_takes_one_bf16_token_only():
    args, _ = gated_delta_decode_inputs(2, 4, 32, 32, seed=6)
    assert gated_delta_decode_supports(*args) is None
    two = list(args)
    two[0] = mx.concatenate([args[0], args[0]], axis=1)
    two[1] = mx.concatenate([args[1], args[1]], axis=1)
    assert "T=2" in gated_delta_decode_supports(*two)
    single = list(args)
    single[0] = args[0].astype(mx.float32)
    assert "bfloat16" in gated_delta_decode_supports(*single)
    mixed = list(args)
    mixed[0] = args[0].astype(mx.float16)
    assert "qkv's" in gated_delta_decode_supports(*mixed)
    half, _ = gated_delta_decode_inputs(2, 4, 32, 32, seed=6, dtype=mx.float16)
    assert gated_delta_decode_supports(*half) is None
    odd_dk, _ = gated_delta_decode_inputs(1, 1, 48, 32, seed=6)
    assert "Dk=48" in gated_delta_decode_supports(*odd_dk)


def test_the_model_decodes_through_the_op_with_stock_s_tokens(demo_conditioned_checkpoint, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "emulator")
    stock, _ = mlx_lily.load(str(demo_conditioned_checkpoint), backend="mlx")
    lily, _ = mlx_lily.load(str(demo_conditioned_checkpoint), backend="lily")
    calls = []
    original = LilyOp.__call__

    def recorded(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        calls.append((self.name, args[0].shape[1] if args and hasattr(args[0], "shape") else None, self.last_path))
        return result

    monkeypatch.setattr(LilyOp, "__call__", recorded)
    assert greedy(lily, n_tokens=8) == greedy(stock, n_tokens=8)
    decode_calls = [path for name, _, path in calls if name == "gated_delta_decode"]
    assert decode_calls and all(path == "kernel" for path in decode_calls), K.gated_delta_decode.last_reason
    # Decode steps no longer run the recurrence op; the prompt still does.
    assert all(length > 1 for name, length, _ in calls if name == "gated_delta")


def test_the_reference_path_decodes_like_stock_to_the_bit(demo_checkpoint, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "reference")
    stock, _ = mlx_lily.load(str(demo_checkpoint), backend="mlx")
    lily, _ = mlx_lily.load(str(demo_checkpoint), backend="lily")
    cs, cl = make_prompt_cache(stock), make_prompt_cache(lily)
    mx.eval(stock(TOKENS[:, :8], cache=cs), lily(TOKENS[:, :8], cache=cl))
    for t in range(8, 12):
        step = TOKENS[:, t : t + 1]
        assert mx.array_equal(lily(step, cache=cl), stock(step, cache=cs)).item()
    assert K.gated_delta_decode.last_path == "reference"
    # The caches too, conv and recurrent state.
    for a, b in zip(cl, cs):
        if hasattr(a, "lengths"):
            assert mx.array_equal(a[0], b[0]).item() and mx.array_equal(a[1], b[1]).item()


def test_compiles_for_cuda_without_local_memory(tmp_path):
    units = {  # the real shape (Hk 16, Hv 32, Dk = Dv = 128) and a small odd one
        f"gdd_{Hv}": gated_delta_decode_kernel.cuda_translation_unit(*gated_delta_decode_inputs(Hk, Hv, Dk, Dv, seed=0)[0])
        for Hk, Hv, Dk, Dv in ((16, 32, 128, 128), (3, 9, 64, 48))
    }
    units["gdd_fp16"] = gated_delta_decode_kernel.cuda_translation_unit(
        *gated_delta_decode_inputs(16, 32, 128, 128, seed=0, dtype=mx.float16)[0])
    for text in nvcc_ptx(tmp_path, units).values():
        # State rows, q and k stay in registers.
        assert "ld.local" not in text and "st.local" not in text
        assert re.search(r"\.shared", text)
