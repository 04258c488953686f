"""The server's per-token log-prob read off the decode stream (mlx_lily/served_logprobs.py).

mlx_lm.server reads ``r.logprobs[r.token].item()`` for every streamed token.
For a lily model the generator's rows are ``RowLogprobs``: the same values,
read from the evaluated row's memory on the host (so the read queues nothing
behind the next decode step). Stock models' responses are left as they are.
"""

from __future__ import annotations

import time

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator, GenerationBatch

import mlx_lily
from mlx_lily import served_logprobs as sl

PROMPTS = [[5, 9, 13, 2, 7, 11], [3, 8, 1]]


@pytest.fixture
def installed():
    sl.install()
    yield
    sl.uninstall()


def responses(model, steps=4):
    gen = BatchGenerator(model, max_tokens=steps)
    gen.insert(PROMPTS)
    out = []
    while len(out) < steps * len(PROMPTS):
        _, rs = gen.next()
        out += rs
    gen.close()
    return out


def test_lily_rows_read_on_the_host_with_the_same_values(demo_checkpoint, installed):
    model, _ = mlx_lily.load(str(demo_checkpoint), backend="lily")
    rs = responses(model)
    for r in rs:
        assert type(r.logprobs) is sl.RowLogprobs
        plain = mx.array.__getitem__(r.logprobs, slice(None))  # the row as a plain array
        assert type(plain) is mx.array
        value = r.logprobs[r.token]
        assert value.dtype == plain.dtype and value.shape == ()
        assert value.item() == plain[r.token].item()
        ids = [r.token, 0, 3]
        assert r.logprobs[ids].tolist() == plain[mx.array(ids)].tolist()
        # Other indexing and ops behave as on the plain array.
        assert mx.array_equal(r.logprobs[:4], plain[:4]).item()
        assert mx.array_equal(-r.logprobs, -plain).item()
        assert mx.argmax(r.logprobs).item() == mx.argmax(plain).item()
    assert not sl._host_read_failed


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16, mx.float16])
def test_the_host_read_is_exact_in_each_dtype(dtype):
    row = (mx.random.normal((300,), key=mx.random.key(1)) * 9).astype(dtype)
    mx.eval(row)
    wrapped = sl.RowLogprobs(row)
    for i in (0, 17, 299, -1):
        got = wrapped[i]
        assert got.dtype == dtype and got.item() == row[i].item()
    assert wrapped[[5, 0, 5]].tolist() == row[mx.array([5, 0, 5])].tolist()


def _queued_work(x):
    y = x
    for _ in range(12):
        y = (y @ x) * 1e-3
    return y


def test_the_read_does_not_wait_for_work_queued_after_the_row():
    # The server reads a row while the next decode step runs on the same
    # stream. (Wrapping the row as mx.array(row) makes a new node: a read of
    # that queued a copy behind the step and waited for it.)
    rows = list(mx.random.normal((2, 1000), key=mx.random.key(2)))
    x = mx.random.normal((512, 512), key=mx.random.key(3))
    mx.eval(rows, x)
    start = time.perf_counter()
    mx.eval(_queued_work(x))
    alone = time.perf_counter() - start
    wrapped = sl.RowLogprobs(rows[0])
    pending = _queued_work(x)
    mx.async_eval(pending)
    start = time.perf_counter()
    value = wrapped[7].item()
    read = time.perf_counter() - start
    mx.eval(pending)
    assert value == rows[0][7].item()
    assert read < alone / 4, (read, alone)


def test_a_failing_host_read_falls_back_to_stocks_read_after_one_notice(monkeypatch, fresh_notices, capsys):
    row = sl.RowLogprobs(mx.log(mx.softmax(mx.arange(8, dtype=mx.float32))))

    def broken(row, index):
        raise RuntimeError("no buffer here")

    monkeypatch.setattr(sl, "_host_read", broken)
    monkeypatch.setattr(sl, "_host_read_failed", False)
    plain = mx.array.__getitem__(row, slice(None))
    assert row[3].item() == plain[3].item() and row[[1, 2]].tolist() == plain[mx.array([1, 2])].tolist()
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and "RuntimeError: no buffer here" in said and "decode stream" in said
    assert sl._host_read_failed


def test_the_servers_one_request_path_too(demo_checkpoint, installed):
    from mlx_lm import server

    model, tokenizer = mlx_lily.load(str(demo_checkpoint), backend="lily")
    seen = 0
    for response in server.stream_generate(model, tokenizer, PROMPTS[0], max_tokens=3):
        assert type(response.logprobs) is sl.RowLogprobs
        plain = mx.array.__getitem__(response.logprobs, slice(None))
        assert response.logprobs[response.token].item() == plain[response.token].item()
        seen += 1
    assert seen == 3 and server.stream_generate is sl._stream_generate


def test_stock_models_and_uninstall_leave_mlx_lm_as_it_was(demo_checkpoint, installed):
    stock, _ = mlx_lily.load(str(demo_checkpoint), backend="mlx")
    assert all(type(r.logprobs) is mx.array for r in responses(stock, steps=2))
    sl.install()  # idempotent
    wrapped, wrapped_filter = GenerationBatch.next, GenerationBatch.filter
    sl.uninstall()
    assert GenerationBatch.next is not wrapped and GenerationBatch.filter is not wrapped_filter
    assert not sl.installed()
    from mlx_lm import server

    assert server.stream_generate is not sl._stream_generate
    sl.install()  # the fixture uninstalls it again


# -- the sampled tokens' log-probs queued with each step (StepPicks) ----------------------


@pytest.fixture
def picks_on(monkeypatch, installed):
    monkeypatch.setenv(sl.STEP_PICKS_ENV, "1")
    monkeypatch.setattr(sl, "_picks_failed", False)


def _counting_host_reads(monkeypatch):
    calls = []
    real = sl._host_read

    def counted(row, index):
        calls.append(index)
        return real(row, index)

    monkeypatch.setattr(sl, "_host_read", counted)
    return calls


def _check_reads(rs):
    for r in rs:
        plain = mx.array.__getitem__(r.logprobs, slice(None))
        value = r.logprobs[r.token]
        assert value.dtype == plain.dtype and value.shape == ()
        assert value.item() == plain[r.token].item()


def test_with_step_picks_each_token_s_read_comes_from_its_step_s_picks(demo_checkpoint, picks_on, monkeypatch):
    model, _ = mlx_lily.load(str(demo_checkpoint), backend="lily")
    calls = _counting_host_reads(monkeypatch)
    steps = 5
    gen = BatchGenerator(model, max_tokens=steps)
    gen.insert(PROMPTS)
    seen = []
    while len(seen) < steps * len(PROMPTS):
        _, rs = gen.next()
        _check_reads(rs)
        seen += rs
    gen.close()
    # Only each row's first token (made by the prompt batch's step, before any
    # picks) is read from its row; every later one from the step's picks.
    assert len(calls) == len(PROMPTS), calls
    assert all(type(r.logprobs) is sl.RowLogprobs for r in seen)


def test_step_picks_follow_rows_that_leave_and_join(demo_checkpoint, picks_on, monkeypatch):
    model, _ = mlx_lily.load(str(demo_checkpoint), backend="lily")
    calls = _counting_host_reads(monkeypatch)
    gen = BatchGenerator(model)
    gen.insert(PROMPTS, max_tokens=[2, 6])  # the first row leaves after two tokens
    late = None
    got = {}
    for step in range(12):
        _, rs = gen.next()
        _check_reads(rs)
        for r in rs:
            got.setdefault(r.uid, []).append(r.token)
            # Another index than the row's token: the row's own read, exact.
            other = (r.token + 1) % r.logprobs.shape[0]
            assert r.logprobs[other].item() == mx.array.__getitem__(r.logprobs, slice(None))[other].item()
        if step == 3:
            (late,) = gen.insert([[4, 4, 6, 1]], max_tokens=[3])  # a row joins mid-decode
    gen.close()
    assert [len(v) for v in got.values()] == [2, 6, 3] and late in got
    # Each row's first token, and the "other" index of every response, are
    # read from rows; no token's own read is.
    assert len(calls) == 3 + sum(len(v) for v in got.values()), calls


def test_step_picks_go_with_rows_removed_between_steps(demo_checkpoint, picks_on, monkeypatch):
    # A request removed between two steps (a client gone, the server's
    # remove()): the batch drops the picks with its rows, holds none of the
    # removed rows, and every later read is still its row's own value.
    model, _ = mlx_lily.load(str(demo_checkpoint), backend="lily")
    calls = _counting_host_reads(monkeypatch)
    gen = BatchGenerator(model)
    first, second = gen.insert(PROMPTS, max_tokens=[8, 8])
    for _ in range(3):
        _check_reads(gen.next()[1])
    batch = gen._generation_batch
    assert "_lily_picks" in batch.__dict__
    gen.remove([first])
    assert "_lily_picks" not in batch.__dict__
    before = len(calls)
    _, rs = gen.next()
    _check_reads(rs)
    assert [r.uid for r in rs] == [second] and len(calls) == before + 1  # its row, once
    gen.remove([second])  # the batch empties: nothing held
    assert "_lily_picks" not in batch.__dict__
    (third,) = gen.insert([[4, 4, 6, 1]], max_tokens=[3])
    seen = []
    while len(seen) < 3:
        _, rs = gen.next()
        _check_reads(rs)
        seen += rs
    assert {r.uid for r in seen} == {third}
    gen.close()


def test_step_picks_are_exact_in_each_dtype():
    rows = list((mx.random.normal((3, 300), key=mx.random.key(4)) * 9).astype(mx.bfloat16))
    tokens = mx.array([5, 299, 0], dtype=mx.uint32)
    mx.eval(rows, tokens)
    for dtype in (mx.float32, mx.bfloat16, mx.float16):
        cast = [r.astype(dtype) for r in rows]
        mx.eval(cast)
        picks = sl.StepPicks.of_step(cast, tokens)
        for r, t in zip(cast, (5, 299, 0)):
            got = sl.RowLogprobs(r, picks)[t]
            assert got.dtype == dtype and got.item() == r[t].item()
        assert picks.value(cast[0], 6) is None  # not the row's sampled token
        assert picks.value(mx.zeros((300,), dtype=dtype), 5) is None  # not a row of this step


def test_step_picks_refuse_what_does_not_fit():
    rows = [mx.zeros((8,)), mx.zeros((8,))]
    assert sl.StepPicks.of_step(rows, mx.array([1, 2, 3])) is None
    assert sl.StepPicks.of_step([mx.zeros((8,)), mx.zeros((9,))], mx.array([1, 2])) is None
    assert sl.StepPicks.of_step([], mx.array([], dtype=mx.uint32)) is None
    assert sl.StepPicks.of_step(rows, None) is None


def test_a_failing_picks_read_falls_back_to_the_rows_after_one_notice(monkeypatch, fresh_notices, capsys):
    monkeypatch.setattr(sl, "_picks_failed", False)
    rows = list(mx.log(mx.softmax(mx.random.normal((2, 16), key=mx.random.key(5)), axis=-1)))
    tokens = mx.array([3, 9], dtype=mx.uint32)
    mx.eval(rows, tokens)
    picks = sl.StepPicks.of_step(rows, tokens)

    class Broken:
        def tolist(self):
            raise RuntimeError("no picks here")

    picks._values = Broken()
    assert sl.RowLogprobs(rows[1], picks)[9].item() == rows[1][9].item()
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and "RuntimeError: no picks here" in said
    assert not sl._picks_wanted()


def test_step_picks_are_asked_for(demo_checkpoint, installed, monkeypatch):
    monkeypatch.setattr(sl, "_picks_failed", False)
    monkeypatch.delenv(sl.STEP_PICKS_ENV, raising=False)
    assert not sl._picks_wanted()
    model, _ = mlx_lily.load(str(demo_checkpoint), backend="lily")
    gen = BatchGenerator(model, max_tokens=3)
    gen.insert(PROMPTS)
    for _ in range(3):
        gen.next()
        assert "_lily_picks" not in gen._generation_batch.__dict__
    gen.close()
    monkeypatch.setenv(sl.STEP_PICKS_ENV, "1")
    assert sl._picks_wanted()
    monkeypatch.setattr(sl, "_picks_failed", True)  # after a failed read, never again
    assert not sl._picks_wanted()
