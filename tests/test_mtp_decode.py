"""Greedy speculative decoding with the MTP head (``mlx_lily.mtp_decode``), on
the reference path: the output is mlx-lm's greedy output token for token at
k = 1..3 whatever the drafts (the random head's, always-right and partly
right ones), and after rollbacks every cache equals, bit for bit, the cache
of a run that never drafted."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

import mlx_lily
from mlx_lily.mtp_decode import PAUSE_AFTER_MISSES, PAUSE_WIDTH_MAX, mtp_generate_step
from mlx_lily.random_checkpoints import make_checkpoint

from test_draft_model import assert_caches_equal

PROMPT = "The quick brown fox jumps over the lazy dog. Hello"
TOKENS = 24


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("mtp") / "head", mtp=True)
    model, tokenizer = mlx_lily.load(str(path))
    prompt = mx.array(tokenizer.encode(PROMPT))
    greedy = [int(t) for t, _ in generate_step(prompt, model, max_tokens=TOKENS)]
    return dict(model=model, prompt=prompt, greedy=greedy, vocab=model.language_model.args.vocab_size)


def _oracle(greedy, k, wrong_every=0, vocab=512):
    """Drafts from the greedy continuation; with ``wrong_every``, the second
    draft (the first for k = 1) of every ``wrong_every``-th round is wrong."""
    rounds = [0]

    def hook(done, drafts):
        rounds[0] += 1
        out = [greedy[done + i] if done + i < len(greedy) else 0 for i in range(k)]
        if wrong_every and rounds[0] % wrong_every == 0:
            j = min(1, k - 1)
            out[j] = (out[j] + 1) % vocab
        return out

    return hook


@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("drafts", ["head", "oracle", "partly"])
def test_greedy_equals_greedy_without_drafts(setup, k, drafts):
    hook = None if drafts == "head" else _oracle(setup["greedy"], k, 2 if drafts == "partly" else 0, setup["vocab"])
    stats = {}
    out = list(mtp_generate_step(setup["prompt"], setup["model"], num_draft_tokens=k, max_tokens=TOKENS,
                                 stats=stats, draft_hook=hook))
    assert [t for t, _, _ in out] == setup["greedy"]
    assert stats["accepted"] == sum(d for _, _, d in out)
    if drafts == "oracle":
        assert stats["accepted"] >= (TOKENS - 1) * k // (k + 1) - k  # all taken but at the end
    elif drafts == "partly":
        assert 0 < stats["accepted"] < stats["rounds"] * k


@pytest.mark.parametrize("k", [1, 3])
def test_rollback_leaves_the_caches_of_a_run_that_never_drafted(setup, k):
    model, prompt = setup["model"], setup["prompt"]
    cache = make_prompt_cache(model)
    out = [t for t, _, _ in mtp_generate_step(prompt, model, num_draft_tokens=k, max_tokens=TOKENS,
                                               prompt_cache=cache,
                                               draft_hook=_oracle(setup["greedy"], k, 2, setup["vocab"]))]
    plain = _plain_caches(model, prompt, out[:-1])
    assert [type(c) for c in cache] == [type(c) for c in plain]  # plain ArraysCache again
    assert_caches_equal(cache, plain)


def _plain_caches(model, prompt, fed):
    """The caches of a run that never drafted: generate_step's prefill, then
    each of ``fed`` alone."""
    plain = make_prompt_cache(model)
    model(prompt[None, :-1], cache=plain)
    for t in [int(prompt[-1])] + fed:
        model(mx.array([[t]]), cache=plain)
    mx.eval([c.state for c in plain])
    return plain


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("stop", [4, 9])
def test_a_consumer_that_stops_early_leaves_the_caches_of_what_it_took(setup, k, stop):
    """Closing the generator mid-round (a stop token, say), with the next
    round already built: the caches hold the prompt and every token taken
    but the last, as when max_tokens ends the run."""
    model, prompt = setup["model"], setup["prompt"]
    cache = make_prompt_cache(model)
    run = mtp_generate_step(prompt, model, num_draft_tokens=k, max_tokens=TOKENS, prompt_cache=cache,
                            draft_hook=_oracle(setup["greedy"], k, 3, setup["vocab"]))
    out = [next(run)[0] for _ in range(stop)]
    run.close()
    assert out == setup["greedy"][:stop]
    assert_caches_equal(cache, _plain_caches(model, prompt, out[:-1]))


def _wrong(greedy, k, vocab, right_from=None):
    """Drafts the model never keeps (each the greedy token plus one), until
    ``right_from`` tokens are out; from there the greedy continuation."""

    def hook(done, drafts):
        right = [greedy[done + i] if done + i < len(greedy) else 0 for i in range(k)]
        if right_from is not None and done >= right_from:
            return right
        return [(t + 1) % vocab for t in right]

    return hook


@pytest.mark.parametrize("k", [1, 2, 3])
def test_drafting_pauses_while_every_draft_is_rejected(setup, k):
    """Rejected drafts pause drafting: after PAUSE_AFTER_MISSES rounds that
    keep nothing, tokens without drafts, the head checked on each of its
    calls (k + 1 positions, then each call twice the last, up to
    PAUSE_WIDTH_MAX) and never right, so no round is tried again; the tokens
    are still greedy's, and the plain tokens come from the model's own step
    (no draft)."""
    stats = {}
    out = list(mtp_generate_step(setup["prompt"], setup["model"], num_draft_tokens=k, max_tokens=TOKENS,
                                 stats=stats, draft_hook=_wrong(setup["greedy"], k, setup["vocab"])))
    assert [t for t, _, _ in out] == setup["greedy"]
    assert stats["accepted"] == 0 and not any(d for _, _, d in out)
    assert PAUSE_AFTER_MISSES == 2
    # The first token, 2 rounds, then one pause to the end.
    plain = TOKENS - 1 - PAUSE_AFTER_MISSES
    assert (stats["rounds"], stats["plain"], stats["pauses"]) == (PAUSE_AFTER_MISSES, plain, 1)
    # The pause's head calls: the miss left one position and each plain
    # token adds one, so plain token i (from 0) holds i + 1 positions, and
    # calls of widths k + 1, 2(k + 1), 4(k + 1), ... up to 16 fall at the
    # tokens below; each is read before the next plain token, so a call at
    # the pause's last token (20) is not.
    assert PAUSE_WIDTH_MAX == 16 and plain == 21
    read = {1: [1, 5, 13], 2: [2, 8], 3: [3, 11]}[k]  # widths 2, 4, 8 | 3, 6, 12 (20: unread) | 4, 8
    assert stats["checks"] == len(read)


def _spy_on_the_head(model, monkeypatch):
    """([positions of each head call], [the cache of each]), filled as the
    MTP head is called."""
    from mlx_lily import mtp

    head = mtp.head_of(model)
    widths, caches = [], []
    real_call = type(head).__call__

    def spy(self, hidden, embedded, cache=None):
        widths.append(hidden.shape[1])
        caches.append(cache)
        return real_call(self, hidden, embedded, cache)

    monkeypatch.setattr(type(head), "__call__", spy)
    return widths, caches


@pytest.mark.parametrize("k", [1, 3])
def test_paused_positions_reach_the_head_in_growing_calls(setup, k, monkeypatch):
    """While drafting pauses, the head takes the plain steps' positions k + 1
    at a time, then twice as many a call (fewer calls than positions; none
    wider than PAUSE_WIDTH_MAX, the most its rows path takes). Every
    verified position still reaches it once: its cache ends where the
    model's does, less the last token (not yet verified) and the prompt's
    first (no position before it)."""
    widths, caches = _spy_on_the_head(setup["model"], monkeypatch)
    stats = {}
    prompt_cache = make_prompt_cache(setup["model"])
    # Wrong drafts until 6 tokens are out: the first token, two missed
    # rounds, a pause from token 3, and the first token of the round after
    # it, the last: the head has then taken every position that token's
    # round verified. The pause's checks: k = 3, width 4 at token 6 (right),
    # so 5 plain tokens; k = 1, width 2 at token 4 (wrong), width 4 at
    # token 8 (right), so 7.
    plain = {1: 7, 3: 5}[k]
    steps = 1 + PAUSE_AFTER_MISSES + plain + 1
    out = list(mtp_generate_step(setup["prompt"], setup["model"], num_draft_tokens=k, max_tokens=steps,
                                 stats=stats, prompt_cache=prompt_cache,
                                 draft_hook=_wrong(setup["greedy"], k, setup["vocab"], right_from=6)))
    assert [t for t, _, _ in out] == setup["greedy"][:steps]
    assert stats["pauses"] == 1 and stats["plain"] == plain and out[-1][2]
    prompt_width = setup["prompt"].size
    # The prompt's pairs (h_t, token t + 1) before the first token, in one
    # chunk at this length; then the prompt's last position with the first
    # generated token, and the rest no wider than the pause's second call
    # (k = 1: 4) or a round (k = 3: 4).
    assert widths[0] == prompt_width - 1 and widths[1] == 1 and max(widths[1:]) == 4
    head_cache = caches[-1]
    model_tokens = prompt_width + steps - 1  # the last token is not fed to the model yet
    assert head_cache[0].offset == model_tokens - 1


def test_drafting_resumes_once_drafts_are_kept_again(setup):
    """A pause ends once the head's check drafts the model's token: one
    more plain token, then rounds again."""
    stats = {}
    out = list(mtp_generate_step(setup["prompt"], setup["model"], num_draft_tokens=2, max_tokens=TOKENS,
                                 stats=stats, draft_hook=_wrong(setup["greedy"], 2, setup["vocab"], right_from=6)))
    assert [t for t, _, _ in out] == setup["greedy"]
    # Tokens 1 and 2 from the two missed rounds; the pause's plain tokens
    # from 3, its checks at 5 (3 positions: wrong, before 6) and at 11 (6
    # positions: right), then token 12, the pause's last.
    assert stats["pauses"] == 1 and stats["plain"] == 10 and stats["checks"] == 2
    # After the pause every round keeps both drafts (but where the run ends).
    assert stats["accepted"] >= 2 * (stats["rounds"] - PAUSE_AFTER_MISSES) - 2


@pytest.mark.parametrize("stop", [5, 7, 9])
def test_a_run_ended_inside_a_pause_leaves_the_caches_of_what_it_took(setup, stop):
    """Closing the generator while drafting is paused (the next plain step
    already submitted), and max_tokens ending it there: the caches hold the
    prompt and every token taken but the last."""
    model, prompt = setup["model"], setup["prompt"]
    hook = _wrong(setup["greedy"], 1, setup["vocab"])
    cache = make_prompt_cache(model)
    run = mtp_generate_step(prompt, model, num_draft_tokens=1, max_tokens=TOKENS, prompt_cache=cache,
                            draft_hook=hook)
    out = [next(run)[0] for _ in range(stop)]
    run.close()
    assert out == setup["greedy"][:stop]
    assert_caches_equal(cache, _plain_caches(model, prompt, out[:-1]))
    cache = make_prompt_cache(model)
    stats = {}
    out = [t for t, _, _ in mtp_generate_step(prompt, model, num_draft_tokens=1, max_tokens=stop,
                                               prompt_cache=cache, stats=stats, draft_hook=hook)]
    assert out == setup["greedy"][:stop] and stats["plain"] > 0
    assert_caches_equal(cache, _plain_caches(model, prompt, out[:-1]))


def test_the_round_after_a_pause_is_queued_before_the_pause_s_last_token_is_read(setup):
    """A pause's last plain token and the round after it: the round is built
    on that token before the consumer gets it (as a plain step would be), so
    its drafting sees one token more than the consumer has; every other
    round is built after the tokens before it were taken. Output unchanged."""
    model, prompt, greedy = setup["model"], setup["prompt"], setup["greedy"]
    taken, seen = [], []
    wrong = _wrong(greedy, 1, setup["vocab"], right_from=6)

    def hook(done, drafts):
        seen.append(done - len(taken))
        return wrong(done, drafts)

    stats = {}
    for t, _, _ in mtp_generate_step(prompt, model, num_draft_tokens=1, max_tokens=TOKENS, stats=stats,
                                     draft_hook=hook):
        taken.append(t)
    assert taken == greedy and stats["pauses"] == 1
    # The first round (0: after the first token); the one built ahead of it,
    # as if its draft were kept (2: two tokens ahead, backed out); the round
    # after that miss (0); the pause's two checks (0: each drafts the plain
    # token about to come); the round after the pause (1: built on its last
    # token before that was taken); the round after it (0: built once its
    # count was read); then rounds built ahead of kept drafts (2).
    assert seen == [0, 2, 0, 0, 0, 1, 0] + [2] * (len(seen) - 7)


def test_a_model_without_a_head_says_how_to_graft(demo_checkpoint):
    model, _ = mlx_lily.load(str(demo_checkpoint))
    with pytest.raises(ValueError, match="no MTP head.*graft-mtp"):
        next(mtp_generate_step(mx.array([1, 2, 3]), model))


def test_the_head_takes_the_prompt_with_the_model_s_chunks_before_the_first_token(setup, monkeypatch):
    """The head's prompt pairs (h_t, token t + 1) are all known before the
    first token but the last: the head takes them with each prefill chunk
    of the model, so they are prompt work (bounded by the chunk), and the
    first round drafts from one position. Output unchanged."""
    widths, caches = _spy_on_the_head(setup["model"], monkeypatch)
    n = setup["prompt"].size
    gen = mtp_generate_step(setup["prompt"], setup["model"], num_draft_tokens=2, max_tokens=TOKENS,
                            prefill_step_size=4)
    first = next(gen)
    chunks = [4] * ((n - 1) // 4) + ([(n - 1) % 4] if (n - 1) % 4 else [])
    assert widths == chunks and caches[-1][0].offset == n - 1
    out = [first] + list(gen)
    greedy = [int(t) for t, _ in generate_step(setup["prompt"], setup["model"], max_tokens=TOKENS,
                                               prefill_step_size=4)]
    assert [t for t, _, _ in out] == greedy
    assert widths[len(chunks)] == 1  # the first round: the prompt's last position
