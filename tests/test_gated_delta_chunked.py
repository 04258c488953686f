"""The chunked gated delta rule: the pure-MLX reference and the tile kernels.

The reference is checked against stock's sequential ops path and a float64
numpy recurrence (``ground_truth``, fed MLX's own gate rounding); the three
tile passes run in the CPU emulator against the sequential kernel (the
oracle) and the float64 recurrence; the op's choice between the two; and the
passes compiled for CUDA with nvcc.

Tolerances, as max |got - want| / max |want|:

* reference vs float64 and vs stock: the state 1e-5 (both are fp32 sums of the
  same terms in different orders; measured <= 1e-6); y by its dtype, one
  rounding of an fp32 sum: 8e-3 bf16 (2**-7, one bf16 step of the largest
  value), 1e-3 fp16 (2**-10), 1e-5 fp32.
* kernels vs float64 / the sequential kernel: y 2e-2 and the state 1e-2. The
  tiles' operands are bf16: q, k, v are exact, but A diag(beta gamma) and
  A diag(beta) (so W and U), the decayed k, P, D and the chunk-start state
  read by the output pass are each rounded once (2**-9 relative), and y once
  more to its dtype; a handful of such roundings in sequence. The state is
  carried in fp32 and enters W S^T as bf16 hi + lo. Measured at T = 1000
  with Dk = Dv = 128: y 5.8e-3, state 1.8e-3.
"""

from __future__ import annotations

import importlib
import re

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.gated_delta import compute_g, gated_delta_ops, gated_delta_update

from mlx_lily.kernels.gated_delta.recurrence import gated_delta, gated_delta_kernel, uses_chunked
from mlx_lily.kernels.gated_delta.chunked import (
    CHUNKED_KERNELS,
    gated_delta_chunked_reference,
    gated_delta_chunked_run,
)
from mlx_lily.toolchain import lint

from test_gated_delta_kernel import ground_truth, make_inputs
from test_toolchain import emulator_or_skip, nvcc_ptx

# The modules (the package exports the op under the module's name).
gd = importlib.import_module("mlx_lily.kernels.gated_delta.recurrence")
gdc = importlib.import_module("mlx_lily.kernels.gated_delta.chunked")

STEPS = [1, 63, 64, 65, 1000]
RATIOS = [1, 2, 3]  # value heads per key head
DTYPES = [mx.float32, mx.bfloat16, mx.float16]
Y_TOL = {mx.bfloat16: 8e-3, mx.float16: 1e-3, mx.float32: 1e-5}
KERNEL_Y_TOL, KERNEL_STATE_TOL = 2e-2, 1e-2


def rel_err(got, want) -> float:
    got = np.array(got.astype(mx.float32)).astype(np.float64) if isinstance(got, mx.array) else got
    want = np.array(want.astype(mx.float32)).astype(np.float64) if isinstance(want, mx.array) else want
    assert got.shape == want.shape
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


# -- the pure-MLX chunked reference -------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("T", STEPS)
def test_reference_matches_stock_and_float64(T, ratio, dtype):
    for with_state in (False, True):
        args = make_inputs(1, T, 2, 2 * ratio, 32, 32, dtype, with_state, seed=T + ratio)
        y, state = gated_delta_chunked_reference(*args)
        assert y.shape == (1, T, 2 * ratio, 32) and y.dtype == dtype
        assert state.shape == (1, 2 * ratio, 32, 32) and state.dtype == mx.float32
        want_y, want_state = ground_truth(*args)
        assert rel_err(state, want_state) <= 1e-5
        assert rel_err(y, want_y) <= Y_TOL[dtype]
        stock_y, stock_state = gated_delta_update(*args, use_kernel=False)
        assert rel_err(state, stock_state) <= 1e-5
        assert rel_err(y, stock_y) <= Y_TOL[dtype]


def test_reference_tiny_gates_do_not_overflow():
    # Large A and a: log g ~ -400 per token, the chunk's cumulative log decay
    # reaches ~ -25000; decay ratios must stay exp of differences (no inf/NaN).
    q, k, v, a, b, A_log, dt_bias, state = make_inputs(1, 130, 1, 2, 32, 32, mx.float32, True, seed=2)
    a, A_log = a + 20.0, A_log + 3.0
    args = (q, k, v, a, b, A_log, dt_bias, state)
    y, s = gated_delta_chunked_reference(*args)
    assert np.isfinite(np.array(y)).all() and np.isfinite(np.array(s)).all()
    want_y, want_s = ground_truth(*args)
    assert rel_err(s, want_s) <= 1e-5 and rel_err(y, want_y) <= 1e-5


def test_reference_mask_matches_stock_ops():
    args = make_inputs(2, 65, 1, 2, 32, 32, mx.float32, True, seed=4)
    q, k, v, a, b, A_log, dt_bias, state = args
    mask = mx.random.uniform(shape=(2, 65), key=mx.random.key(9)) > 0.3
    y, s = gated_delta_chunked_reference(*args, mask=mask)
    g = compute_g(A_log, a, dt_bias)
    want_y, want_s = gated_delta_ops(q, k, v, g, mx.sigmoid(b), state, mask)
    assert rel_err(s, want_s) <= 1e-5 and rel_err(y, want_y) <= 1e-5
    # The mask matters: without it the state differs.
    assert rel_err(gated_delta_chunked_reference(*args)[1], want_s) > 1e-3


# -- the tile kernels in the emulator -------------------------------------------------


def check_kernels(args, y_tol=KERNEL_Y_TOL, state_tol=KERNEL_STATE_TOL):
    got_y, got_state = gated_delta_chunked_run("emulator", *args)
    B, T, Hk, Dk = args[0].shape
    Hv, Dv = args[2].shape[2:]
    assert got_y.shape == (B, T, Hv, Dv) and got_y.dtype == args[0].dtype
    assert got_state.shape == (B, Hv, Dv, Dk) and got_state.dtype == mx.float32
    want_y, want_state = ground_truth(*args)
    assert rel_err(got_y, want_y) <= y_tol
    assert rel_err(got_state, want_state) <= state_tol
    oracle_y, oracle_state = gated_delta_kernel.emulate(*args)
    assert rel_err(got_y, oracle_y) <= y_tol
    assert rel_err(got_state, oracle_state) <= state_tol
    return got_y, got_state


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "state"])
@pytest.mark.parametrize("ratio", RATIOS)
@pytest.mark.parametrize("T", [1, 63, 64, 65, 200])
def test_kernels_match_the_sequential_kernel_and_float64(T, ratio, with_state):
    emulator_or_skip()
    check_kernels(make_inputs(1, T, 1, ratio, 64, 32, mx.bfloat16, with_state, seed=T * 7 + ratio))


@pytest.mark.parametrize("dtype", [mx.float16, mx.float32], ids=str)
def test_kernels_take_other_dtypes_at_bf16_precision(dtype):
    # The launcher rounds q, k, v to bf16 (the op sends these dtypes to the
    # sequential kernel; the passes still compute them to bf16 precision).
    emulator_or_skip()
    check_kernels(make_inputs(1, 65, 1, 2, 64, 32, dtype, True, seed=11))


def test_kernels_batch_of_two_and_dv_64():
    emulator_or_skip()
    check_kernels(make_inputs(2, 100, 2, 4, 64, 64, mx.bfloat16, True, seed=12))


@pytest.mark.slow
def test_kernels_at_real_head_dims_for_1000_tokens():
    # Dk = Dv = 128 (Qwen3.6's), 16 chunks carrying the state: the precision
    # over a long call against the float64 recurrence.
    emulator_or_skip()
    check_kernels(make_inputs(1, 1000, 1, 2, 128, 128, mx.bfloat16, True, seed=13))


def test_prefill_in_two_calls_carries_the_state():
    emulator_or_skip()
    args = make_inputs(1, 150, 1, 2, 64, 32, mx.bfloat16, True, seed=14)
    q, k, v, a, b, A_log, dt_bias, state = args
    y1, s1 = gated_delta_chunked_run("emulator", *(x[:, :70] for x in (q, k, v, a, b)), A_log, dt_bias, state)
    y2, s2 = gated_delta_chunked_run("emulator", *(x[:, 70:] for x in (q, k, v, a, b)), A_log, dt_bias, s1)
    want_y, want_s = ground_truth(*args)
    assert rel_err(mx.concatenate([y1, y2], axis=1), want_y) <= KERNEL_Y_TOL
    assert rel_err(s2, want_s) <= KERNEL_STATE_TOL


def test_the_state_pass_keeps_the_state_after_the_last_whole_chunk():
    # Prefix reuse's checkpoint inside a call: the state at the start of the
    # last (partial) chunk is, bit for bit, the state of a call cut there,
    # and asking for it changes nothing else.
    emulator_or_skip()
    q, k, v, a, b, A_log, dt_bias, state = make_inputs(1, 137, 1, 2, 64, 32, mx.bfloat16, True, seed=15)
    y, s_end, at_cut = gated_delta_chunked_run("emulator", q, k, v, a, b, A_log, dt_bias, state, capture=True)
    assert gdc.piece_end(137) == 128
    _, s_cut = gated_delta_chunked_run("emulator", *(x[:, :128] for x in (q, k, v, a, b)), A_log, dt_bias, state)
    y_plain, s_plain = gated_delta_chunked_run("emulator", q, k, v, a, b, A_log, dt_bias, state)
    assert mx.array_equal(at_cut, s_cut).item()
    assert mx.array_equal(y, y_plain).item() and mx.array_equal(s_end, s_plain).item()
    assert not mx.array_equal(at_cut, s_end).item()


@pytest.mark.parametrize("T, dtype", [(137, mx.bfloat16), (137, mx.float16), (40, mx.bfloat16), (128, mx.bfloat16)])
def test_the_op_s_piece_state_is_the_state_of_a_call_cut_there(monkeypatch, T, dtype):
    # Every path (chunked, sequential kernel, reference): y and the final
    # state are the plain call's, and the extra state is that after
    # piece_end(T) tokens (the incoming state before a whole chunk).
    args = make_inputs(1, T, 1, 2, 64, 32, dtype, True, seed=16)
    q, k, v, a, b, A_log, dt_bias, state = args
    cut = gdc.piece_end(T)
    for backend in ("emulator", "reference"):
        monkeypatch.setenv("MLX_LILY_KERNEL_BACKEND", backend)
        y, s_end, at_cut = gated_delta(*args, None, capture=True)
        y_plain, s_plain = gated_delta(*args, None)
        assert mx.array_equal(y, y_plain).item() and mx.array_equal(s_end, s_plain).item()
        if cut == 0:
            want = state
        else:
            _, want = gated_delta(*(x[:, :cut] for x in (q, k, v, a, b)), A_log, dt_bias, state, None)
        assert mx.array_equal(at_cut, want).item(), (backend, T, dtype)


# -- the op's choice ------------------------------------------------------------------


def test_uses_chunked_by_length_dtype_and_head_size():
    def args(T, dtype=mx.bfloat16, Dk=64, Dv=32):
        return make_inputs(1, T, 1, 2, Dk, Dv, dtype, False)

    assert uses_chunked(*args(gd.CHUNKED_FROM)) is None
    assert "CHUNKED_FROM" in uses_chunked(*args(gd.CHUNKED_FROM - 1))
    assert "dtype" in uses_chunked(*args(gd.CHUNKED_FROM + 8, mx.float16))
    assert "Dk=32" in uses_chunked(*args(gd.CHUNKED_FROM + 8, Dk=32))
    assert "Dv=16" in uses_chunked(*args(gd.CHUNKED_FROM + 8, Dv=16))


def test_the_op_runs_the_chunked_kernels_for_long_calls(emulator_backend, fresh_notices, capsys, monkeypatch):
    emulator_or_skip()
    monkeypatch.setattr(gd, "CHUNKED_FROM", 64)  # a long call at emulator-friendly size
    kernels = gated_delta.kernel
    kernels.forget()
    long_args = make_inputs(1, 70, 1, 2, 64, 32, mx.bfloat16, True, seed=15)
    assert kernels.path_for("emulator", *long_args) == "chunked"
    got = gated_delta(*long_args)
    assert gated_delta.last_path == "kernel"
    want = gd.gated_delta_reference(*long_args)
    assert gd.gated_delta_agree(got, want, *long_args) is None
    short_args = make_inputs(1, 5, 1, 2, 64, 32, mx.bfloat16, True, seed=15)
    assert kernels.path_for("emulator", *short_args) == "sequential"
    assert capsys.readouterr().err == ""


def test_a_failing_chunked_self_check_keeps_the_sequential_kernel(monkeypatch, fresh_notices, capsys):
    emulator_or_skip()
    monkeypatch.setattr(gd, "CHUNKED_FROM", 64)
    kernels = gated_delta.kernel
    kernels.forget()

    def wrong(backend, *args):
        y, s = gdc.gated_delta_chunked_run(backend, *args)
        return y, s * 1.5

    monkeypatch.setattr(gd, "gated_delta_chunked_run", wrong)
    args = make_inputs(1, 70, 1, 2, 64, 32, mx.bfloat16, True, seed=16)
    assert kernels.path_for("emulator", *args) == "sequential"
    assert kernels.path_for("emulator", *args) == "sequential"
    err = capsys.readouterr().err
    assert err.count("chunked gated_delta kernels are off") == 1 and "state" in err
    got = kernels.run_on("emulator", *args)
    assert gd.gated_delta_agree(got, gd.gated_delta_reference(*args), *args) is None
    kernels.forget()


# -- the bodies: portable subset, CUDA compile ------------------------------------------


def test_the_bodies_are_in_the_portable_subset():
    assert lint.lint_paths([k.body for k in CHUNKED_KERNELS]) == []


def _real_shape_units():
    """CUDA translation units of the three passes at Qwen3.6's shapes, T = 2048."""
    T, Hk, Hv, Dk, Dv, n = 2048, 16, 32, 128, 128, 2048 // gdc.CHUNK
    bf = mx.bfloat16
    q = mx.zeros((1, T, Hk, Dk), bf)
    v = mx.zeros((1, T, Hv, Dv), bf)
    gates = mx.zeros((1, T, Hv), bf)
    params = mx.zeros((Hv,), mx.float32)
    w = mx.zeros((1, Hv, T, Dk), bf)
    u = mx.zeros((1, Hv, T, Dv), mx.float32)
    kd = mx.zeros((1, Hv, n, Dk, gdc.CHUNK), bf)
    gcum = mx.zeros((1, Hv, T), mx.float32)
    s0 = mx.zeros((1, Hv, n, Dv, Dk), bf)
    d = mx.zeros((1, Hv, n, Dv, gdc.CHUNK), bf)
    p = mx.zeros((1, Hv, n, gdc.CHUNK, gdc.CHUNK), bf)
    state = mx.zeros((1, Hv, Dv, Dk), mx.float32)
    prepare, state_pass, output = CHUNKED_KERNELS
    return {
        "prepare": prepare.cuda_translation_unit(q, q, v, gates, gates, params, params),
        # Prompt rows of their own lengths (gated_delta_rows), 4 rows.
        "prepare, a length per row": prepare.cuda_translation_unit(
            *(mx.concatenate([x] * 4) for x in (q, q, v, gates, gates)), params, params,
            mx.array([2048, 100, 64, 1000], dtype=mx.int32)),
        "state": state_pass.cuda_translation_unit(w, u, kd, gcum, state),
        "output": output.cuda_translation_unit(q, s0, d, p, gcum, bf),
    }


def test_the_passes_compile_to_tensor_core_mma_with_nvcc(tmp_path):
    for name, text in nvcc_ptx(tmp_path, _real_shape_units()).items():
        assert re.search(r"mma\.sync\.aligned\.m16n8k16\.row\.col\.f32\.bf16\.bf16\.f32", text), name
        # Accumulators, the carried state and the prefetched blocks stay in registers.
        assert "ld.local" not in text and "st.local" not in text, name
