"""The router top-k kernel, run in the CPU emulator.

Checked against the op's reference (the op's contract: same experts except
among exact ties, same weights within the dtype's tolerance) and against a
numpy ground truth with the kernel's exact ranking (probabilities rounded to
the activation dtype, the higher index first among equal ones, as stock's CPU
argpartition), and against stock's own picks. A broken
copy of the body shows the emulator's error report and the op's fallback.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_lily.kernels import OPS
from mlx_lily.toolchain.registry import BACKEND_ENV, LilyOp
from mlx_lily.kernels.moe.router import (
    MAX_EXPERTS,
    router_compare,
    router_outputs_agree,
    router_topk,
    router_topk_ground_truth,
    router_topk_kernel,
    router_topk_reference,
    router_topk_supports,
)
from mlx_lily.toolchain.kernel import Kernel

try:
    from mlx_lily.emulator import EmulatorError
except ImportError as exc:  # the emulator is built alongside; say so rather than fail
    pytest.skip(f"the CPU emulator is not importable: {exc}", allow_module_level=True)

# Real shapes: Qwen3.5/3.6 MoE routes 8 of 256 experts, for 1 token (decode)
# up to a 2048-token prefill chunk; the small test models use 8 or 16 experts.
REAL = [(1, 256, 8), (7, 256, 8), (2048, 256, 8)]
SMALL = [(5, 8, 2), (5, 16, 4), (3, 8, 8), (4, 40, 3), (2, 64, 1), (3, 1000, 32)]
DTYPES = [mx.bfloat16, mx.float16, mx.float32]
# Probabilities this close (relative) may come out in either order: the
# kernel ranks them rounded to the dtype, and numpy's fp32 exp and sums may
# round one unit apart from the kernel's, which moves a rounded rank by one
# unit of the dtype (bf16: 2**-8 relative, f16: 2**-11; f32: ~1e-6).
NEAR_TIE = {mx.bfloat16: 2.0**-8, mx.float16: 2.0**-11, mx.float32: 1e-6}


def random_logits(rows, experts, dtype, seed=0, lead=()):
    key = mx.random.key(seed)
    return (2 * mx.random.normal((*lead, rows, experts), key=key)).astype(dtype)


def assert_matches_ground_truth(got, logits, k, normalize):
    """Indices equal the ground truth's except between near-tied probabilities."""
    indices, weights = (np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a) for a in got)
    want_idx, want_w, probs = router_topk_ground_truth(logits, k, normalize)
    assert indices.dtype == np.uint32 and indices.shape == want_idx.shape
    probs = probs.reshape(-1, probs.shape[-1])
    indices, want_idx = indices.reshape(-1, k), want_idx.reshape(-1, k)
    rows = np.arange(probs.shape[0])[:, None]
    differ = indices != want_idx
    picked, wanted = probs[rows, indices], probs[rows, want_idx]
    gap = np.abs(picked - wanted)
    bound = NEAR_TIE[logits.dtype] * np.maximum(picked, wanted)
    assert (gap[differ] <= bound[differ]).all(), (indices[differ.any(1)], want_idx[differ.any(1)])
    rtol = {mx.bfloat16: 1e-2, mx.float16: 1e-3, mx.float32: 1e-5}[logits.dtype]
    np.testing.assert_allclose(
        weights.reshape(-1, k), want_w.reshape(-1, k), rtol=rtol, atol=rtol * 1e-2
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, experts, k", REAL + SMALL)
@pytest.mark.parametrize("normalize", [True, False])
def test_kernel_matches_reference_and_ground_truth(rows, experts, k, dtype, normalize):
    logits = random_logits(rows, experts, dtype, seed=rows * experts + k)
    assert router_topk_supports(logits, k, normalize) is None
    got = router_topk_kernel.emulate(logits, k, normalize)
    assert got[0].shape == (rows, k) and got[1].shape == (rows, k)
    assert got[1].dtype == dtype
    assert router_outputs_agree(got, router_topk_reference(logits, k, normalize), logits, k, normalize) is None
    assert_matches_ground_truth(got, logits, k, normalize)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_exact_ties_go_to_the_highest_index(dtype):
    # Few distinct logits: many experts share each probability bit for bit.
    rng = np.random.default_rng(1)
    logits = mx.array(rng.integers(0, 3, size=(9, 64)).astype(np.float32)).astype(dtype)
    logits[0] = mx.zeros((64,), dtype)  # all tied: the k highest experts
    indices, weights = router_topk_kernel.emulate(logits, 8, True)
    want_idx, want_w, _ = router_topk_ground_truth(logits, 8, True)
    np.testing.assert_array_equal(np.array(indices), want_idx)
    np.testing.assert_array_equal(np.array(indices[0]), np.arange(63, 55, -1))
    np.testing.assert_allclose(np.array(weights.astype(mx.float32)), want_w, rtol=1e-2)


def near_tied_logits(rows, experts, dtype, seed):
    """Logits whose softmax has many probabilities one rounding step apart in
    the dtype: a few distinct values plus noise below the dtype's resolution
    of the probabilities, so the ranking is decided by rounding."""
    key1, key2 = mx.random.split(mx.random.key(seed))
    coarse = mx.random.randint(0, 4, (rows, experts), key=key1).astype(mx.float32) * 0.25
    fine = 1e-3 * mx.random.normal((rows, experts), key=key2)
    return (coarse + fine).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows, experts, k", [(512, 256, 8), (256, 8, 2), (256, 16, 4)])
@pytest.mark.parametrize("near_ties", [False, True], ids=["random", "near-ties"])
def test_picks_stocks_experts_and_weights_exactly(rows, experts, k, dtype, near_ties):
    # Stock ranks the softmax rounded to the dtype and keeps the last of equal
    # values (MLX's CPU argpartition); the kernel ranks the same way, so the
    # sets of experts are stock's. The weights are too, but for rare units in
    # the dtype's last place: MLX's CPU exp and the kernel's may differ in the
    # last fp32 bit, which now and then rounds a probability to the
    # neighbouring value of the dtype, and the renormalising sum with it (a
    # row's weights then move by up to two units). In float32 there is no
    # rounding step to absorb that: a few units of fp32 everywhere.
    seed = rows + experts + k
    logits = (near_tied_logits if near_ties else random_logits)(rows, experts, dtype, seed)
    got_idx, got_w = router_topk_kernel.emulate(logits, k, True)
    want_idx, want_w = router_topk_reference(logits, k, True)
    assert mx.array_equal(mx.sort(got_idx, axis=-1), mx.sort(want_idx, axis=-1)).item()
    got_w, want_w = (np.array(mx.sort(w, axis=-1).astype(mx.float32)) for w in (got_w, want_w))
    unit, share = {mx.bfloat16: (2.0**-6, 1e-2), mx.float16: (2.0**-9, 1e-2), mx.float32: (1e-6, 1.0)}[dtype]
    assert (np.abs(got_w - want_w) <= unit * np.abs(want_w)).all()
    assert (got_w != want_w).mean() <= share


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bad", [float("nan"), float("-inf"), float("inf")], ids=str)
def test_non_finite_rows_never_pick_an_expert_out_of_range(dtype, bad):
    experts, k = 64, 8
    logits = random_logits(4, experts, dtype, seed=11)
    logits[0] = mx.full((experts,), bad, dtype)  # the whole row
    logits[1, 5] = mx.array(bad, dtype)  # one expert
    logits[2, ::2] = mx.array(bad, dtype)  # half the row
    indices, weights = router_topk_kernel.emulate(logits, k, True)
    idx = np.array(indices)
    assert ((0 <= idx) & (idx < experts)).all(), idx
    assert all(len(set(r.tolist())) == k for r in idx), idx
    np.testing.assert_array_equal(idx, router_topk_ground_truth(logits, k, True)[0])
    # The finite row is untouched by its neighbours.
    assert_matches_ground_truth((indices[3:], weights[3:]), logits[3:], k, True)


def test_leading_dimensions_as_the_moe_layer_passes_them():
    logits = random_logits(5, 16, mx.bfloat16, seed=4, lead=(1,))
    indices, weights = router_topk_kernel.emulate(logits, 4, True)
    assert indices.shape == (1, 5, 4) and weights.shape == (1, 5, 4)
    assert_matches_ground_truth((indices, weights), logits, 4, True)


def test_results_come_by_descending_probability_and_sum_to_one():
    logits = random_logits(6, 256, mx.float32, seed=5)
    _, weights = router_topk_kernel.emulate(logits, 8, True)
    w = np.array(weights)
    assert (np.diff(w, axis=-1) <= 0).all()
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)


def test_doctor_compare_accepts_the_kernel_and_rejects_a_wrong_pick():
    logits = random_logits(6, 64, mx.bfloat16, seed=10)
    got = router_topk_kernel.emulate(logits, 8, True)
    want = router_topk_reference(logits, 8, True)
    good, err = router_compare(got, want)
    assert good and err < 2e-2
    # Swap each row's top pick for its least probable expert.
    worst = mx.argmin(logits, axis=-1).astype(mx.uint32)
    wrong = mx.concatenate([worst[:, None], got[0][:, 1:]], axis=-1)
    assert not router_compare((wrong, got[1]), want)[0]
    assert router_topk.compare is router_compare


@pytest.mark.parametrize(
    "logits, k, why",
    [
        (mx.zeros((2, MAX_EXPERTS + 32)), 8, "experts"),
        (mx.zeros((2, 8)), 9, "k=9"),
        (mx.zeros((2, 256)), 33, "k=33"),
        (mx.zeros((2, 8)), 0, "k=0"),
        (mx.zeros((2, 8), mx.int32), 2, "dtype"),
        (mx.zeros((0, 8)), 2, "empty"),
    ],
)
def test_supports_says_why_not(logits, k, why):
    reason = router_topk_supports(logits, k, True)
    assert reason is not None and why in reason


def test_the_op_takes_the_kernel_under_the_emulator_backend(emulator_backend, fresh_notices, capsys):
    assert OPS["router_topk"] is router_topk and router_topk.kernel is router_topk_kernel
    assert router_topk_kernel.reference is router_topk.reference
    router_topk_kernel.forget()
    assert router_topk.planned_path() == ("kernel", "emulator kernel, self-check passed")
    logits = random_logits(3, 16, mx.bfloat16, seed=6, lead=(1,))
    got = router_topk(logits, 4, True)
    assert (router_topk.last_path, router_topk.last_reason) == ("kernel", "emulator kernel, self-check passed")
    assert_matches_ground_truth(got, logits, 4, True)
    # A call the kernel does not take runs the reference, and says why.
    wide = random_logits(2, MAX_EXPERTS + 32, mx.bfloat16, seed=7)
    router_topk(wide, 8, True)
    assert router_topk.last_path == "reference" and "experts" in router_topk.last_reason
    assert capsys.readouterr().err == ""


def test_the_op_runs_the_reference_when_kernels_are_off(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "reference")
    logits = random_logits(3, 16, mx.bfloat16, seed=8)
    router_topk(logits, 4, True)
    assert (router_topk.last_path, router_topk.last_reason) == ("reference", f"{BACKEND_ENV}=reference")


# -- a broken kernel: the emulator's report and the op's fallback -------------------

BODY = router_topk_kernel.body_text()
TOPK = "LILY_ROUTER_TOPK(T, E, K, VALS, NORMALIZE, logits, src, "
# Reads one row further than it should: past the end of the buffer on the last row.
PAST_THE_END = BODY.replace(TOPK, TOPK.replace("logits, src,", "logits, src + E,"))
# A barrier only the live rows reach: the tail of the last threadgroup never does.
DIVERGENT_BARRIER = BODY.replace(
    TOPK, "if (live) {\n  threadgroup_barrier(mem_flags::mem_threadgroup);\n}\n" + TOPK
)


def line_of(body: str, text: str) -> int:
    return body[: body.index(text)].count("\n") + 1


def broken_kernel(name: str, body: str) -> Kernel:
    return Kernel(
        name=name,
        input_names=router_topk_kernel.input_names,
        output_names=router_topk_kernel.output_names,
        source=body,
        header=router_topk_kernel.header,
        launch=router_topk_kernel.launch,
        reference=router_topk_kernel.reference,
        sample=router_topk_kernel.sample,
        agree=router_topk_kernel.agree,
    )


def test_the_emulator_reports_a_read_past_the_end():
    assert PAST_THE_END != BODY
    kernel = broken_kernel("router_topk_past_the_end", PAST_THE_END)
    with pytest.raises(EmulatorError) as caught:
        mx.eval(kernel.emulate(random_logits(3, 64, mx.bfloat16), 8, True))
    message = str(caught.value)
    print(message)  # the report, for a human reading the test log (-s)
    assert "router_topk_past_the_end" in message
    assert "thread" in message
    assert str(line_of(PAST_THE_END, "logits, src + E,")) in message


def test_the_emulator_reports_a_barrier_in_a_divergent_branch():
    assert DIVERGENT_BARRIER != BODY
    kernel = broken_kernel("router_topk_divergent_barrier", DIVERGENT_BARRIER)
    # 5 rows in threadgroups of 4: the second threadgroup has 3 rows of tail.
    with pytest.raises(EmulatorError) as caught:
        mx.eval(kernel.emulate(random_logits(5, 64, mx.bfloat16), 8, True))
    message = str(caught.value)
    print(message)
    assert "router_topk_divergent_barrier" in message
    assert "thread" in message
    assert str(line_of(DIVERGENT_BARRIER, "threadgroup_barrier")) in message


def test_a_broken_kernel_falls_back_to_the_reference_with_one_warning(
    emulator_backend, fresh_notices, capsys
):
    kernel = broken_kernel("router_topk_broken", PAST_THE_END)
    op = LilyOp(
        "router_topk_broken_test",
        router_topk_reference,
        kernel=kernel,
        supports=router_topk_supports,
        sample=router_topk_kernel.sample,
    )
    logits = random_logits(4, 64, mx.bfloat16, seed=9)
    want = router_topk_reference(logits, 8, True)
    for _ in range(3):
        got = op(logits, 8, True)
        assert op.last_path == "reference"
        assert "emulator" in op.last_reason
        for g, w in zip(got, want):
            assert mx.array_equal(g, w).item()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("[mlx-lily]")]
    assert len(lines) == 1, err
    assert "kernel router_topk_broken is off on emulator" in lines[0]
    assert op.planned_path()[0] == "reference"
