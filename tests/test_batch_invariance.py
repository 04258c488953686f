"""The server's decode batches (mlx_lily/layers/batch_step.py, prompt_rows.py,
language_model.py): a request's logits are the same bits alone or in any
batch of up to 16 rows, wherever it sits, whoever joins or leaves.

Through mlx-lm's own ``BatchGenerator`` (what ``mlx_lm.server`` runs), with
every kernel on in the CPU emulator. The emulator cannot run kernels inside
``mx.compile``'s trace, so the batched step runs as plain ops here (what it
does with compilation off): the same ops in the same order.
Compared: each decode step's log-probabilities over the whole vocabulary,
bit for bit, not only the greedy tokens.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator

import mlx_lily
from mlx_lily import call_trace
from mlx_lily.layers.batch_step import MAX_BATCH
from mlx_lily.toolchain.registry import BACKEND_ENV

# Prompts of different lengths (one token: no prompt step at all).
PROMPTS = [[(37 * i + 11 * j) % 500 + 1 for j in range(1 + (5 * i) % 13)] for i in range(MAX_BATCH + 1)]
BATCHED = "lily batched decode step"


@pytest.fixture
def lily(demo_checkpoint, emulator_backend):
    model, _ = mlx_lily.load(str(demo_checkpoint), backend="lily")
    return model


def generate(model, schedule, max_tokens, prompts=PROMPTS):
    """Per request: [(token, log-probabilities as fp32 numpy)] for each
    decode step. ``schedule``: {step: [prompt indices inserted then]}."""
    gen = BatchGenerator(model, completion_batch_size=32, prefill_batch_size=32)
    uid_of, out, step, done = {}, {}, 0, 0
    requests = sum(len(v) for v in schedule.values())
    try:
        while done < requests:
            for i in schedule.get(step, []):
                (uid,) = gen.insert([prompts[i]], max_tokens=[max_tokens[i]])
                uid_of[uid] = i
                out[i] = []
            _, responses = gen.next()
            for r in responses:
                out[uid_of[r.uid]].append((r.token, np.array(r.logprobs.astype(mx.float32))))
                done += r.finish_reason is not None
            step += 1
            assert step < 200, "the generator stopped answering"
    finally:
        gen.close()
    return out


def alone(model, index, max_tokens, prompts=PROMPTS):
    return generate(model, {0: [index]}, {index: max_tokens}, prompts)[index]


def assert_same(got, want, what):
    assert len(got) == len(want), what
    for t, ((tg, lg), (tw, lw)) in enumerate(zip(got, want)):
        assert tg == tw and np.array_equal(lg, lw), f"{what}: step {t} differs"


def count_attended_rows(monkeypatch) -> list:
    """How many rows each packed call's attention ran as one batch, one entry
    per attention layer call (LilyAttention._attend_rows)."""
    from mlx_lily.layers import LilyAttention

    attended = []
    real_rows = LilyAttention._attend_rows

    def attend_rows(self, *args):
        done = real_rows(self, *args)
        attended.append(len(done[0]))
        return done

    monkeypatch.setattr(LilyAttention, "_attend_rows", attend_rows)
    return attended


@pytest.mark.parametrize("rows", [2, 5, MAX_BATCH])
def test_a_request_decodes_the_same_bits_alone_and_in_a_batch(lily, rows):
    steps = 3
    call_trace.start()
    try:
        together = generate(lily, {0: list(range(rows))}, {i: steps for i in range(rows)})
        batched = {r["batch"] for r in call_trace.seen() if r["path"] == BATCHED}
    finally:
        call_trace.stop()
    assert rows in batched, batched
    # Alone: the first, a middle and the last row of the batch.
    for i in sorted({0, rows // 2, rows - 1}):
        assert_same(together[i], alone(lily, i, steps), f"row {i} of {rows}")


def test_prompts_prefilled_packed_keep_each_row_s_bits(lily, monkeypatch):
    # Prompts of 8 tokens and more arriving together share their prefill
    # call's token-wise work (prompt_rows.packed_call: the MoE of all rows'
    # tokens at once); shorter ones run alone. Each row's log-probabilities
    # stay those of its prompt alone, bit for bit, kernels on.
    from mlx_lily.layers import prompt_rows

    prompts = [[(13 * i + 7 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((9, 23, 4, 12, 40))]
    packed = []
    real = prompt_rows.packed_call

    def spy(model, ids, caches):
        packed.append([i.shape[1] for i in ids])
        return real(model, ids, caches)

    monkeypatch.setattr(prompt_rows, "packed_call", spy)
    # The mixers' token-wise ends (projections in, gate and projection out)
    # see every packed row's tokens in one call.
    from mlx_lily.layers import LilyAttention, LilyGatedDeltaNet

    widths = []
    for cls, name in ((LilyGatedDeltaNet, "_project"), (LilyAttention, "_output")):
        def seen(self, x, *rest, _real=getattr(cls, name)):
            widths.append(x.shape[1])
            return _real(self, x, *rest)
        monkeypatch.setattr(cls, name, seen)
    # The rows' attention: batched where one row and the batch take one path.
    attended = count_attended_rows(monkeypatch)
    steps = 3
    together = generate(lily, {0: list(range(len(prompts)))}, {i: steps for i in range(len(prompts))}, prompts)
    # The generator holds each prompt's last token back for its first step.
    assert packed == [[8, 22, 11, 39]], packed
    layers = len(lily.layers)
    assert widths.count(8 + 22 + 11 + 39) == layers and not {8, 22, 39} & set(widths), widths
    # Lily's prefill attention kernel takes one row a call: the rows'
    # attention runs alone, each on the kernel (a batch would take the
    # reference, other bits).
    attention_layers = sum(1 for layer in lily.layers if not layer.is_linear)
    assert attended == [0] * attention_layers, attended
    packed.clear()
    for i in range(len(prompts)):
        assert_same(together[i], alone(lily, i, steps, prompts), f"row {i}")
    assert not packed  # a request alone has nothing to share its call with


def count_whole_writes(monkeypatch) -> list:
    """(cache kind, taken whole) for each batch cache a prompt chunk's rows
    were written back into (prompt_rows.batched_entries: the batched call's
    arrays as they are, not the rows joined again)."""
    from mlx_lily.layers import prompt_rows

    writes = []
    real = prompt_rows.batched_entries

    def spy(rows):
        whole = real(rows)
        kind = next(type(r).__name__ for r in rows if r is not None)
        writes.append((kind, whole is not None))
        return whole

    monkeypatch.setattr(prompt_rows, "batched_entries", spy)
    return writes


@pytest.mark.parametrize("lengths", [(9, 33, 4, 12, 70), (9, 33, 14, 12, 70)])
def test_prompts_packed_on_the_references_attend_as_one_batch_and_keep_each_row_s_bits(demo_checkpoint,
                                                                                       monkeypatch, lengths):
    # Where attention runs its reference for one row and for many (MLX's
    # sdpa: on CUDA from 64 queries, and everywhere without kernels), fresh
    # rows packed together attend as one right-padded causal batch. Each
    # row's log-probabilities stay those of its prompt alone, bit for bit.
    # Where every row attends in that batch, the batch's KV caches take its
    # keys and values whole.
    from mlx_lily.toolchain.registry import BACKEND_ENV

    monkeypatch.setenv(BACKEND_ENV, "reference")
    model, _ = mlx_lily.load(str(demo_checkpoint), backend="lily")
    prompts = [[(11 * i + 5 * j) % 500 + 1 for j in range(n)] for i, n in enumerate(lengths)]
    attended = count_attended_rows(monkeypatch)
    writes = count_whole_writes(monkeypatch)
    steps = 3
    together = generate(model, {0: list(range(len(prompts)))}, {i: steps for i in range(len(prompts))}, prompts)
    attention_layers = sum(1 for layer in model.layers if not layer.is_linear)
    packed = sum(1 for n in lengths if n - 1 >= 8)  # the generator holds each prompt's last token back
    assert attended == [packed] * attention_layers, attended  # the rows of 8 tokens and more
    whole = packed == len(lengths)
    assert [w for k, w in writes if k == "BatchKVCache"] == [whole] * attention_layers, writes
    for i in range(len(prompts)):
        assert_same(together[i], alone(model, i, steps, prompts), f"row {i}")


@pytest.mark.parametrize("short", [True, False])
def test_long_prompts_packed_run_their_recurrences_together_and_keep_each_row_s_bits(tmp_path_factory,
                                                                                     emulator_backend, monkeypatch,
                                                                                     short):
    # Prompts of CHUNKED_FROM tokens and more arriving together: their
    # DeltaNet recurrences run as one right-padded batch on the chunked
    # passes (gated_delta_rows), each row read to its own length. Each row's
    # log-probabilities stay those of its prompt alone, bit for bit; a
    # shorter row (the sequential scan alone) runs on its own. Where every
    # row runs in that batch, the batch's DeltaNet caches take its states
    # whole.
    from mlx_lily import kernels as K
    from mlx_lily.kernels.gated_delta.recurrence import CHUNKED_FROM
    from mlx_lily.random_checkpoints import make_checkpoint

    path = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "dk64",
                           shape={"linear_key_head_dim": 64, "linear_value_head_dim": 64})
    model, _ = mlx_lily.load(str(path), backend="lily")
    lengths = (CHUNKED_FROM + 6, 2 * CHUNKED_FROM + 1, 20 if short else CHUNKED_FROM + 9, CHUNKED_FROM + 1,
               3 * CHUNKED_FROM)
    writes = count_whole_writes(monkeypatch)
    prompts = [[(13 * i + 7 * j) % 500 + 1 for j in range(n)] for i, n in enumerate(lengths)]
    batches = []
    op = K.gated_delta_rows

    def spy(q, *rest, **kwargs):
        batches.append((q.shape[0], rest[-1]))
        return op(q, *rest, **kwargs)

    monkeypatch.setattr(K, "gated_delta_rows", spy)
    steps = 2
    together = generate(model, {0: list(range(len(prompts)))}, {i: steps for i in range(len(prompts))}, prompts)
    linear = sum(1 for layer in model.layers if layer.is_linear)
    # The generator holds each prompt's last token back: the rows of 64 tokens
    # and more, longest first, in each DeltaNet layer.
    want = tuple(sorted((n - 1 for n in lengths if n - 1 >= CHUNKED_FROM), reverse=True))
    assert batches == [(len(want), want)] * linear, batches
    assert op.last_path == "kernel", op.last_reason
    assert [w for k, w in writes if k == "ArraysCache"] == [not short] * linear, writes
    batches.clear()
    for i in range(len(prompts)):
        assert_same(together[i], alone(model, i, steps, prompts), f"row {i}")
    assert not batches  # a request alone has nothing to share its call with


def test_a_paced_packed_call_waits_for_each_layer_s_input_and_keeps_the_bits(demo_checkpoint, monkeypatch):
    # On a GPU a long prefill call is paced (decoder.pace_prefill): each
    # layer's output is queued and the host waits for the layer's input, the
    # layer before's output, so the whole layer runs while the host builds
    # the next. A packed call paces the same way (waiting for a layer's own
    # mixer left only its MoE to run through that build) and computes the
    # same bits as unpaced.
    from mlx_lily.layers import decoder, prompt_rows

    monkeypatch.setenv(BACKEND_ENV, "reference")
    model, _ = mlx_lily.load(str(demo_checkpoint), backend="lily")
    prompts = [[(13 * i + 7 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((120, 101, 90))]
    assert sum(len(p) - 1 for p in prompts) >= decoder.PACE_MIN_ROWS
    schedule, steps = {0: [0, 1, 2]}, {0: 2, 1: 2, 2: 2}
    packed = []
    real_call = prompt_rows.packed_call
    monkeypatch.setattr(prompt_rows, "packed_call", lambda *a: packed.append(1) or real_call(*a))
    unpaced = generate(model, schedule, steps, prompts)
    assert packed == [1]
    monkeypatch.setattr(decoder, "_queues_on_device", lambda: True)
    waits = []
    real_pace = decoder.pace_prefill

    def pace(x, out):
        waits.append((x, out))
        real_pace(x, out)

    monkeypatch.setattr(decoder, "pace_prefill", pace)
    paced = generate(model, schedule, steps, prompts)
    assert len(waits) == len(model.layers)
    # The first layer's input: the rows' embeddings, packed (each prompt's
    # last token held back by the generator).
    assert waits[0][0].shape[:2] == (1, sum(len(p) - 1 for p in prompts))
    assert all(x is before for (x, _), (_, before) in zip(waits[1:], waits)), "a wait on other than the layer's input"
    for i in range(len(prompts)):
        assert_same(paced[i], unpaced[i], f"row {i}")


def test_rows_joining_and_leaving_keep_their_bits(lily):
    # Requests arrive while others decode and finish at different steps; the
    # batch is extended and filtered under them (its KV rows re-padded).
    schedule = {0: [3], 2: [7, 1], 4: [12]}
    max_tokens = {3: 7, 7: 3, 1: 6, 12: 4}
    got = generate(lily, schedule, max_tokens)
    for i, n in max_tokens.items():
        assert_same(got[i], alone(lily, i, n), f"request {i}")


def test_a_batch_over_the_kernels_rows_runs_unfused_with_one_notice(lily, fresh_notices, capfd):
    rows = MAX_BATCH + 1
    call_trace.start()
    try:
        got = generate(lily, {0: list(range(rows))}, {i: 2 for i in range(rows)})
        paths = {(r["batch"], r["path"]) for r in call_trace.seen() if r["step"] == "decode"}
    finally:
        call_trace.stop()
    assert all(len(v) == 2 for v in got.values())
    assert (rows, BATCHED) not in paths and any(b == rows for b, _ in paths)
    err = capfd.readouterr().err
    assert err.count(f"a decode batch of {rows} rows") == 1



def test_the_batched_step_skips_the_one_row_forms_checks(demo_checkpoint, monkeypatch):
    """On the server's caches the batched step takes each decode token; the
    one-row forms' per-layer checks (40 calls a token at the real depth) and
    the attention mask (the step reads the left padding in place) are not
    made unless it declines. Kernels as on CUDA, stubbed (the compiled steps
    run; bench.diagnostics.decode.host_cost)."""
    from bench.diagnostics.decode.host_cost import stubbed_kernels
    from mlx_lily.layers import text_model
    from mlx_lily.layers.decoder import LilyDecoderLayer
    from mlx_lily.layers.text_model import _OneToken
    from mlx_lily.warmup import prompt_cache

    calls, masks_built = [], []
    base = LilyDecoderLayer._takes_decode
    build_mask = text_model.create_attention_mask
    monkeypatch.setattr(text_model, "create_attention_mask", lambda *a, **k: masks_built.append(1) or build_mask(*a, **k))

    def counted(self, x, *rest):
        if isinstance(x, _OneToken):  # the model's one-row check (a layer's own call passes its input)
            calls.append(x.shape[0])
        return base(self, x, *rest)

    monkeypatch.setattr(LilyDecoderLayer, "_takes_decode", counted)
    model, _ = mlx_lily.load(str(demo_checkpoint), backend="lily")
    prompt = mx.array([PROMPTS[3]])
    with stubbed_kernels():
        for server, path in ((True, BATCHED), (False, "lily whole decode step")):
            cache = prompt_cache(model, server)
            mx.eval(model(prompt, cache=cache))
            calls.clear()
            masks_built.clear()
            call_trace.start()
            try:
                for _ in range(3):
                    mx.eval(model(mx.array([[5]]), cache=cache))
                paths = {r["path"] for r in call_trace.seen()}
            finally:
                call_trace.stop()
            assert paths == {path}
            # generate's caches: the one-row forms are checked, one call per layer and token.
            assert calls == ([] if server else [1] * 3 * len(model.layers)), (server, calls)
            assert len(masks_built) == (0 if server else 3), (server, masks_built)
