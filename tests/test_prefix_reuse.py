"""Prompt-prefix reuse with Gated DeltaNet checkpoints (mlx_lily/prefix_reuse.py).

Each request runs as mlx_lm.server's batched path runs it: the prompt cache's
``fetch_nearest_cache``, mlx-lm's ``BatchGenerator`` (its prefill chunks and
prompt segments), ``insert_cache`` of the finished request. Every reuse is
checked against a cold prefill of the whole prompt (a fresh cache, the same
generator settings): the first token's log-probabilities and every layer's
cache afterwards, bit for bit.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import ArraysCache, KVCache, LRUPromptCache

import mlx_lily
from mlx_lily import prefix_files as pf
from mlx_lily import prefix_reuse as pr
from mlx_lily.errors import LilyError
from mlx_lily.toolchain.registry import BACKEND_ENV

KEY = ("demo", None, None)


@pytest.fixture(scope="module")
def lily(demo_checkpoint):
    model, _ = mlx_lily.load(str(demo_checkpoint), backend="lily")
    return model


@pytest.fixture(scope="module")
def chunked_lily(tmp_path_factory):
    """A model whose DeltaNet heads the chunked kernels take (head dims of 64;
    the demo's 32 keep every call on the sequential scan)."""
    from mlx_lily.random_checkpoints import make_checkpoint

    path = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "dk64",
                           shape={"linear_key_head_dim": 64, "linear_value_head_dim": 64})
    model, _ = mlx_lily.load(str(path), backend="lily")
    return model


def chunked_passes_ran() -> bool:
    import gc

    from mlx_lily.toolchain.kernel import Kernel

    return any(k.name == "gated_delta_chunk_state" and k.launched for k in gc.get_objects() if isinstance(k, Kernel))


@pytest.fixture
def installed(monkeypatch):
    monkeypatch.delenv(pr.POLICY_ENV, raising=False)
    monkeypatch.delenv(pr.BUDGET_ENV, raising=False)
    pr.install()
    yield
    pr.uninstall()


@pytest.fixture
def reference_backend(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "reference")


def serve(model, lru, requests, step, segments=None):
    """Requests (token lists) through one BatchGenerator, all inserted at
    once as the server inserts them (fetch, strip the reused tokens off the
    segments, insert_segments); each finished request's cache goes back into
    ``lru``. Returns per request (tokens reused, first token's log-probs,
    the finished cache). ``lru`` None: cold, fresh caches."""
    gen = BatchGenerator(model, prefill_step_size=step)
    uids = {}
    for i, tokens in enumerate(requests):
        segs = [list(s) for s in (segments[i] if segments else [tokens])]
        if lru is not None:  # what the server's _tokenize notes (prefix_reuse.install)
            lru.__dict__["_lily_segments"] = (tokens, [len(s) for s in segs])
        cache, rest = (None, tokens) if lru is None else lru.fetch_nearest_cache(KEY, tokens)
        n = len(tokens) - len(rest)
        while n > 0:  # as mlx_lm.server strips the cached tokens off the segments
            if n >= len(segs[0]):
                n -= len(segs.pop(0))
            else:
                segs[0] = segs[0][n:]
                n = 0
        (uid,) = gen.insert_segments(segments=[segs], max_tokens=[2], caches=[cache],
                                     all_tokens=[tokens[: len(tokens) - len(rest)]])
        uids[uid] = [i, len(tokens) - len(rest), None, None]
    done = 0
    while done < len(requests):
        _, responses = gen.next()
        for r in responses:
            slot = uids[r.uid]
            if slot[2] is None:
                slot[2] = r.logprobs
            if r.finish_reason is not None:
                slot[3] = r.prompt_cache
                if lru is not None:
                    lru.insert_cache(KEY, r.all_tokens[:], r.prompt_cache)
                done += 1
    out = [None] * len(requests)
    for i, reused, logprobs, cache in uids.values():
        out[i] = (reused, logprobs, cache)
    return out


def reused_and_cold(model, lru, prompt, step, segments=None):
    """``prompt`` served from ``lru`` (reusing what it can), then cold: (got, cold) as ``serve`` gives them."""
    (got,) = serve(model, lru, [prompt], step, segments=segments)
    (cold,) = serve(model, None, [prompt], step, segments=segments)
    return got, cold


def cache_arrays(cache):
    arrays = []
    for c in cache:
        if type(c) is KVCache:
            arrays += [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
        else:
            arrays += list(c.cache)
    return arrays


def assert_same_bits(got, cold):
    """First-token log-probs and every cache array, bit for bit."""
    _, lp, cache = got
    _, lp_cold, cache_cold = cold
    assert lp.dtype == lp_cold.dtype and mx.array_equal(lp, lp_cold).item()
    for a, b in zip(cache_arrays(cache), cache_arrays(cache_cold), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert mx.array_equal(a, b).item()


def test_cold_cuts_are_the_batch_generator_s_chunk_ends(lily, reference_backend, monkeypatch):
    # Spy on the chunks mlx-lm's generator prefills for a segmented prompt.
    from mlx_lm.generate import PromptProcessingBatch

    seen = []
    stock_prompt = PromptProcessingBatch.prompt

    def spy(self, tokens):
        stock_prompt(self, tokens)
        if tokens:
            seen.append(len(self.tokens[0]))

    monkeypatch.setattr(PromptProcessingBatch, "prompt", spy)
    rng = random.Random(3)
    tokens = [rng.randrange(1, 500) for _ in range(47)]
    segments = [tokens[:9], tokens[9:44], tokens[44:]]
    serve(lily, None, [tokens], step=8, segments=[segments])
    assert seen == pr.cold_cuts(47, [9, 35, 3], 8)
    assert seen == [8, 9, 17, 25, 33, 41, 44, 46]


def test_reuse_at_random_divergence_points_equals_cold_prefill(lily, reference_backend, installed):
    rng = random.Random(0)
    step = 16
    lru = LRUPromptCache(max_size=10)
    history = [rng.randrange(1, 500) for _ in range(90)]
    (_, _, _), = serve(lily, lru, [history], step)
    points = sorted(rng.sample(range(0, 95), 6)) + [0]
    for d in points:
        prompt = history[:d] + [rng.randrange(1, 500) for _ in range(rng.randrange(2, 30))]
        got, cold = reused_and_cold(lily, lru, prompt, step)
        assert_same_bits(got, cold)
        # The last checkpoint at or before the divergence on the cold grid
        # (chunk ends every 16 tokens; the first prompt also cut at its end).
        expected = max([p for p in pr.cold_cuts(len(prompt), None, step) if p <= min(d, len(prompt) - 1)
                        and p % step == 0], default=0)
        assert got[0] >= expected
        history = history if d < 60 else prompt  # also resume from a resumed request's entry


def test_reuse_on_the_emulated_kernels_equals_cold_prefill(chunked_lily, installed, emulator_backend):
    # Calls of 64 tokens and more take the chunked DeltaNet kernels.
    rng = random.Random(1)
    step = 192
    lru = LRUPromptCache(max_size=4)
    history = [rng.randrange(1, 500) for _ in range(260)]
    serve(chunked_lily, lru, [history], step)
    prompt = history[:230] + [rng.randrange(1, 500) for _ in range(200)]
    got, cold = reused_and_cold(chunked_lily, lru, prompt, step)
    assert got[0] == 192 and chunked_passes_ran()
    assert_same_bits(got, cold)


def test_reuse_from_inside_the_previous_prompt_s_last_call_equals_cold_prefill(chunked_lily, installed,
                                                                              emulator_backend):
    # The first prompt's last call (192 -> 299) keeps the DeltaNet states at
    # its last whole chunk (256); the follow-up diverges at 280 and resumes
    # there, off the 192-token grid, with a cold prefill's bits: the resumed
    # calls (256 -> 448 -> 529) and the cold ones (192 -> 384 -> 529) differ
    # only by cuts between calls of a chunk or more, whole chunks apart.
    rng = random.Random(5)
    step = 192
    lru = LRUPromptCache(max_size=4)
    history = [rng.randrange(1, 500) for _ in range(300)]
    serve(chunked_lily, lru, [history], step)
    prompt = history[:280] + [rng.randrange(1, 500) for _ in range(250)]
    assert pr.plan(lru, KEY, prompt).position == 256
    got, cold = reused_and_cold(chunked_lily, lru, prompt, step)
    assert got[0] == 256
    assert_same_bits(got, cold)
    # A follow-up whose cold prefill ends in a call under a chunk (384 ->
    # 400) is not resumed there, but at the last exact checkpoint (192).
    short = history[:280] + [rng.randrange(1, 500) for _ in range(121)]
    assert pr.plan(lru, KEY, short).position == 192


def test_a_reused_prompt_decodes_through_the_cold_prompt_s_batched_step(lily, installed, emulator_backend,
                                                                        monkeypatch):
    # mlx-lm merges a saved cache into its batch without a padding mask and
    # fresh ones with an all-True one; lily's batched decode step takes both
    # in its masked form, so a reused prompt meets the step (and its trace
    # per KV capacity) that cold prompts already built.
    from mlx_lily.layers import batch_step

    forms = []
    stock_fn = batch_step.batch_step_fn

    def spy(model, masked):
        forms.append(masked)
        return stock_fn(model, masked)

    monkeypatch.setattr(batch_step, "batch_step_fn", spy)
    rng = random.Random(6)
    lru = LRUPromptCache(max_size=4)
    history = [rng.randrange(1, 500) for _ in range(60)]
    serve(lily, lru, [history], 16)
    prompt = history[:50] + [rng.randrange(1, 500) for _ in range(9)]
    got, cold = reused_and_cold(lily, lru, prompt, 16)
    assert got[0] > 0 and forms and set(forms) == {True}
    assert_same_bits(got, cold)


def test_a_reused_prompt_decodes_at_the_cold_prompt_s_kv_capacity(lily, installed, emulator_backend, monkeypatch):
    # Resumed at 288 (a chunk end off stock's 256-row grid), the prompt's
    # rest grows the KV buffers to 288 + 256 rows; the batched step cuts them
    # to the cold prompt's whole capacity, so the reused prompt replays the
    # cold prompt's trace and decodes with its attention grid.
    from mlx_lily.layers import batch_step
    from mlx_lily.layers import text_model as T

    monkeypatch.setattr(T, "CAPACITY_STEP", 512)
    capacities = []
    stock_reserve = batch_step.reserve_batch_rows

    def spy(cache, rows, attention, dtype):
        stock_reserve(cache, rows, attention, dtype)
        capacities.append(cache.keys.shape[2])

    monkeypatch.setattr(batch_step, "reserve_batch_rows", spy)
    rng = random.Random(7)
    lru = LRUPromptCache(max_size=4)
    history = [rng.randrange(1, 500) for _ in range(300)]
    serve(lily, lru, [history], 16)
    prompt = history[:290] + [rng.randrange(1, 500) for _ in range(10)]
    capacities.clear()
    (got,) = serve(lily, lru, [prompt], 16)
    reused = set(capacities)
    capacities.clear()
    (cold,) = serve(lily, None, [prompt], 16)
    assert got[0] == 288
    assert reused == set(capacities) == {512}
    assert_same_bits(got, cold)


def test_a_prefill_cut_at_a_64_token_piece_keeps_its_bits_on_the_chunked_kernels(chunked_lily, emulator_backend):
    """The chunked DeltaNet passes split a call into 64-token pieces from its
    first token. A prompt cut where a piece ends (both calls long enough for
    the chunked passes) gives the bits of one call; a cut inside a piece
    rounds differently, which is why resuming off the cold prefill's grid
    changes the bits (docs/prefix-reuse.md)."""
    from mlx_lm.models.cache import make_prompt_cache

    tokens = mx.array([[(7 * i) % 400 + 3 for i in range(450)]])

    def last_logits(cut=None):
        cache, out = make_prompt_cache(chunked_lily), None
        for a, b in ((0, cut), (cut, None)) if cut else ((0, None),):
            out = chunked_lily(tokens[:, a:b], cache=cache)
        return out[:, -1]

    whole = last_logits()
    assert chunked_passes_ran()
    assert mx.array_equal(last_logits(256), whole).item()
    assert not mx.array_equal(last_logits(257), whole).item()


def test_exact_policy_resumes_only_on_the_new_prompt_s_chunk_grid(lily, reference_backend, installed):
    rng = random.Random(2)
    step = 8
    lru = LRUPromptCache(max_size=10)
    tokens = [rng.randrange(1, 500) for _ in range(40)]
    # A system segment of 5 tokens: the first prompt cuts at 5, 13, 21, ...
    serve(lily, lru, [tokens], step, segments=[[tokens[:5], tokens[5:]]])
    prompt = tokens[:30] + [rng.randrange(1, 500) for _ in range(6)]
    # The same segments: 29 is on the grid (5 + 3 * 8).
    assert pr.plan(lru, KEY, prompt, [5, 31]).position == 29
    # As one segment the grid is 8, 16, 24, ...: none of the checkpoints is on it.
    assert pr.plan(lru, KEY, prompt, None) is None
    assert pr.plan(lru, KEY, prompt, None, mode="longest").position == 29
    # Through the generator with the same segments: exact.
    got, cold = reused_and_cold(lily, lru, prompt, step, segments=[[prompt[:5], prompt[5:]]])
    assert got[0] == 29
    assert_same_bits(got, cold)


def test_short_prompts_and_divergence_at_token_zero(lily, reference_backend, installed):
    rng = random.Random(4)
    step = 16
    lru = LRUPromptCache(max_size=10)
    history = [rng.randrange(1, 500) for _ in range(40)]
    serve(lily, lru, [history], step)
    for prompt in (history[:10], history[:17], [history[0] + 1] + history[1:], history[:1] + [7]):
        got, cold = reused_and_cold(lily, lru, prompt, step)
        # Shorter than any checkpoint, a prompt whose last token is the first
        # checkpoint's (p = 16 < 17 is fine; never the whole prompt), a
        # divergence at token 0: nothing or 16 reused, always the cold bits.
        assert got[0] in (0, 16) and got[0] < len(prompt)
        assert_same_bits(got, cold)


def test_checkpoints_are_evicted_with_their_entry_and_counted_in_its_bytes(lily, reference_backend, installed):
    rng = random.Random(5)
    lru = LRUPromptCache(max_size=2)
    a = [rng.randrange(1, 500) for _ in range(40)]
    serve(lily, lru, [a], 16)
    held = pr.checkpoint_bytes(lru)
    assert held > 0
    (entry_tokens,) = [t for t in lru._lru._lrus["assistant"]][0][1:]
    entry = lru._trie.get(KEY, entry_tokens)
    assert entry.nbytes == sum(c.nbytes for c in entry.prompt_cache) + sum(c.nbytes for c in entry.lily_checkpoints)
    assert lru.nbytes == entry.nbytes
    # Two other histories push it out; its checkpoints go with it.
    for _ in range(2):
        serve(lily, lru, [[rng.randrange(1, 500) for _ in range(40)]], 16)
    assert pr.plan(lru, KEY, a[:30] + [3, 4]) is None
    assert pr.checkpoint_bytes(lru) == 2 * held
    lru.trim_to(n_bytes=0)
    assert len(lru) == 0 and lru.nbytes == 0 and pr.checkpoint_bytes(lru) == 0


def test_an_entry_evicted_mid_request(lily, reference_backend, installed):
    rng = random.Random(6)
    step = 16
    lru = LRUPromptCache(max_size=10)
    history = [rng.randrange(1, 500) for _ in range(50)]
    serve(lily, lru, [history], step)
    prompt = history[:45] + [rng.randrange(1, 500) for _ in range(5)]
    cache, rest = lru.fetch_nearest_cache(KEY, prompt)
    p = len(prompt) - len(rest)
    assert p == 32
    lru.trim_to(n_sequences=0)  # the entry it came from is gone
    gen = BatchGenerator(lily, prefill_step_size=step)
    gen.insert(prompts=[rest], max_tokens=[2], caches=[cache], all_tokens=[prompt[:p]])
    first = None
    while True:
        _, responses = gen.next()
        if responses and first is None:
            first = responses[0].logprobs
        if responses and responses[0].finish_reason is not None:
            r = responses[0]
            lru.insert_cache(KEY, r.all_tokens[:], r.prompt_cache)
            break
    (cold,) = serve(lily, None, [prompt], step)
    assert_same_bits((p, first, r.prompt_cache), cold)
    # The new entry inherited the checkpoints it resumed from.
    positions = [c.position for c in pr.entry_checkpoints(lru, KEY, r.all_tokens)]
    assert positions[:2] == [16, 32] and positions[-1] == len(prompt) - 1


def test_batched_requests_each_equal_their_cold_prefill(lily, reference_backend, installed):
    rng = random.Random(7)
    step = 16
    lru = LRUPromptCache(max_size=10)
    a = [rng.randrange(1, 500) for _ in range(50)]
    b = [rng.randrange(1, 500) for _ in range(35)]
    serve(lily, lru, [a, b], step)  # one batch: both prefilled, rows of one generator
    prompts = [a[:40] + [9, 8, 7], b[:20] + [rng.randrange(1, 500) for _ in range(30)], [1, 2, 3, 4]]
    got = serve(lily, lru, prompts, step)
    assert [g[0] for g in got] == [32, 16, 0]
    for g, prompt in zip(got, prompts):
        (alone,) = serve(lily, None, [prompt], step)
        assert_same_bits(g, alone)


def test_the_budget_bounds_one_history_s_checkpoints(lily, reference_backend, installed, monkeypatch):
    rng = random.Random(8)
    lru = LRUPromptCache(max_size=10)
    tokens = [rng.randrange(1, 500) for _ in range(120)]
    serve(lily, lru, [tokens[:30]], 8)
    one = max(c.nbytes for c in pr.entry_checkpoints(lru, KEY, lru._lru._lrus["assistant"][0][1]))
    monkeypatch.setenv(pr.BUDGET_ENV, str(4 * one))
    serve(lily, lru, [tokens], 8)
    (entry_tokens,) = [t for _, t in lru._lru._lrus["assistant"] if len(t) > 100]
    cks = pr.entry_checkpoints(lru, KEY, entry_tokens)
    assert len(cks) == 4 and sum(c.nbytes for c in cks) <= 4 * one
    assert cks[-1].position == 119  # the prompt's end is kept; the rest spread out
    assert max(b.position - a.position for a, b in zip(cks, cks[1:])) <= 48


def test_policy_off_is_stock(lily, reference_backend, installed, monkeypatch):
    monkeypatch.setenv(pr.POLICY_ENV, "off")
    lru = LRUPromptCache(max_size=10)
    tokens = list(range(1, 41))
    serve(lily, lru, [tokens], 16)
    (got,) = serve(lily, lru, [tokens[:30] + [5, 6]], 16)
    assert got[0] == 0 and pr.checkpoint_bytes(lru) == 0


def test_cache_files_round_trip_and_a_foreign_file_is_refused(lily, alt_checkpoint, reference_backend, installed,
                                                              tmp_path):
    rng = random.Random(9)
    lru = LRUPromptCache(max_size=10)
    history = [rng.randrange(1, 500) for _ in range(40)]
    (first,) = serve(lily, lru, [history], 16)
    entry_tokens = lru._lru._lrus["assistant"][0][1]
    entry = lru._trie.get(KEY, entry_tokens)
    path = tmp_path / "history.safetensors"
    pf.save_cache_file(path, lily, entry_tokens, entry.prompt_cache, entry.lily_checkpoints)

    tokens, cache, cks = pf.load_cache_file(path, lily)
    fresh = LRUPromptCache(max_size=10)
    pr.add_entry(fresh, KEY, tokens, cache, cks)
    prompt = history[:35] + [3, 1, 4, 1, 5]
    got, cold = reused_and_cold(lily, fresh, prompt, 16)
    assert got[0] == 32
    assert_same_bits(got, cold)

    other, _ = mlx_lily.load(str(alt_checkpoint), backend="lily")
    with pytest.raises(LilyError, match="another model") as refused:
        pf.load_cache_file(path, other)
    assert "\n" not in str(refused.value)
    # A stock mlx_lm.cache_prompt file (no tokens, no checkpoints): refused too.
    from mlx_lm.models.cache import save_prompt_cache

    stock_file = tmp_path / "stock.safetensors"
    save_prompt_cache(str(stock_file), entry.prompt_cache, {"model": "demo"})
    with pytest.raises(LilyError, match="stock mlx-lm prompt cache"):
        pf.load_cache_file(stock_file, lily)
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(LilyError, match="not a prompt cache file"):
        pf.load_cache_file(tmp_path / "junk.safetensors", lily)


def test_bench_multi_turn_records_reuse_and_identical_outputs(demo_checkpoint, reference_backend, monkeypatch):
    import argparse

    from bench import multi_turn

    monkeypatch.delenv(pr.POLICY_ENV, raising=False)
    p = argparse.ArgumentParser()
    multi_turn.add_arguments(p)
    args = p.parse_args(["--multi-turn", "--turns", "3", "--history-tokens", "120", "--prefill-step-size", "16",
                         "--reply-tokens", "6", "--keep-reply-tokens", "2"])
    args.seed, args.engines = 0, ["lily", "mlx"]
    section = multi_turn.run(str(demo_checkpoint), args)
    lily, stock = section["lily"], section["stock"]
    assert lily["outputs_identical"] is True and stock["outputs_identical"] is True
    assert [r["tokens_reused"] for r in lily["turns"]][1:] == [
        max(c for c in range(0, r["prompt_tokens"], 16) if c <= prev["prompt_tokens"] - 1)
        for prev, r in zip(lily["turns"], lily["turns"][1:])
    ]
    assert stock["tokens_reused"] == 0 and lily["checkpoint_bytes_max"] > 0 and stock["checkpoint_bytes_max"] == 0
    # Follow-ups are timed after an untimed cold request of their prompt; its excess is kept.
    for r in lily["turns"][1:]:
        assert r["first_cold_ttft_s"] > 0 and r["first_at_length_s"] == r["first_cold_ttft_s"] - r["cold_ttft_s"]
    assert "first_cold_ttft_s" not in lily["turns"][0] and lily["first_at_length_s_median"] is not None
    # Each TTFT's phases add up to it; lily records checkpoints in its
    # prefill calls, stock none; a follow-up prefills only its rest, in
    # --prefill-step-size chunks (the prompt's last token is the decode step's).
    for engine in (lily, stock):
        for r in engine["turns"]:
            for phases, ttft in ((r["phases"], r["ttft_s"]), (r.get("cold_phases"), r.get("cold_ttft_s"))):
                if phases is None:
                    continue
                assert phases["prefill_calls"] >= 1 and min(phases[k] for k in ("fetch_s", "prefill_s", "rest_s")) >= 0
                assert abs(phases["fetch_s"] + phases["prefill_s"] + phases["rest_s"] - ttft) < 1e-4
                assert (phases["record_s"] > 0) == (engine is lily) and phases["record_s"] <= phases["prefill_s"]
    for r in lily["turns"]:
        assert r["phases"]["prefill_calls"] == -(-(r["prompt_tokens"] - r["tokens_reused"] - 1) // 16)
    assert not pr.installed()
    table = multi_turn.markdown(section)
    assert "| lily | 3 |" in table and "| stock | 3 |" in table.split("Where each TTFT goes")[1]


def test_an_unknown_policy_is_named_in_one_notice(fresh_notices, monkeypatch, capsys):
    for value, meant in (("exact", "exact"), (" Longest ", "longest"), ("off", "off"), ("0", "off"), ("no", "off"),
                         ("1", "exact"), ("", "exact")):
        monkeypatch.setenv(pr.POLICY_ENV, value)
        assert pr.policy() == meant
    assert capsys.readouterr().err == ""
    monkeypatch.setenv(pr.POLICY_ENV, "longst")
    assert pr.policy() == "exact" and pr.policy() == "exact"
    said = capsys.readouterr().err
    assert said.count("\n") == 1 and f"{pr.POLICY_ENV}='longst'" in said
    assert all(name in said for name in pr.POLICIES)


def test_a_checkpoint_budget_lily_cannot_read_is_named_and_the_default_kept(lily, reference_backend, installed,
                                                                            fresh_notices, monkeypatch, capsys):
    for value, size in (("2147483648", 2 << 30), ("512M", 512 << 20), ("1.5G", 3 << 29), ("2 GiB", 2 << 30),
                        ("64kb", 64 << 10), ("0", 0)):
        monkeypatch.setenv(pr.BUDGET_ENV, value)
        assert pr.budget() == size
    assert capsys.readouterr().err == ""
    for value in ("lots", "-1", "inf", "nan", "1e400", "2X"):
        monkeypatch.setenv(pr.BUDGET_ENV, value)
        assert pr.budget() == pr.DEFAULT_BUDGET and pr.budget() == pr.DEFAULT_BUDGET
        said = capsys.readouterr().err
        assert said.count("\n") == 1 and f"{pr.BUDGET_ENV}={value!r}" in said
    # Served under each: an unreadable budget keeps the default's checkpoints,
    # a budget of 0 keeps none.
    tokens = list(range(1, 41))
    for value, kept in (("lots", True), ("0", False)):
        monkeypatch.setenv(pr.BUDGET_ENV, value)
        lru = LRUPromptCache(max_size=10)
        serve(lily, lru, [tokens], 16)
        assert (pr.checkpoint_bytes(lru) > 0) == kept
