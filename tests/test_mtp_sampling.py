"""Speculative rejection sampling (``mlx_lily.mtp_sampling``) keeps the
sampler's distribution: the rejection step on hand-made p and q, lily's
Sampler against mlx-lm's draws, and the MTP loop's first two tokens on a
random checkpoint against the exact distribution of plain sampling, each by
a chi-square bound (fixed seeds: the runs are the same every time); greedy
through lily's sampler and the stream API is still generate's output token
for token."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler as stock_make_sampler

import mlx_lily
from mlx_lily import mtp_sampling
from mlx_lily.mtp_decode import mtp_generate_step, mtp_stream_generate
from mlx_lily.random_checkpoints import make_checkpoint

# Chi-square's 0.9999 quantile for up to 9 degrees of freedom is under 33.7
# (df 9); a bound well above the df's expected value, well below a wrong law's.
def chi2_bound(df: int) -> float:
    return {1: 15.2, 2: 18.5, 3: 21.2, 4: 23.6, 5: 25.8, 6: 27.9, 7: 29.9, 8: 31.9}.get(df, 33.8)


def chi2(counts: Counter, probs: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic of ``counts`` (n draws) against ``probs``; a draw
    outside the support is infinite."""
    if any(probs.get(x, 0.0) <= 0 for x in counts):
        return float("inf"), 0
    stat = sum((counts.get(x, 0) - n * p) ** 2 / (n * p) for x, p in probs.items() if p > 0)
    return stat, sum(p > 0 for p in probs.values()) - 1


P = np.array([[0.45, 0.25, 0.2, 0.1, 0.0], [0.05, 0.15, 0.3, 0.2, 0.3], [0.3, 0.3, 0.2, 0.1, 0.1]], np.float32)
Q = np.array([[0.1, 0.4, 0.0, 0.3, 0.2], [0.5, 0.1, 0.1, 0.2, 0.1]], np.float32)


@pytest.mark.parametrize("k", [1, 2])
def test_rejection_step_emits_p(k):
    """Drafts drawn from q; the first emitted token follows p_0; after an
    accepted first draft the next follows p_1; acceptance is sum min(p, q)."""
    mx.random.seed(7)
    n = 3000
    p, q = mx.array(P[: k + 1]), mx.array(Q[:k])
    drafts = mtp_sampling.draw(mx.broadcast_to(q[None], (n, k, 5)))  # [n, k]
    mx.eval(drafts)
    first, second, accepted = Counter(), Counter(), 0
    for row in drafts.tolist():
        m, token = mtp_sampling.rejection_step(p, q, mx.array(row))
        emitted = row[:m] + [token]
        first[emitted[0]] += 1
        accepted += m > 0
        if m > 0:
            second[emitted[1]] += 1
    probs0 = {x: float(v) for x, v in enumerate(P[0])}
    stat, df = chi2(first, probs0, n)
    assert stat < chi2_bound(df), (stat, first)
    stat, df = chi2(second, {x: float(v) for x, v in enumerate(P[1])}, sum(second.values()))
    assert stat < chi2_bound(df), (stat, second)
    rate = float(np.minimum(P[0], Q[0]).sum())
    assert abs(accepted / n - rate) < 4 * (rate * (1 - rate) / n) ** 0.5
    # The bound has power: the drafts themselves (law q_0) fail it.
    stat, df = chi2(Counter(r[0] for r in drafts.tolist()), probs0, n)
    assert stat > chi2_bound(4)


@pytest.mark.parametrize("options", [dict(temp=0.7), dict(temp=1.3, top_p=0.8), dict(temp=1.0, top_k=3, min_p=0.05)])
def test_sampler_says_the_law_mlx_lm_draws_from(options):
    mx.random.seed(3)
    logprobs = mx.log(mx.softmax(mx.array(np.random.default_rng(0).normal(size=(1, 12)).astype(np.float32)) * 2))
    sampler = mtp_sampling.make_sampler(**options)
    assert isinstance(sampler, mtp_sampling.Sampler)
    n = 2000
    draws = stock_make_sampler(**options)(mx.broadcast_to(logprobs, (n, 12)))
    probs = sampler.probs(logprobs)[0].tolist()
    stat, df = chi2(Counter(draws.tolist()), dict(enumerate(probs)), n)
    assert stat < chi2_bound(df), (stat, options)


def test_samplers_without_a_law_are_mlx_lm_s():
    assert mtp_sampling.kind_of(mtp_sampling.make_sampler(0.0)) == "greedy"
    assert mtp_sampling.kind_of(mtp_sampling.make_sampler(1.0, xtc_probability=0.5)) == "opaque"
    assert mtp_sampling.kind_of(lambda x: mx.argmax(x, axis=-1)) == "opaque"


PROMPT = [5, 17, 101, 230, 7, 64]
OPTIONS = dict(temp=1.0, top_k=2)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    model, tokenizer = mlx_lily.load(str(make_checkpoint(tmp_path_factory.mktemp("mtp-s") / "m", mtp=True)))
    return model, tokenizer


def _law(model, tokens):
    logits = model(mx.array([tokens]))[0, -1:]
    probs = mtp_sampling.make_sampler(**OPTIONS).probs(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[0]
    return {x: p for x, p in enumerate(probs.tolist()) if p > 0}


def test_the_first_two_tokens_follow_plain_sampling(model, drafts="likely"):
    """The exact law of plain sampling's first two tokens (top-2 each: four
    pairs) against 60 speculative runs, k = 1, each second token's likeliest
    value as a point-mass draft (accepted about half the time: both the
    acceptance and the residual draw on the model's own p)."""
    model, _ = model
    law1 = _law(model, PROMPT)
    law2 = {t: _law(model, PROMPT + [t]) for t in law1}
    pairs = {(a, b): pa * pb for a, pa in law1.items() for b, pb in law2[a].items()}
    likely = {a: max(law2[a], key=law2[a].get) for a in law1}
    hook = (lambda done, d: [likely.get(first[-1], 0)]) if drafts == "likely" else None
    sampler = mtp_sampling.make_sampler(**OPTIONS)
    mx.random.seed(11)
    counts, accepted, n = Counter(), 0, 60
    for _ in range(n):
        first = []
        stats = {}
        out = []
        for token, _, _ in mtp_generate_step(mx.array(PROMPT), model, num_draft_tokens=1, max_tokens=2,
                                             sampler=sampler, stats=stats, draft_hook=hook):
            first.append(token)
            out.append(token)
        counts[tuple(out)] += 1
        accepted += stats["accepted"]
    stat, df = chi2(counts, pairs, n)
    assert stat < chi2_bound(df), (stat, counts)
    if drafts == "likely":
        assert 0.2 * n < accepted < 0.95 * n


def test_greedy_through_the_stream_api_is_generate_s(model):
    model, tokenizer = model
    greedy = mtp_sampling.make_sampler(0.0)
    want = [r.token for r in stream_generate(model, tokenizer, mx.array(PROMPT), max_tokens=12, sampler=greedy)]
    for k in (1, 3):
        got = [r.token for r in mtp_stream_generate(model, tokenizer, mx.array(PROMPT), num_draft_tokens=k,
                                                    max_tokens=12, sampler=greedy)]
        assert got == want
