"""The server's per-token log-prob read off the decode stream (mlx_lily/served_logprobs.py).

mlx_lm.server reads ``r.logprobs[r.token].item()`` for every streamed token.
For a lily model the generator's rows are ``RowLogprobs``: the same values,
read on the CPU stream (so the read does not queue behind the next decode
step on the GPU stream). Stock models' responses are left as they are.
"""

from __future__ import annotations

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


def test_lily_rows_read_on_the_cpu_stream_with_the_same_values(demo_checkpoint, installed, monkeypatch):
    model, _ = mlx_lily.load(str(demo_checkpoint), backend="lily")
    rs = responses(model)
    streams = []
    real_stream = mx.stream

    def spy(where):
        streams.append(where)
        return real_stream(where)

    monkeypatch.setattr(mx, "stream", spy)
    for r in rs:
        assert type(r.logprobs) is sl.RowLogprobs
        plain = mx.array.__getitem__(r.logprobs, slice(None))  # the row as a plain array
        assert type(plain) is mx.array
        before = len(streams)
        value = r.logprobs[r.token].item()
        assert streams[before:] == [mx.cpu]
        assert value == plain[r.token].item()
        ids = [r.token, 0, 3]
        assert r.logprobs[ids].tolist() == plain[mx.array(ids)].tolist()
        # Other indexing and ops behave as on the plain array.
        assert mx.array_equal(r.logprobs[:4], plain[:4]).item()
        assert mx.array_equal(-r.logprobs, -plain).item()
        assert mx.argmax(r.logprobs).item() == mx.argmax(plain).item()


def test_a_failing_cpu_read_falls_back_to_stocks_read_after_one_notice(monkeypatch, fresh_notices, capsys):
    row = sl.RowLogprobs(mx.log(mx.softmax(mx.arange(8, dtype=mx.float32))))
    real_stream = mx.stream

    def broken(where):
        if where == mx.cpu:
            raise RuntimeError("no CPU stream here")
        return real_stream(where)

    monkeypatch.setattr(mx, "stream", broken)
    monkeypatch.setattr(sl, "_cpu_read_failed", False)
    plain = mx.array.__getitem__(row, slice(None))
    assert row[3].item() == plain[3].item() and row[[1, 2]].tolist() == plain[mx.array([1, 2])].tolist()
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and "RuntimeError: no CPU stream here" in said and "decode stream" in said
    assert sl._cpu_read_failed


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
    wrapped = GenerationBatch.next
    sl.uninstall()
    assert GenerationBatch.next is not wrapped and not sl.installed()
    from mlx_lm import server

    assert server.stream_generate is not sl._stream_generate
    sl.install()  # the fixture uninstalls it again
