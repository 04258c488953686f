"""moe_decode over batches of 1 to MAX_BATCH rows (server decode, speculative
verification), in the CPU emulator.

The kernels against the op's contract at B rows; batch invariance: a row's
output is the same bits alone and inside batches of 2, 5 and 16, at any
position, beside neighbours that pick the same experts or disjoint ones; the
routing launch's outputs; each row's output the same bits as the kernels of
9b603079f6 (three launches, a single-threadgroup union) gave on the same
inputs (tests/data/moe_decode_*.npy, written by this module's ``__main__``
with those kernels); B = 17 falls back to the reference with its reason.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_lily import kernels as K
from mlx_lily.kernels.moe.decode import (
    MAX_BATCH,
    moe_decode_agree,
    moe_decode_kernel,
    moe_decode_reference,
    moe_decode_route_kernel,
    moe_decode_supports,
)
from mlx_lily.kernels.moe.testing import moe_decode_inputs
from mlx_lily.toolchain.registry import BACKEND_ENV

from test_toolchain import emulator_or_skip

# Small shapes: D 128, 16 experts top-3 (so that 16 rows share experts), I 64,
# shared I 128.
D, E, TOP_K, I, IS = 128, 16, 3, 64, 128


def bits(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16))


@pytest.mark.parametrize("rows", [1, 2, 5, 16])
def test_kernels_meet_the_contract_at_each_batch_size(rows):
    emulator_or_skip()
    args, _ = moe_decode_inputs(D, E, TOP_K, I, IS, seed=rows, rows=rows)
    assert moe_decode_supports(*args) is None
    got = moe_decode_kernel.emulate(*args)
    want = moe_decode_reference(*args)
    mx.eval(got, want)
    assert got.shape == want.shape == (rows, 1, D)
    mismatch = moe_decode_agree(got, want, *args)
    assert mismatch is None, mismatch


def _logits_picking(experts, rng) -> np.ndarray:
    """A logits row whose top TOP_K are ``experts`` (clear margins), the rest random below."""
    row = rng.uniform(-3.0, -1.0, E)
    row[list(experts)] = [4.0, 3.0, 2.0][: len(experts)]
    return row


def test_a_row_is_the_same_bits_alone_and_in_any_batch():
    emulator_or_skip()
    rng = np.random.default_rng(7)
    # The row under test picks experts 5, 9, 2. Neighbours: some pick exactly
    # those (in another order), some overlap, some are disjoint.
    subject = _logits_picking([5, 9, 2], rng)
    same = [[9, 2, 5], [2, 5, 9], [5, 9, 2]]
    overlap = [[5, 0, 1], [3, 9, 4], [2, 7, 8]]
    disjoint = [[10, 11, 12], [13, 14, 15], [0, 1, 3], [4, 6, 7], [8, 10, 13]]
    neighbours = [_logits_picking(p, rng) for p in same + overlap + disjoint]
    # Batch of 16: the subject at position 11; the rest random rows.
    while len(neighbours) < MAX_BATCH - 1:
        neighbours.append(2.0 * rng.standard_normal(E))
    logits = np.stack(neighbours[:11] + [subject] + neighbours[11:])
    args, _ = moe_decode_inputs(D, E, TOP_K, I, IS, seed=3, rows=MAX_BATCH, logits=logits)
    h, lg, sl, w, eps, k, normalize, glu, shared = args
    subject_at = 11

    def run(order):
        """The op's kernels on the rows ``order`` of the batch, in that order."""
        idx = mx.array(order)
        return moe_decode_kernel.emulate(h[idx], lg[idx], sl[idx], w, eps, k, normalize, glu, shared)

    alone = run([subject_at])
    mx.eval(alone)
    assert moe_decode_agree(alone, moe_decode_reference(h[subject_at:subject_at + 1], lg[subject_at:subject_at + 1],
                                                        sl[subject_at:subject_at + 1], w, eps, k, normalize, glu,
                                                        shared),
                            h[subject_at:subject_at + 1], lg[subject_at:subject_at + 1],
                            sl[subject_at:subject_at + 1], w, eps, k, normalize, glu, shared) is None
    batches = {
        "2, first, beside the same experts": [subject_at, 0],
        "2, second, beside disjoint experts": [6, subject_at],
        "5, middle, mixed": [3, 8, subject_at, 1, 4],
        "5, last, disjoint only": [6, 7, 8, 9, subject_at],
        "16 in order": list(range(MAX_BATCH)),
        "16, first, reversed": [subject_at] + [i for i in reversed(range(MAX_BATCH)) if i != subject_at],
    }
    for name, order in batches.items():
        got = run(order)
        mx.eval(got)
        position = order.index(subject_at)
        assert np.array_equal(bits(got[position]), bits(alone[0])), name
    # And the other rows of the 16 are each the same as alone too.
    full = run(list(range(MAX_BATCH)))
    for b in (0, 5, 15):
        assert np.array_equal(bits(full[b]), bits(run([b])[0])), b


def test_routing_gives_each_row_its_picks_and_norm():
    emulator_or_skip()
    rng = np.random.default_rng(1)
    picks = [[5, 9, 2], [9, 2, 5], [10, 11, 12], [2, 7, 8]]
    logits = np.stack([_logits_picking(p, rng) for p in picks])
    args, _ = moe_decode_inputs(D, E, TOP_K, I, IS, seed=2, rows=4, logits=logits)
    xn, inds, scores = moe_decode_route_kernel.emulate(*args[:2], *args[3:7])
    assert inds.tolist() == picks
    # Each row's scores are its own row's alone.
    for b in range(4):
        _, alone, alone_scores = moe_decode_route_kernel.emulate(args[0][b:b + 1], args[1][b:b + 1], *args[3:7])
        assert alone.tolist() == [picks[b]]
        assert np.array_equal(bits(alone_scores[0]), bits(scores[b]))
    # xn is rms_norm(h) in h's dtype, row by row.
    h, _, _, w, eps = args[:5]
    assert mx.array_equal(xn, mx.fast.rms_norm(h, w, eps).reshape(4, D)).item()


def test_rows_that_share_every_expert_and_rows_that_share_none():
    """Every entry but the first occurrences does nothing: rows that all pick
    the same experts (in other orders) and rows that pick disjoint ones each
    get their own terms at their own slots."""
    emulator_or_skip()
    rng = np.random.default_rng(4)
    picks = [[5, 9, 2], [9, 2, 5], [2, 5, 9], [0, 1, 3], [4, 6, 7], [5, 9, 2]]
    logits = np.stack([_logits_picking(p, rng) for p in picks])
    args, _ = moe_decode_inputs(D, E, TOP_K, I, IS, seed=5, rows=len(picks), logits=logits)
    got = moe_decode_kernel.emulate(*args)
    mx.eval(got)
    assert moe_decode_agree(got, moe_decode_reference(*args), *args) is None
    h, lg, sl = args[:3]
    for b in range(len(picks)):
        alone = moe_decode_kernel.emulate(h[b:b + 1], lg[b:b + 1], sl[b:b + 1], *args[3:])
        assert np.array_equal(bits(got[b]), bits(alone[0])), b


def test_more_rows_than_max_batch_run_the_reference(monkeypatch):
    emulator_or_skip()
    monkeypatch.setenv(BACKEND_ENV, "emulator")
    rows = MAX_BATCH + 1
    args, _ = moe_decode_inputs(64, 8, 2, 64, 64, seed=4, rows=rows)
    why = moe_decode_supports(*args)
    assert why is not None and f"B={rows}" in why and str(MAX_BATCH) in why
    got = K.moe_decode(*args)
    mx.eval(got)
    assert K.moe_decode.last_path == "reference"
    assert str(rows) in K.moe_decode.last_reason
    assert mx.array_equal(got, moe_decode_reference(*args)).item()
    # Rows that disagree with h's are refused too.
    h, lg, sl = args[:3]
    assert "[B, 1, E]" in moe_decode_supports(h[:2], lg[:3], sl[:2], *args[3:])
    assert "[2, 1, 1]" in moe_decode_supports(h[:2], lg[:2], sl[:3], *args[3:])


# -- the same bits as the three-launch kernels ---------------------------------------

DATA = Path(__file__).parent / "data"
# name -> (D, E, k, I, IS, renormalise, dtype, rows, seed): random calls at B = 1,
# 3 and 16, bf16 and fp16, the experts' or the shared expert's I the larger.
FIXTURES = {
    "b1": (128, 16, 3, 64, 128, True, mx.bfloat16, 1, 101),
    "b3": (192, 40, 8, 128, 64, False, mx.float16, 3, 103),
    "b16": (128, 16, 3, 64, 128, True, mx.bfloat16, 16, 116),
    "b16_k8": (64, 40, 8, 64, 192, False, mx.float16, 16, 117),
}


def fixture_call(name):
    D, E_, k, I_, IS_, normalize, dtype, rows, seed = FIXTURES[name]
    rng = np.random.default_rng(seed)
    logits = 2.0 * rng.standard_normal((rows, E_))
    if rows > 1:  # a row of tied logits across the k-th place, one with -inf
        logits[1] = np.round(logits[1])
        logits[-1][rng.random(E_) < 0.3] = -np.inf
        logits[-1][0] = 1.0
    args, _ = moe_decode_inputs(D, E_, k, I_, IS_, normalize=normalize, rng=rng, logits=logits, dtype=dtype,
                                rows=rows)
    return args


@pytest.mark.parametrize("name", list(FIXTURES))
def test_each_row_is_the_same_bits_as_the_three_launch_kernels_gave(name):
    emulator_or_skip()
    args = fixture_call(name)
    got = moe_decode_kernel.emulate(*args)
    mx.eval(got)
    want = np.load(DATA / f"moe_decode_{name}.npy")
    assert np.array_equal(bits(got), want), name
    assert moe_decode_agree(got, got, *args) is None


@pytest.mark.parametrize("group", [1, 2, 4, 8, 16])
def test_gate_up_gives_the_same_bits_whatever_rows_a_pass_it_takes(group, monkeypatch):
    # GATE_UP_GROUP is a speed choice (registers against passes over an
    # expert's rows): every value gives every row the recorded bits.
    from mlx_lily.kernels.moe import decode

    emulator_or_skip()
    assert decode.GATE_UP_GROUPS == (1, 2, 4, 8, 16)
    monkeypatch.setattr(decode, "GATE_UP_GROUP", group)
    for name in ("b3", "b16", "b16_k8"):
        got = moe_decode_kernel.emulate(*fixture_call(name))
        mx.eval(got)
        assert np.array_equal(bits(got), np.load(DATA / f"moe_decode_{name}.npy")), (group, name)


@pytest.mark.parametrize("setting", [
    {"GATE_UP_SIMD_GROUPS": 4}, {"GATE_UP_SIMD_GROUPS": 16, "GATE_UP_GROUP": 2},
    {"DOWN_SIMD_GROUPS": 4, "DOWN_ROWS_PER_SG": 1}, {"DOWN_SIMD_GROUPS": 16, "DOWN_ROWS_PER_SG": 8},
    {"DOWN_SIMD_GROUPS": 2, "DOWN_ROWS_PER_SG": 2},
    # Hidden rows per SIMD group of gate/up: the routed launch's (b3: three
    # rows, one launch) and the two launches' (b16_k8).
    {"ROUTED_ROWS_PER_SG": 4}, {"GATE_UP_ROWS_PER_SG": 2},
    {"ROUTED_ROWS_PER_SG": 8, "GATE_UP_ROWS_PER_SG": 8, "GATE_UP_SIMD_GROUPS": 4},
    # CUDA's choices by B (CUDA_DOWN_LAUNCH_FOR_BATCH).
    {"DOWN_SIMD_GROUPS": 16, "DOWN_ROWS_PER_SG": 4}, {"DOWN_SIMD_GROUPS": 4, "DOWN_ROWS_PER_SG": 4},
])
def test_the_launch_shapes_give_the_same_bits(setting, monkeypatch):
    # SIMD groups per threadgroup and down's rows per SIMD group are speed
    # choices (moe_decode_sweep): every one gives every row the recorded bits.
    from mlx_lily.kernels.moe import decode

    emulator_or_skip()
    for name, value in setting.items():
        assert value in (decode.GATE_UP_GROUPS if name == "GATE_UP_GROUP" else decode.DOWN_ROWS_CHOICES
                         if name == "DOWN_ROWS_PER_SG" else decode.ROWS_PER_SG_CHOICES
                         if name.endswith("ROWS_PER_SG") else decode.SIMD_GROUP_CHOICES)
        monkeypatch.setattr(decode, name, value)
    monkeypatch.setattr(decode, "ROUTED_MAX_ROWS", 4)  # b3 through the routed launch, b16_k8 the two
    for name in ("b3", "b16_k8"):
        got = moe_decode_kernel.emulate(*fixture_call(name))
        mx.eval(got)
        assert np.array_equal(bits(got), np.load(DATA / f"moe_decode_{name}.npy")), (setting, name)


# Hidden sizes past one step of a SIMD group's loads (1,024 values): gate/up's
# loads run a step ahead across its steps and, with several hidden rows a SIMD
# group, across its turns (the next row's first step during the last step of
# the row before), and a lane past D at the last step of D = 1,088.
@pytest.mark.parametrize("D, rows, settings", [
    (2048, 5, [{}, {"GATE_UP_ROWS_PER_SG": 2}, {"GATE_UP_ROWS_PER_SG": 4, "GATE_UP_GROUP": 2},
               # 128 hidden rows a threadgroup: the experts' 64 end at the fifth turn.
               {"GATE_UP_SIMD_GROUPS": 16, "GATE_UP_ROWS_PER_SG": 8}]),
    (1088, 3, [{}, {"GATE_UP_ROWS_PER_SG": 4},
               {"ROUTED_MAX_ROWS": 4, "ROUTED_ROWS_PER_SG": 2},
               {"ROUTED_MAX_ROWS": 4, "ROUTED_ROWS_PER_SG": 8, "GATE_UP_GROUP": 2}]),
])
def test_gate_up_loads_ahead_across_steps_and_rows_with_the_same_bits(D, rows, settings, monkeypatch):
    from mlx_lily.kernels.moe import decode

    emulator_or_skip()
    args, _ = moe_decode_inputs(D, 16, 4, 64, 128, seed=D + rows, rows=rows)
    results = []
    for setting in settings:
        with monkeypatch.context() as m:
            m.setattr(decode, "ROUTED_MAX_ROWS", 0)  # the two launches unless the setting says
            for name, value in setting.items():
                m.setattr(decode, name, value)
            got = moe_decode_kernel.emulate(*args)
            mx.eval(got)
            results.append(bits(got))
    assert moe_decode_agree(got, moe_decode_reference(*args), *args) is None
    for setting, result in zip(settings[1:], results[1:]):
        assert np.array_equal(result, results[0]), setting


def test_the_routed_launch_takes_cudas_rows_per_simd_group_by_batch(monkeypatch):
    # On CUDA the routed launch (a few rows) takes its hidden rows per SIMD
    # group by B (CUDA_ROUTED_ROWS_FOR_BATCH); the recorded bits either way.
    from mlx_lily.kernels.moe import decode

    emulator_or_skip()
    monkeypatch.setattr(decode, "ROUTED_MAX_ROWS", 4)  # b3 through the routed launch
    assert [decode.routed_rows_per_sg(b, "cuda") for b in (1, 3, 4)] == [1, 1, 2]
    assert [decode.routed_rows_per_sg(b, "metal") for b in (1, 4)] == [decode.ROUTED_ROWS_PER_SG] * 2
    monkeypatch.setattr(decode, "gpu_backend", lambda: "cuda")
    monkeypatch.setattr(decode, "CUDA_ROUTED_ROWS_FOR_BATCH", ((3, 4), (1, 1)))  # b3: three rows, 4 a SIMD group
    got = moe_decode_kernel.emulate(*fixture_call("b3"))
    mx.eval(got)
    assert np.array_equal(bits(got), np.load(DATA / "moe_decode_b3.npy"))
    monkeypatch.setattr(decode, "ROUTED_ROWS_BY_BATCH", False)
    assert decode.routed_rows_per_sg(4, "cuda") == decode.ROUTED_ROWS_PER_SG


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("D, E, k, I, IS, dtype", [
    (192, 24, 3, 64, 128, mx.bfloat16), (128, 13, 1, 64, 192, mx.bfloat16), (64, 40, 8, 64, 64, mx.float16),
])
def test_route_and_gate_up_as_one_launch_give_the_two_launches_bits(rows, D, E, k, I, IS, dtype):
    # For a few rows route and gate/up run as one launch whose threadgroups
    # each redo every row's top-k and norm: the picks, weights and
    # activations are the two launches' bits (rows of NaN logits included).
    from mlx_lily.kernels.moe import decode

    emulator_or_skip()
    assert decode.routes_in_gate_up(1) and not decode.routes_in_gate_up(decode.ROUTED_MAX_ROWS + 1)
    logits = np.random.default_rng(rows).standard_normal((rows, 1, E)) * 3.0
    if rows > 1:
        logits[1, 0, 2] = np.nan  # a row whose softmax is NaN
    args, _ = moe_decode_inputs(D, E, k, I, IS, seed=rows + D, rows=rows, logits=logits, dtype=dtype)
    h, router_logits, _, norm_weight, eps, top_k, normalize, glu, shared = args
    xn, inds, scores = moe_decode_route_kernel.emulate(h, router_logits, norm_weight, eps, top_k, normalize)
    act = decode.moe_decode_gate_up_kernel.emulate(xn, inds, glu, shared)
    act1, inds1, scores1 = decode.moe_decode_route_gate_up_kernel.emulate(
        h, router_logits, norm_weight, eps, top_k, normalize, glu, shared)
    mx.eval(act, act1, inds, inds1, scores, scores1)
    assert np.array_equal(np.array(inds), np.array(inds1))
    assert np.array_equal(bits(scores), bits(scores1))
    # The written part of act (each slot's first I, the shared expert's first IS).
    for j in range(top_k + 1):
        width = IS if j == top_k else I
        assert np.array_equal(bits(act[:, j, :width]), bits(act1[:, j, :width])), j


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("D, E, k, I, IS, dtype, launch", [
    (192, 24, 3, 64, 128, mx.bfloat16, (None, 4)), (128, 13, 1, 64, 192, mx.bfloat16, (None, 1)),
    (64, 40, 8, 64, 64, mx.float16, (4, 16)),  # 4 SIMD groups for 9 slots: each takes two or three
    (192, 24, 3, 128, 64, mx.bfloat16, (2, 28)),  # 28 elements a threadgroup: the last runs past D
])
def test_down_and_combine_as_one_launch_give_the_two_launches_bits(rows, D, E, k, I, IS, dtype, launch,
                                                                    monkeypatch):
    # Row by row, down and the combine as one launch make each term as down
    # does and sum them as the combine does: the two launches' bits, with the
    # residual and without (a tensor-parallel rank's partial sum), rows of
    # NaN logits included, at every launch shape.
    from mlx_lily.kernels.moe import decode

    emulator_or_skip()
    monkeypatch.setattr(decode, "COMBINED_DOWN_SIMD_GROUPS", launch[0])
    monkeypatch.setattr(decode, "COMBINED_DOWN_ROWS", launch[1])
    logits = np.random.default_rng(rows + k).standard_normal((rows, 1, E)) * 3.0
    if rows > 1:
        logits[1, 0, 2] = np.nan  # a row whose softmax is NaN
    args, _ = moe_decode_inputs(D, E, k, I, IS, seed=rows + 7 * D, rows=rows, logits=logits, dtype=dtype)
    h, router_logits, shared_logit, norm_weight, eps, top_k, normalize, glu, shared = args
    xn, inds, scores = moe_decode_route_kernel.emulate(h, router_logits, norm_weight, eps, top_k, normalize)
    act = decode.moe_decode_gate_up_kernel.emulate(xn, inds, glu, shared)
    terms = decode.moe_decode_down_kernel.emulate(act, inds, scores, shared_logit, glu, shared)
    for residual in (True, False):
        want = decode.moe_decode_combine_kernel.emulate(h, terms, residual)
        got = decode.moe_decode_down_combine_kernel.emulate(h, act, inds, scores, shared_logit, glu, shared,
                                                            residual)
        mx.eval(want, got)
        assert got.shape == want.shape == (rows, 1, D)
        assert np.array_equal(bits(got), bits(want)), residual


@pytest.mark.parametrize("setting", [
    {}, {"COMBINED_DOWN_SIMD_GROUPS": 2}, {"COMBINED_DOWN_ROWS": 1}, {"COMBINED_DOWN_ROWS": 16},
])
def test_down_and_combine_as_one_launch_give_every_row_the_recorded_bits(setting, monkeypatch):
    # Taken at every B (the sweep's "combined down"), the one launch gives
    # each fixture's rows the bits the three-launch kernels recorded.
    from mlx_lily.kernels.moe import decode

    emulator_or_skip()
    # One stream's step and a k = 1 verification (the default), not more rows.
    assert decode.combines_in_down(1) and decode.combines_in_down(2) and not decode.combines_in_down(3)
    monkeypatch.setattr(decode, "COMBINED_DOWN_MAX_ROWS", decode.MAX_BATCH)
    assert decode.combines_in_down(1) and decode.combines_in_down(decode.MAX_BATCH)
    for name, value in setting.items():
        assert value in (decode.SIMD_GROUP_CHOICES if name.endswith("SIMD_GROUPS")
                         else decode.COMBINED_DOWN_ROWS_CHOICES)
        monkeypatch.setattr(decode, name, value)
    for name in ("b1", "b3", "b16_k8"):
        got = moe_decode_kernel.emulate(*fixture_call(name))
        mx.eval(got)
        assert np.array_equal(bits(got), np.load(DATA / f"moe_decode_{name}.npy")), (setting, name)


def test_the_combined_down_launch_has_a_simd_group_per_slot_and_refuses_too_many_elements(monkeypatch):
    # Pure host logic: K + 1 SIMD groups by default (at most 32), the grid a
    # threadgroup per COMBINED_DOWN_ROWS elements and row; more elements than
    # SIMD group 0's lanes (which sum them) is refused by name.
    from mlx_lily.kernels.moe import decode

    args, _ = moe_decode_inputs(128, 16, 3, 64, 128, seed=0, rows=2)
    h, _, shared_logit, _, _, k, _, glu, shared = args
    act, inds, scores = mx.zeros((2, k + 1, 128), mx.bfloat16), mx.zeros((2, k), mx.uint32), mx.zeros((2, k), mx.bfloat16)
    launch = decode._launch_down_combine(h, act, inds, scores, shared_logit, glu, shared)
    assert dict(launch.template)["NSG"] == k + 1 and launch.threadgroup == ((k + 1) * 32, 1, 1)
    assert launch.grid == (128 // decode.COMBINED_DOWN_ROWS * (k + 1) * 32, 2, 1)
    monkeypatch.setattr(decode, "COMBINED_DOWN_SIMD_GROUPS", 2)
    assert dict(decode._launch_down_combine(h, act, inds, scores, shared_logit, glu, shared).template)["NSG"] == 2
    monkeypatch.setattr(decode, "COMBINED_DOWN_ROWS", 33)
    with pytest.raises(ValueError, match="COMBINED_DOWN_ROWS = 33"):
        decode._launch_down_combine(h, act, inds, scores, shared_logit, glu, shared)


def test_down_launch_on_cuda_follows_the_rows_and_each_choice_is_a_tested_one(monkeypatch):
    # Pure host logic: the launch down gets for B rows on CUDA, elsewhere and
    # with the by-B choice off (the sweep's fixed choices).
    from mlx_lily.kernels.moe import decode

    table = decode.CUDA_DOWN_LAUNCH_FOR_BATCH
    assert [at for at, _, _ in table] == sorted((at for at, _, _ in table), reverse=True) and table[-1][0] == 1
    tested = {(16, 4), (4, 4), (8, 4)}  # test_the_launch_shapes_give_the_same_bits and the default
    assert {(nsg, rows) for _, nsg, rows in table} <= tested
    assert [decode.down_launch(b, "cuda") for b in (1, 2, 3, 7, 8, 16)] == [(16, 4)] * 2 + [(8, 4)] * 2 + [(4, 4)] * 2
    default = (decode.DOWN_SIMD_GROUPS, decode.DOWN_ROWS_PER_SG)
    assert decode.down_launch(16, "metal") == default and decode.down_launch(1, None) == default
    monkeypatch.setattr(decode, "DOWN_BY_BATCH", False)
    assert decode.down_launch(16, "cuda") == default
    monkeypatch.setattr(decode, "DOWN_BY_BATCH", True)
    # The launch itself: 16 rows on CUDA, 4 SIMD groups of 4 rows a threadgroup.
    monkeypatch.setattr(decode, "gpu_backend", lambda: "cuda")
    args, _ = moe_decode_inputs(128, 16, 3, 64, 128, seed=0, rows=16)
    *_, glu, shared = args
    B, k, D = 16, 3, 128
    act = mx.zeros((B, k + 1, 128), dtype=mx.bfloat16)
    inds = mx.zeros((B, k), dtype=mx.uint32)
    launch = decode._launch_down(act, inds, mx.zeros((B, k), dtype=mx.bfloat16), mx.zeros((B, 1), dtype=mx.bfloat16),
                                 glu, shared)
    template = dict(launch.template)
    assert (template["NSG"], template["ROWS"]) == (4, 4)
    assert launch.threadgroup[0] == 4 * 32 and launch.grid[0] == -(-D // 16) * 4 * 32


if __name__ == "__main__":  # writes the fixtures, with the kernels of the checkout it runs in
    for fixture in FIXTURES:
        out = moe_decode_kernel.emulate(*fixture_call(fixture))
        mx.eval(out)
        np.save(DATA / f"moe_decode_{fixture}.npy", bits(out))
        print(fixture, bits(out).shape)
