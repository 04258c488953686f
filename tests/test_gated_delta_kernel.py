"""The gated delta-rule kernel, run in the CPU emulator.

Checked against the op's reference (mlx-lm's ``gated_delta_update``) within
the op's contract (``gated_delta_agree``), and against a float64 numpy
recurrence fed the kernel's own gates, which pins the recurrence itself to
fp32 rounding: the reference's 16-bit gates may round a last bit differently.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.gated_delta import compute_g, gated_delta_ops, normalize_qk

from mlx_lily.kernels import OPS
from mlx_lily.kernels.gated_delta.recurrence import (
    gated_delta,
    gated_delta_agree,
    gated_delta_compare,
    gated_delta_kernel,
    gated_delta_reference,
    gated_delta_supports,
    rows_per_simdgroup,
)
from mlx_lily.toolchain.registry import BACKEND_ENV

try:
    import mlx_lily.emulator  # noqa: F401
except ImportError as exc:  # the emulator is built alongside; say so rather than fail
    pytest.skip(f"the CPU emulator is not importable: {exc}", allow_module_level=True)

# (Hk, Hv, Dk, Dv): Qwen3.6-35B-A3B's linear-attention heads, the two small
# test models', and a Hv == Hk one whose Dv (5) leaves a partial threadgroup.
REAL = (16, 32, 128, 128)
SHAPES = [REAL, (2, 4, 32, 32), (1, 3, 64, 32), (2, 2, 32, 5)]
SHAPE_IDS = ["real", "test-2-4", "test-1-3", "ratio-1"]
# 1 token (decode), 3, and 17 (a partial chunk of 32 tokens' gates).
STEPS = [1, 3, 17]
DTYPES = [mx.bfloat16, mx.float32]


def make_inputs(B, T, Hk, Hv, Dk, Dv, dtype, with_state, seed=0, gate_dtype=None):
    """The op's arguments as the layer passes them: q/k L2-normalised, fp32 params."""
    keys = mx.random.split(mx.random.key(seed), 8)
    q = mx.random.normal((B, T, Hk, Dk), key=keys[0]).astype(dtype)
    k = mx.random.normal((B, T, Hk, Dk), key=keys[1]).astype(dtype)
    q, k = normalize_qk(q, k, inv_scale=Dk**-0.5, eps=1e-6)
    v = mx.random.normal((B, T, Hv, Dv), key=keys[2]).astype(dtype)
    gate_dtype = gate_dtype or dtype
    a = mx.random.normal((B, T, Hv), key=keys[3]).astype(gate_dtype)
    b = mx.random.normal((B, T, Hv), key=keys[4]).astype(gate_dtype)
    A_log = mx.log(mx.random.uniform(1, 16, (Hv,), key=keys[5]))
    dt_bias = mx.random.uniform(0, 2, (Hv,), key=keys[6])
    state = 0.1 * mx.random.normal((B, Hv, Dv, Dk), key=keys[7]) if with_state else None
    return q, k, v, a, b, A_log, dt_bias, state


def rounded(x: np.ndarray, dtype) -> np.ndarray:
    return np.array(mx.array(x.astype(np.float32)).astype(dtype).astype(mx.float32))


def ground_truth(q, k, v, a, b, A_log, dt_bias, state=None):
    """The kernel's contract in float64 numpy: (y [B,T,Hv,Dv], state [B,Hv,Dv,Dk]).

    Gates rounded where MLX's reference rounds them, as the kernel does: a +
    dt_bias, exp, log1p and softplus to their promoted dtype; exp(|b|) and
    sigmoid(b) to b's.
    """
    f64 = lambda x: np.array(x.astype(mx.float32)).astype(np.float64)  # noqa: E731
    sum_dtype = mx.result_type(a.dtype, dt_bias.dtype)
    x = rounded(f64(a) + f64(dt_bias), sum_dtype).astype(np.float64)
    # softplus as MLX computes it: exp, log1p and the sum each rounded.
    e = rounded(np.exp(-np.abs(x)), sum_dtype).astype(np.float64)
    softplus = rounded(np.maximum(x, 0) + rounded(np.log1p(e), sum_dtype), sum_dtype)
    g = np.exp(-np.exp(f64(A_log)) * softplus)
    # MLX's sigmoid: 1 / (1 + exp(|x|)) with exp(|x|) in b's dtype, mirrored by sign.
    bx = f64(b)
    with np.errstate(over="ignore"):
        s = 1 / (1 + rounded(np.exp(np.abs(bx)), b.dtype).astype(np.float64))
    beta = rounded(np.where(bx < 0, s, 1 - s), b.dtype).astype(np.float64)
    qn, kn, vn = f64(q), f64(k), f64(v)
    B, T, Hk, Dk = qn.shape
    Hv, Dv = vn.shape[2:]
    S = np.zeros((B, Hv, Dv, Dk)) if state is None else f64(state)
    rep = Hv // Hk
    qn, kn = np.repeat(qn, rep, axis=2), np.repeat(kn, rep, axis=2)
    y = np.zeros((B, T, Hv, Dv))
    for t in range(T):
        S = S * g[:, t, :, None, None]
        kv = np.einsum("bhvk,bhk->bhv", S, kn[:, t])
        d = (vn[:, t] - kv) * beta[:, t, :, None]
        S = S + d[..., None] * kn[:, t, :, None, :]
        y[:, t] = np.einsum("bhvk,bhk->bhv", S, qn[:, t])
    return y, S


def assert_matches_ground_truth(got, args, y_rtol):
    y, state = got
    want_y, want_state = ground_truth(*args)
    y = np.array(y.astype(mx.float32))
    scale = np.abs(want_y).max()
    # y leaves in the activation dtype: one rounding of an fp32 sum.
    np.testing.assert_allclose(y, want_y, rtol=y_rtol, atol=y_rtol * 1e-2 * scale)
    np.testing.assert_allclose(
        np.array(state), want_state, rtol=1e-4, atol=1e-5 * np.abs(want_state).max()
    )


def run_and_check(args, dtype):
    assert gated_delta_supports(*args) is None
    got = gated_delta_kernel.emulate(*args)
    y, state = got
    B, T, Hk, Dk = args[0].shape
    Hv, Dv = args[2].shape[2:]
    assert y.shape == (B, T, Hv, Dv) and y.dtype == dtype
    assert state.shape == (B, Hv, Dv, Dk) and state.dtype == mx.float32
    want = gated_delta_reference(*args)
    assert gated_delta_agree(got, want, *args) is None
    # On a CPU the kernel's gates are the reference's to the bit, so the state
    # meets fp32's bound whatever the dtypes.
    scale = np.abs(np.array(want[1])).max()
    assert np.abs(np.array(state) - np.array(want[1])).max() <= 1e-4 * scale
    assert_matches_ground_truth(got, args, y_rtol={mx.bfloat16: 1e-2, mx.float16: 2e-3}.get(dtype, 1e-5))
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "state"])
@pytest.mark.parametrize("T", STEPS)
@pytest.mark.parametrize("shape", SHAPES, ids=SHAPE_IDS)
def test_kernel_matches_reference_and_ground_truth(shape, T, with_state, dtype):
    Hk, Hv, Dk, Dv = shape
    args = make_inputs(1, T, Hk, Hv, Dk, Dv, dtype, with_state, seed=T * Hv + Dv)
    run_and_check(args, dtype)


# Several state rows per SIMD group (Apple GPUs' shape for the scan): T = 1,
# 63, 64, 65 tokens, value/key head ratios 1, 2 and 3, with and without a
# state and a padding mask, each dtype; the result is the one-row kernel's
# contract, and the rows' outputs land in their own places.
@pytest.mark.parametrize("rows", [2, 4])
@pytest.mark.parametrize("T,shape,dtype,with_state", [
    (1, (2, 4, 64, 32), mx.bfloat16, True),
    (63, (2, 2, 32, 8), mx.float32, False),
    (64, (1, 3, 64, 12), mx.float16, True),
    (65, (2, 4, 32, 16), mx.bfloat16, True),
])
def test_several_rows_per_simdgroup(rows, T, shape, dtype, with_state):
    Hk, Hv, Dk, Dv = shape
    assert rows_per_simdgroup(Dk, Dv, rows) == rows
    args = make_inputs(1, T, Hk, Hv, Dk, Dv, dtype, with_state, seed=T + rows)
    got = gated_delta_kernel.emulate(*args, rows=rows)
    want = gated_delta_reference(*args)
    assert gated_delta_agree(got, want, *args) is None
    assert_matches_ground_truth(got, args, y_rtol={mx.bfloat16: 1e-2, mx.float16: 2e-3}.get(dtype, 1e-5))
    one_row = gated_delta_kernel.emulate(*args, rows=1)
    scale = float(mx.abs(one_row[1]).max())
    assert float(mx.abs(got[1] - one_row[1]).max()) <= 1e-6 * scale


@pytest.mark.parametrize("rows", [2, 4])
def test_several_rows_per_simdgroup_with_a_padding_mask(rows):
    args = make_inputs(2, 9, 2, 4, 32, 8, mx.bfloat16, True, seed=rows)
    mask = mx.array([[False] * 3 + [True] * 6, [True] * 7 + [False] * 2])
    got_y, got_state = gated_delta_kernel.emulate(*args, mask, rows=rows)
    want_y, want_state = gated_delta_kernel.emulate(*args, mask, rows=1)
    assert float(mx.abs(got_state - want_state).max()) <= 1e-6 * float(mx.abs(want_state).max())
    # Masked steps' outputs are 0 whatever the rows; real ones agree.
    assert mx.array_equal(got_y[0, :3], mx.zeros_like(got_y[0, :3])).item()
    assert float(mx.abs(got_y.astype(mx.float32) - want_y.astype(mx.float32)).max()) <= 1e-2


@pytest.mark.parametrize("Dk,Dv,wanted,rows", [
    (128, 128, 4, 2),  # 128 x 4 / 32 = 16 state entries per lane: over the bound
    (128, 128, 2, 2),
    (64, 32, 4, 4),
    (32, 5, 4, 1),     # Dv odd
    (32, 6, 4, 2),
    (256, 128, 2, 1),  # Dk 256 already holds 8 entries per lane at one row
])
def test_rows_per_simdgroup_fits_the_shape(Dk, Dv, wanted, rows):
    assert rows_per_simdgroup(Dk, Dv, wanted) == rows


@pytest.mark.parametrize("T", [64, 45], ids=["T64", "T45"])
def test_a_longer_call_at_dk_128(T):
    # Two chunks of gates (45: the second one partial); the real head sizes, a
    # few heads to keep the emulator quick.
    args = make_inputs(1, T, 1, 2, 128, 128, mx.bfloat16, True, seed=T)
    run_and_check(args, mx.bfloat16)


def test_real_shape_prefill_chunk_of_64():
    args = make_inputs(1, 64, *REAL, mx.bfloat16, True, seed=64)
    run_and_check(args, mx.bfloat16)


@pytest.mark.parametrize(
    "dtype, gate_dtype, dt_bias_dtype",
    [
        (mx.float16, None, None),
        (mx.bfloat16, mx.float32, None),  # fp32 gates with bf16 activations
        (mx.bfloat16, None, mx.bfloat16),  # a + dt_bias and softplus rounded to bf16
    ],
    ids=["f16", "f32-gates", "bf16-dt_bias"],
)
def test_other_dtypes(dtype, gate_dtype, dt_bias_dtype):
    q, k, v, a, b, A_log, dt_bias, state = make_inputs(
        1, 17, 2, 4, 32, 32, dtype, True, seed=3, gate_dtype=gate_dtype
    )
    if dt_bias_dtype is not None:
        dt_bias, A_log = dt_bias.astype(dt_bias_dtype), A_log.astype(dt_bias_dtype)
    run_and_check((q, k, v, a, b, A_log, dt_bias, state), dtype)


def every_value(dtype, limit=30.0) -> mx.array:
    """Every finite value of a 16-bit dtype with |x| < limit (softplus and
    sigmoid are trivial beyond)."""
    bits = np.arange(2**16, dtype=np.uint32)
    if dtype == mx.bfloat16:
        x = (bits << 16).view(np.float32)
    else:
        x = bits.astype(np.uint16).view(np.float16).astype(np.float32)
    return mx.array(x[np.isfinite(x) & (np.abs(x) < limit)]).astype(dtype)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16], ids=str)
def test_the_gates_are_mlx_s_for_every_16_bit_value(dtype):
    # One single-token row per value x, read back through y = S q with q = e0:
    # with a state of ones and k = 0, y = g(x) (A_log = 0, dt_bias = 0 in the
    # 16-bit dtype, so softplus rounds as MLX's does); with a zero state,
    # k = e0 and v = 1, y = beta(x).
    x = every_value(dtype)
    n = x.size
    gate = x.reshape(n, 1, 1)
    e0 = mx.zeros((n, 1, 1, 32))
    e0[..., 0] = 1.0
    A_log, dt_bias = mx.zeros((1,)), mx.zeros((1,), dtype)
    g, _ = gated_delta_kernel.emulate(
        e0, mx.zeros_like(e0), mx.zeros((n, 1, 1, 1)), gate, gate, A_log, dt_bias, mx.ones_like(e0)
    )
    beta, _ = gated_delta_kernel.emulate(e0, e0, mx.ones((n, 1, 1, 1)), gate, gate, A_log, dt_bias)
    g, beta = np.array(g).reshape(-1), np.array(beta).reshape(-1)
    want_g = np.array(compute_g(A_log, gate, dt_bias)).reshape(-1)
    want_beta = np.array(mx.sigmoid(gate).astype(mx.float32)).reshape(-1)
    # exp's last fp32 bit aside (MLX's CPU exp is a polynomial), g is MLX's: a
    # softplus rounded the other way would be off by ~2**-8 of softplus.
    np.testing.assert_allclose(g, want_g, rtol=1e-5)
    # beta is MLX's to the bit; exp's last bit may tip one exact tie.
    assert (beta != want_beta).sum() <= 1, np.array(x.astype(mx.float32))[beta != want_beta]


def cuda_like_reference(args):
    """(stock's result with sigmoid(b) rounded as MLX's CUDA backend rounds it:
    each step in bfloat16, betas that differ from MLX's CPU sigmoid)."""
    def rounded_bf16(z):
        return np.array(mx.array(np.asarray(z, np.float32)).astype(mx.bfloat16).astype(mx.float32))

    q, k, v, a, b, A_log, dt_bias, state = args
    bx = np.array(b.astype(mx.float32))
    with np.errstate(over="ignore"):
        s = rounded_bf16(1 / rounded_bf16(1 + rounded_bf16(np.exp(np.abs(bx)))))
    beta = np.where(bx < 0, s, rounded_bf16(1 - s))
    flipped = int((beta != np.array(mx.sigmoid(b).astype(mx.float32))).sum())
    want = gated_delta_ops(q, k, v, compute_g(A_log, a, dt_bias), mx.array(beta).astype(mx.bfloat16), state)
    return want, flipped


def test_agree_tolerates_cuda_s_sigmoid_rounding():
    # MLX's CUDA sigmoid rounds each step to bfloat16; stock there may differ
    # from the kernel by one unit of some betas, which agree() must accept.
    flipped = 0
    for seed, (T, Hk, Hv, Dk, Dv) in enumerate([(3, 2, 4, 32, 32), (17, 1, 3, 64, 32), (1, *REAL)]):
        args = make_inputs(1, T, Hk, Hv, Dk, Dv, mx.bfloat16, True, seed=seed)
        cuda_like, n = cuda_like_reference(args)
        flipped += n
        assert gated_delta_agree(gated_delta_kernel.emulate(*args), cuda_like, *args) is None
    assert flipped > 0  # the case this test is about did come up


def test_agree_bounds_y_by_the_gates_dtype_too():
    # Found by fuzzing on the H200: with bfloat16 gates, y moves with CUDA's
    # rounding of beta whatever its own dtype (here 3e-3, thirty times fp32's
    # own bound for y), so y's bound follows the coarser dtype.
    args = make_inputs(1, 30, 2, 6, 64, 16, mx.float32, True, seed=11, gate_dtype=mx.bfloat16)
    assert args[3].dtype == args[4].dtype == mx.bfloat16
    cuda_like, flipped = cuda_like_reference(args)
    assert flipped > 0
    got = gated_delta_kernel.emulate(*args)
    assert gated_delta_agree(got, cuda_like, *args) is None
    # The bounds are still bounds: y or the state off by 5% of its scale fails.
    y, state = got
    assert gated_delta_agree((y * 1.05, state), cuda_like, *args) is not None
    assert gated_delta_agree((y, state * 1.05), cuda_like, *args) is not None


def test_batch_of_two():
    args = make_inputs(2, 5, 2, 4, 32, 16, mx.bfloat16, True, seed=7)
    run_and_check(args, mx.bfloat16)


def padding_mask(real_steps, T: int, left: bool = True) -> mx.array:
    """[B, T] bool as the batch generator's ArraysCache makes it: each row's
    real steps at the end (left padding) or at the start (lengths)."""
    pos = mx.arange(T)[None]
    n = mx.array(real_steps)[:, None]
    return pos >= T - n if left else pos < n


@pytest.mark.parametrize("left", [True, False], ids=["left-padded", "length-limited"])
@pytest.mark.parametrize("T", [1, 3, 17])
@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "state"])
def test_masked_steps_leave_the_state_untouched(left, T, with_state):
    # Three rows padded differently (one wholly padded at T = 1, as a decode
    # step of a finished row would be).
    real = [T, max(T - 2, 0), (T + 1) // 2]
    args = make_inputs(3, T, 2, 4, 32, 16, mx.bfloat16, with_state, seed=20 + T)
    mask = padding_mask(real, T, left)
    assert gated_delta_supports(*args, mask) is None
    y, state = gated_delta_kernel.emulate(*args, mask)
    assert gated_delta_agree((y, state), gated_delta_reference(*args, mask), *args, mask) is None
    assert not mx.where(mask[..., None, None], 0, y).any().item()  # y is 0 at padding
    # Each row's state and real outputs are those of the kernel run on that
    # row's real steps alone, to the bit: a padding step changes nothing.
    q, k, v, a, b, A_log, dt_bias, state0 = args
    for row, n in enumerate(real):
        lo, hi = (T - n, T) if left else (0, n)
        row_state = None if state0 is None else state0[row : row + 1]
        if n == 0:
            want_state = mx.zeros_like(state[:1]) if row_state is None else row_state
            assert mx.array_equal(state[row : row + 1], want_state).item()
            continue
        part = [x[row : row + 1, lo:hi] for x in (q, k, v, a, b)]
        want_y, want_state = gated_delta_kernel.emulate(*part, A_log, dt_bias, row_state)
        assert mx.array_equal(state[row : row + 1], want_state).item()
        assert mx.array_equal(y[row : row + 1, lo:hi], want_y).item()


def test_an_all_real_mask_changes_nothing():
    args = make_inputs(2, 5, 2, 4, 32, 16, mx.bfloat16, True, seed=30)
    plain = gated_delta_kernel.emulate(*args)
    masked = gated_delta_kernel.emulate(*args, mx.ones((2, 5), mx.bool_))
    assert all(mx.array_equal(p, m).item() for p, m in zip(plain, masked))


def test_prefill_then_decode_carries_the_state():
    # A 17-token chunk, then two decode steps, each fed the previous state.
    args = make_inputs(1, 20, 2, 4, 32, 32, mx.float32, False, seed=8)
    q, k, v, a, b, A_log, dt_bias, _ = args
    state = want_state = None
    ys = []
    for lo, hi in [(0, 17), (17, 18), (18, 20)]:
        part = [x[:, lo:hi] for x in (q, k, v, a, b)]
        y, state = gated_delta_kernel.emulate(*part, A_log, dt_bias, state)
        ys.append(y)
    want_y, want_state = gated_delta_reference(*args)
    np.testing.assert_allclose(np.array(mx.concatenate(ys, axis=1)), np.array(want_y), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.array(state), np.array(want_state), rtol=1e-4, atol=1e-6)


def test_doctor_compare_accepts_the_kernel_and_rejects_a_wrong_state():
    args = make_inputs(1, 5, 2, 4, 32, 16, mx.bfloat16, True, seed=9)
    got = gated_delta_kernel.emulate(*args)
    want = gated_delta_reference(*args)
    good, err = gated_delta_compare(got, want)
    assert good and err < 2e-2
    wrong = (got[0], got[1] * 1.1)
    assert not gated_delta_compare(wrong, want)[0]
    assert gated_delta_agree(wrong, want, *args) is not None
    assert gated_delta.compare is gated_delta_compare


def _variant(**changes):
    q, k, v, a, b, A_log, dt_bias, state = make_inputs(1, 2, 2, 4, 32, 8, mx.bfloat16, True)
    args = dict(q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, state=state)
    args.update(changes)
    return args


@pytest.mark.parametrize(
    "changes, why",
    [
        (dict(q=mx.zeros((1, 2, 2, 48)), k=mx.zeros((1, 2, 2, 48))), "Dk=48"),
        (dict(q=mx.zeros((1, 2, 2, 288)), k=mx.zeros((1, 2, 2, 288))), "Dk=288"),
        (dict(state=mx.zeros((1, 4, 8, 32), mx.bfloat16)), "state dtype"),
        (dict(state=mx.zeros((1, 4, 32, 8))), "state"),
        (dict(v=mx.zeros((1, 2, 3, 8), mx.bfloat16)), "Hv=3"),
        (dict(a=mx.zeros((1, 2, 4), mx.int32)), "a dtype"),
        (
            dict(
                q=mx.zeros((1, 0, 2, 32), mx.bfloat16),
                k=mx.zeros((1, 0, 2, 32), mx.bfloat16),
                v=mx.zeros((1, 0, 4, 8), mx.bfloat16),
                a=mx.zeros((1, 0, 4), mx.bfloat16),
                b=mx.zeros((1, 0, 4), mx.bfloat16),
            ),
            "empty",
        ),
        (dict(v=mx.zeros((1, 3, 4, 8), mx.bfloat16)), "v"),
        (dict(A_log=mx.zeros((3,))), "A_log"),
        (dict(mask=mx.ones((1, 3), mx.bool_)), "mask"),
        (dict(mask=mx.ones((1, 2), mx.int32)), "mask"),
    ],
)
def test_supports_says_why_not(changes, why):
    reason = gated_delta_supports(**_variant(**changes))
    assert reason is not None and why in reason, reason


def test_the_op_takes_the_kernel_under_the_emulator_backend(emulator_backend, fresh_notices, capsys):
    assert OPS["gated_delta"] is gated_delta and gated_delta.kernel.sequential is gated_delta_kernel
    assert gated_delta_kernel.reference is gated_delta.reference
    gated_delta.kernel.forget()
    assert gated_delta.planned_path() == ("kernel", "emulator kernel, self-check passed")
    args = make_inputs(1, 3, 2, 4, 32, 32, mx.bfloat16, False, seed=11)
    got = gated_delta(*args)
    assert (gated_delta.last_path, gated_delta.last_reason) == ("kernel", "emulator kernel, self-check passed")
    assert gated_delta_agree(got, gated_delta_reference(*args), *args) is None
    # A call the kernel does not take runs the reference, and says why.
    q, k, v, a, b, A_log, dt_bias, _ = args
    gated_delta(q, k, v, a, b, A_log, dt_bias, mx.zeros((1, 4, 32, 32), mx.bfloat16))
    assert gated_delta.last_path == "reference" and "state dtype" in gated_delta.last_reason
    assert capsys.readouterr().err == ""


def test_the_op_runs_the_reference_when_kernels_are_off(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "reference")
    gated_delta(*make_inputs(1, 2, 2, 4, 32, 32, mx.bfloat16, False))
    assert (gated_delta.last_path, gated_delta.last_reason) == ("reference", f"{BACKEND_ENV}=reference")
