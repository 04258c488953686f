"""Batched decode attention (a ``start`` per row: mlx-lm's left-padded
BatchKVCache) in the CPU emulator: the kernels against float64 attention and
the reference, batch invariance bit for bit, the fallback past MAX_BATCH, and
the CUDA build of the batched instances with nvcc.

Small shapes and a small row form (``FORM``: one block below 16 keys, blocks
of 4 to 8 keys above) reach every form the real constants reach at 1K-32K keys.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import pytest

import mlx_lily.kernels  # noqa: F401  (registers the ops)
from mlx_lily.kernels.attention.decode import MAX_BATCH, RowForm, key_span_mask
from mlx_lily.kernels.attention.testing import batch_decode_inputs, decode_request
from mlx_lily.toolchain import cuda_cache

from test_attention_kernels import assert_units_fit, assert_within_one_bf16_step, attention_exact
from test_toolchain import _mlx_cuda_include, emulator_or_skip

A = sys.modules["mlx_lily.kernels.attention.sdpa"]

FORM = RowForm(split_from=16, min_block=4, max_block=8, split_threadgroups=8)
HQ, HKV, D = 8, 2, 64


def run_batch(args, kwargs, form=FORM):
    return A.run_decode("emulator", *args, **kwargs, row_form=form)


def assert_rows_exact(got, requests):
    """Row b against float64 attention over request b's own keys only."""
    for b, (q, k, v) in enumerate(requests):
        assert_within_one_bf16_step(got[b:b + 1], attention_exact(q, k, v, D**-0.5))


def ragged(rng, B, capacity, per_row_ends):
    """(starts, span lengths) of B rows in a view of ``capacity`` rows: a
    shared end (right-aligned, as BatchKVCache's) or one end per row; spans
    of one key, of the whole view and ragged ones between."""
    if per_row_ends:
        starts = [int(rng.integers(0, capacity - 1)) for _ in range(B)]
        spans = [int(rng.integers(1, capacity - s + 1)) for s in starts]
        starts[0], spans[0] = capacity - 1, 1
        if B > 1:
            starts[1], spans[1] = 0, capacity
    else:
        end = capacity - int(rng.integers(0, 3))
        spans = [int(rng.integers(1, end + 1)) for _ in range(B)]
        spans[0] = 1
        if B > 1:
            spans[1] = end
        starts = [end - n for n in spans]
    return starts, spans


# -- the contract --------------------------------------------------------------------


@pytest.mark.parametrize("B", [1, 2, 5, 16])
@pytest.mark.parametrize("per_row_ends", [False, True])
@pytest.mark.parametrize("capacity", [13, 61])  # below FORM.split_from (one block per row), and split
def test_batched_decode_matches_exact_attention_and_the_reference(B, per_row_ends, capacity):
    emulator_or_skip()
    rng = np.random.default_rng(B * 100 + capacity + per_row_ends)
    starts, spans = ragged(rng, B, capacity, per_row_ends)
    requests = [decode_request(n, HQ, HKV, D, seed=int(rng.integers(1 << 30))) for n in spans]
    args, kwargs = batch_decode_inputs(requests, starts, capacity, per_row_ends=per_row_ends)
    assert A.decode_supports(*args, **kwargs) is None
    got = run_batch(args, kwargs)
    assert got.shape == (B, HQ, 1, D) and got.dtype == mx.bfloat16
    assert_rows_exact(got, requests)
    assert A.attention_agree(got, A.attention_reference(*args, **kwargs)) is None


def test_the_model_s_group_of_eight_at_head_dim_128():
    emulator_or_skip()
    spans, starts = [40, 3, 17], [0, 37, 23]
    requests = [decode_request(n, 16, 2, 128, seed=n) for n in spans]
    args, kwargs = batch_decode_inputs(requests, starts, 40)
    got = run_batch(args, kwargs)
    for b, (q, k, v) in enumerate(requests):
        assert_within_one_bf16_step(got[b:b + 1], attention_exact(q, k, v, 128**-0.5))


def test_fp16_rows():
    emulator_or_skip()
    requests = [decode_request(n, HQ, HKV, D, dtype=mx.float16, seed=n) for n in (30, 5)]
    args, kwargs = batch_decode_inputs(requests, [2, 27], 32)
    got = run_batch(args, kwargs)
    assert got.dtype == mx.float16
    assert A.attention_agree(got, A.attention_reference(*args, **kwargs)) is None


def test_the_reference_masks_what_batch_kv_cache_masks():
    # A decode step on mlx-lm's BatchKVCache: its mask is exactly keys
    # [left_padding, end) of the view it returns.
    from mlx_lm.models.cache import BatchKVCache

    left_padding = [1, 3, 0]
    cache = BatchKVCache(left_padding)
    cache.update_and_fetch(mx.zeros((3, HKV, 5, D)), mx.zeros((3, HKV, 5, D)))
    stock = cache.make_mask(1)
    keys, _ = cache.update_and_fetch(mx.zeros((3, HKV, 1, D)), mx.zeros((3, HKV, 1, D)))
    ours = key_span_mask(keys.shape[2], mx.array([cache._idx], mx.int32), mx.array(left_padding, mx.int32))
    assert mx.array_equal(mx.broadcast_to(stock, ours.shape), ours).item()


# -- batch invariance -------------------------------------------------------------------


# Spans: one key; one block below the split; the split's smallest block; many blocks.
SPANS = (1, 9, 16, 45)


def alone(request):
    """The row by itself: B = 1, start 0, its keys at [0, n) of a view of n rows."""
    n = request[1].shape[2]
    return run_batch(*batch_decode_inputs([request], [0], n))


@pytest.mark.parametrize("B", [2, 5, 16])
@pytest.mark.parametrize("per_row_ends", [False, True])
def test_a_row_s_bits_do_not_depend_on_the_batch(B, per_row_ends):
    emulator_or_skip()
    rng = np.random.default_rng(B + 7 * per_row_ends)
    mine = [decode_request(n, HQ, HKV, D, seed=1000 + n) for n in SPANS]
    want = {n: alone(r) for n, r in zip(SPANS, mine)}
    for capacity in (48, 64) if B < 16 else (56,):
        # Each of the row's spans at a different position, left padding and
        # capacity, among other rows holding other requests.
        for n, request in zip(SPANS, mine):
            where = int(rng.integers(0, B))
            end = capacity - int(rng.integers(0, capacity - 44))
            spans = [int(rng.integers(1, end + 1)) for _ in range(B)]
            spans[where] = n
            starts = [end - s for s in spans]
            if per_row_ends:
                starts = [int(rng.integers(0, capacity - s + 1)) for s in spans]
            requests = [decode_request(s, HQ, HKV, D, seed=int(rng.integers(1 << 30))) for s in spans]
            requests[where] = request
            got = run_batch(*batch_decode_inputs(requests, starts, capacity, per_row_ends=per_row_ends))
            assert mx.array_equal(got[where:where + 1], want[n]).item(), (n, where, starts[where], capacity)


def test_a_row_s_bits_do_not_depend_on_its_start_or_the_capacity():
    # The same keys at start 0 and further in, in views too short to split
    # (one-block launch) and long enough (split launch): the same bits.
    emulator_or_skip()
    for n in SPANS:
        request = decode_request(n, HQ, HKV, D, seed=n)
        want = alone(request)
        for start, capacity in ((0, n + 1), (5, n + 5), (0, 70), (70 - n, 70), (3, 100)):
            got = run_batch(*batch_decode_inputs([request], [start], capacity, per_row_ends=True))
            assert mx.array_equal(got, want).item(), (n, start, capacity)


def test_the_op_keeps_the_bits_with_its_own_constants(emulator_backend, monkeypatch):
    # Through the op with the module's row form (made small): B = 1 alone
    # and inside a batch of 3, the default path of the server's calls.
    emulator_or_skip()
    monkeypatch.setattr(A, "SPLIT_FROM", 16)
    monkeypatch.setattr(A, "MIN_KEY_BLOCK", 4)
    monkeypatch.setattr(A, "KEY_BLOCK", 8)
    monkeypatch.setattr(A, "SPLIT_THREADGROUPS", 8)
    request = decode_request(37, HQ, HKV, D, seed=3)
    args, kwargs = batch_decode_inputs([request], [0], 37)
    assert A.attention.choose(*args, **kwargs)[1] == "kernel"
    want = A.attention(*args, **kwargs)
    assert A.attention.last_path == "kernel"
    others = [decode_request(n, HQ, HKV, D, seed=n) for n in (50, 2)]
    args, kwargs = batch_decode_inputs([others[0], request, others[1]], [0, 13, 48], 50)
    got = A.attention(*args, **kwargs)
    assert A.attention.last_path == "kernel"
    assert mx.array_equal(got[1:2], want).item()
    assert_rows_exact(got, [others[0], request, others[1]])


@pytest.mark.parametrize("capacity", [1, 15, 16, 17, 33, 100, 1000])
@pytest.mark.parametrize("form", [FORM, RowForm(1024, 64, 256, 128)])
def test_the_grid_covers_every_span_up_to_the_capacity(capacity, form):
    for kv_heads in (1, 2, 8):
        most = max(form.blocks(n, kv_heads) for n in range(1, capacity + 1))
        assert form.grid_blocks(capacity, kv_heads) == most
    # The real form at 32K keys: 256-key blocks, as at B = 1.
    assert RowForm(1024, 64, 256, 128).block(32768, 2) == 256 == A.decode_key_block(32768, 2)


# -- what the kernels decline --------------------------------------------------------------


def test_a_batch_past_max_batch_runs_the_reference_and_says_why(emulator_backend):
    requests = [decode_request(1 + b % 5, HQ, HKV, D, seed=b) for b in range(MAX_BATCH + 1)]
    args, kwargs = batch_decode_inputs(requests, [5 - (1 + b % 5) for b in range(MAX_BATCH + 1)], 6)
    why = A.attention_supports(*args, **kwargs)
    assert why == f"batch {MAX_BATCH + 1} (decode kernel: at most {MAX_BATCH} rows)"
    fn, path, reason = A.attention.choose(*args, **kwargs)
    assert path == "reference" and reason == why
    got = A.attention_kernels.run_on("emulator", *args, **kwargs)
    assert mx.array_equal(got, A.attention_reference(*args, **kwargs)).item()


def test_batched_calls_the_decode_kernel_declines(emulator_backend):
    requests = [decode_request(n, HQ, HKV, D, seed=n) for n in (3, 5)]
    args, kwargs = batch_decode_inputs(requests, [2, 0], 5)
    q, k, v, scale, _ = args
    start, length = kwargs["start"], kwargs["length"]
    assert "no mask" in A.attention_supports(q, k, v, scale, "causal", length, start)
    assert "int32 [B]" in A.attention_supports(q, k, v, scale, None, length, start.astype(mx.int64))
    assert "int32 [B]" in A.attention_supports(q, k, v, scale, None, length, start[:1])
    assert "[1] or [B]" in A.attention_supports(q, k, v, scale, None, mx.array([5, 5, 5], mx.int32), start)
    assert "batch 2" in A.attention_supports(q, k, v, scale, None)  # a batch without starts
    assert "decode only" in A.prefill_supports(q, k, v, scale, None, length, start)
    with pytest.raises(ValueError, match="takes no mask"):
        A.attention(q, k, v, scale, "causal", length=length, start=start)
    # A start without a length: each row's keys run to the view's end.
    got = A.attention(q, k, v, scale, None, start=start)
    assert A.attention.last_path == "kernel"
    assert_rows_exact(got, requests)


# -- rows of one view, each at its own length (speculative verification) ----------------------


@pytest.mark.parametrize("capacity", [45, A.SPLIT_FROM + 76])
def test_rows_of_one_view_at_their_own_lengths_are_one_row_calls(emulator_backend, capacity):
    # P positions of one stream attend to one cache view, position i to its
    # first length[i] rows: one launch gives each row the bits of a one-row
    # call bounded at that length (the view's form: single pass or split).
    rng = np.random.default_rng(capacity)
    P = 4
    q = mx.array(rng.standard_normal((P, HQ, 1, D)).astype(np.float32)).astype(mx.bfloat16)
    k = mx.array(rng.standard_normal((1, HKV, capacity, D)).astype(np.float32)).astype(mx.bfloat16)
    v = mx.array(rng.standard_normal((1, HKV, capacity, D)).astype(np.float32)).astype(mx.bfloat16)
    lengths = mx.array([capacity - 9, capacity - 8, capacity - 2, capacity], dtype=mx.int32)
    rows = lambda a: mx.broadcast_to(a, (P, *a.shape[1:]))  # noqa: E731  (no copy)
    assert A.attention_supports(q, rows(k), rows(v), D**-0.5, None, lengths) is None
    got = A.attention(q, rows(k), rows(v), D**-0.5, None, length=lengths)
    assert A.attention.last_path == "kernel"
    for i in range(P):
        alone = A.attention(q[i:i + 1], k, v, D**-0.5, None, length=lengths[i:i + 1])
        assert mx.array_equal(got[i:i + 1], alone).item(), i
        n = int(lengths[i].item())
        assert_within_one_bf16_step(got[i:i + 1], attention_exact(q[i:i + 1], k[:, :, :n], v[:, :, :n], D**-0.5))
    # The reference masks each row at its own length.
    want = A.attention_reference(q, rows(k), rows(v), D**-0.5, None, lengths)
    assert A.attention_agree(got, want) is None
    assert key_span_mask(capacity, lengths).shape == (P, 1, 1, capacity)


def test_rows_of_one_view_need_a_length_per_row(emulator_backend):
    q = mx.zeros((3, HQ, 1, D), mx.bfloat16)
    k = mx.zeros((3, HKV, 8, D), mx.bfloat16)
    assert "[B] for B <=" in A.attention_supports(q, k, k, 0.1, None, mx.array([4, 5], mx.int32))
    assert "no mask" in A.attention_supports(q, k, k, 0.1, "causal", mx.array([4, 5, 6], mx.int32))
    many = mx.zeros((MAX_BATCH + 1, HQ, 1, D), mx.bfloat16)
    kk = mx.zeros((MAX_BATCH + 1, HKV, 8, D), mx.bfloat16)
    assert "[B] for B <=" in A.attention_supports(many, kk, kk, 0.1, None, mx.full((MAX_BATCH + 1,), 4, mx.int32))
    assert "batch 3" in A.attention_supports(q, k[:2], k[:2], 0.1, None, mx.array([4, 5, 6], mx.int32))


def test_a_failed_rows_check_turns_off_only_that_form(emulator_backend, monkeypatch):
    # The rows form has self-checks of its own: if they fail on a machine,
    # decode keeps its kernels, rows calls run the reference, and the
    # verification pass (which asks rows_on) takes one row a call instead.
    kernels = A.attention_kernels
    assert kernels.ready_on("emulator")[0] and kernels.rows_on("emulator")
    ok, paths = kernels._checked["emulator"]
    monkeypatch.setitem(kernels._checked, "emulator", (ok, dict(paths, rows="a stand-in failure")))
    assert kernels.decode_on("emulator") and not kernels.rows_on("emulator")
    q = mx.zeros((3, HQ, 1, D), mx.bfloat16) + 0.5
    k = mx.broadcast_to(mx.ones((1, HKV, 8, D), mx.bfloat16), (3, HKV, 8, D))
    lengths = mx.array([4, 5, 6], mx.int32)
    got = kernels.run_on("emulator", q, k, k, 0.1, None, lengths)
    assert mx.array_equal(got, A.attention_reference(q, k, k, 0.1, None, lengths)).item()


# -- CUDA build ------------------------------------------------------------------------------


def test_the_batched_decode_compiles_with_nvcc_and_fits_its_threadgroups(tmp_path):
    # As the B = 1 instances (tests/test_attention_kernels.py): no stack
    # frame, and a threadgroup's registers within an SM's 64K.
    import shutil

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    include, which = _mlx_cuda_include(tmp_path)
    units, threads = [], {}
    start = mx.zeros((16,), mx.int32)
    for dtype, Hq, Dh, S, ends in ((mx.bfloat16, 16, 256, 64, 1), (mx.bfloat16, 16, 256, 4096, 1),
                                   (mx.bfloat16, 16, 256, 4096, 16), (mx.float16, 16, 256, 4096, 16),
                                   (mx.bfloat16, 8, 128, 4096, 16)):
        q, k = mx.zeros((16, Hq, 1, Dh), dtype), mx.zeros((16, 2, S, Dh), dtype)
        length = mx.full((ends,), S, mx.int32)
        split = S >= A.SPLIT_FROM
        launch = A._launch_decode(q, k, k, 0.1, None, length, split=split, start=start)
        threads["attention_decode_" + cuda_cache.template_suffix(launch.template)] = launch.threadgroup[0]
        units.append(A.attention_decode_kernel.cuda_translation_unit(q, k, k, 0.1, None, length,
                                                                     split=split, start=start))
    # Rows of one view at their own lengths (no start): the one-row form's
    # blocks, a length per row.
    q, k = mx.zeros((4, 16, 1, 256), mx.bfloat16), mx.zeros((4, 2, 4096, 256), mx.bfloat16)
    length = mx.full((4,), 4000, mx.int32)
    launch = A._launch_decode(q, k, k, 0.1, None, length, split=True, key_block=A.decode_key_block(4096, 2))
    threads["attention_decode_" + cuda_cache.template_suffix(launch.template)] = launch.threadgroup[0]
    units.append(A.attention_decode_kernel.cuda_translation_unit(q, k, k, 0.1, None, length, split=True,
                                                                 key_block=A.decode_key_block(4096, 2)))
    assert_units_fit(units, threads, tmp_path / "attention_batch", include, which)
