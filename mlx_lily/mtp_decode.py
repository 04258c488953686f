"""Greedy speculative decoding with the checkpoint's own MTP head (reference path).

Each round the MTP head (``mlx_lily.mtp``) drafts k tokens (k = 1..3; the
head run on its own output for k > 1), the model verifies the k + 1
positions (the pending token and the k drafts) in one call, the longest run
of drafts the model agrees with is kept, plus the model's own next token:

    round:  x (the model's pending token), d_1..d_k (drafts)
            model([x, d_1..d_k]) -> targets t_0..t_k
            n = drafts accepted (d_i == t_{i-1} for i = 1..n)
            emit d_1..d_n, t_n; the model's caches go back k - n tokens

The model's Gated DeltaNet caches are ``TrimmableArraysCache``s for the loop
(``mlx_lily.trimmable_cache``): the verify call leaves the state after each
position, so a rejection puts back the state of the last kept token without
recomputing it, and the KV caches move their offsets back. On lily's kernels
the verify call is ``layers/verify_step.py``'s pass (every position the bits
of a decode step alone, each weight read once); elsewhere the model's own
call, whose DeltaNet layers run such a cache a token at a time.

The head keeps its own KV cache, one entry per position of the model's
verified tokens: position t holds (h_t, x_{t+1}), h_t the model's final
(normed) hidden state. After a round the head sees the n + 1 new verified
positions in one call, whose last output drafts the next round's d_1; its
entries for d_2..d_k (drafted from its own outputs) are trimmed.

Greedy (no sampler, or mlx-lm's greedy one): the emitted tokens are the
model's greedy tokens (the argmax at every position), so the output is
``mlx_lm.generate_step``'s greedy output token for token, where the model's
verify call gives each position the bits a decode step alone gives it
(the verification pass on the kernels, and lily's reference path; see
docs/speculative.md). With a
sampler: rejection sampling (``mlx_lily.mtp_sampling``), so each token is
distributed as ``generate_step``'s with that sampler.

``install()`` wraps mlx-lm's ``generate_step`` (the module global that
``stream_generate``, ``generate``, the commands and the server's one-request
path call) so that a lily model with a head drafts: ``mtp_draft_tokens=k``
passed to ``stream_generate`` / ``generate`` (``mtp_stream_generate`` and
``mtp_generate`` here pass it), or the commands' ``--mtp``
(``mlx_lily.mtp_cli``).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Generator, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from mlx_lm.sample_utils import greedy_sampler

from . import mtp, mtp_sampling
from .trimmable_cache import make_plain, make_trimmable

MAX_DRAFT = 3
# A round's parts, as ``stats["seconds"]`` sums them where asked: building
# and submitting the head's drafts, building the verify pass (both also for a
# round built ahead and backed out), submitting a round built ahead (queuing
# its kernels; a round built once the count is known is submitted by the
# wait), waiting for the GPU (the round's one wait), accepting and rolling
# the caches back.
ROUND_PARTS = ("draft", "verify_build", "submit", "wait", "accept")
# Greedy rounds stop drafting while the drafts are rejected: after
# PAUSE_AFTER_MISSES rounds in a row that keep no draft, the next tokens are
# decoded one at a time without drafts (generate_step's step, pipelined as it
# runs it). The head still takes those tokens' positions, in calls of
# growing width (PAUSE_WIDTH_MAX), and each such call also drafts the plain
# token that follows (a check: the head's first draft, through the draft
# hook where there is one). Drafting resumes once a check's draft is the
# token the model chose: one more plain token, then a round. Why: a verify
# pass costs more than a step (1.1-1.2x at 2 positions on the H200), so
# rounds that keep nothing are slower than plain decoding, and a check costs
# the head's logits, not a verify pass; two misses in a row are rare where
# drafting pays (about one round in 40 at acceptance 0.85, k = 1).
PAUSE_AFTER_MISSES = 2
# A pause's head calls grow: the first takes k + 1 positions (a round's
# width), each next one twice the last, up to PAUSE_WIDTH_MAX (the most
# positions the head's rows path takes: verify_step's MAX_BATCH). Why: a
# head call costs about 1.4 ms of host work on the H200 (``bench --spec``'s
# round_ms.draft), so a call every 2 plain tokens (k = 1) added about a
# tenth to each token of a long pause, which stays this slow while the head
# stays wrong; growing calls bring that to a few percent, while a short
# pause (the head wrong once or twice) meets its first checks as early as
# before. A long pause ends up to PAUSE_WIDTH_MAX - 1 tokens after the head
# is right again.
PAUSE_WIDTH_MAX = 16
NO_HEAD = ("the model has no MTP head (its checkpoint has no mtp.* tensors; "
           "python -m mlx_lily graft-mtp CHECKPOINT ORIGINAL adds one)")


def _head_logits(model: Any, hidden: mx.array, cache: Any = None) -> mx.array:
    """The language model's head on final hidden states, as its own call;
    with the model's ``cache``, decode rows ([S, 1, D] or [1, 1, D]) take
    lily's head GEMV as a decode step's do (``LilyLanguageModel.head``)."""
    language = model.language_model
    head = getattr(language, "head", None)
    if head is not None:
        return head(hidden, cache)
    if language.args.tie_word_embeddings:
        return language.model.embed_tokens.as_linear(hidden)
    return language.lm_head(hidden)


def _hidden(model: Any, tokens: mx.array, cache: List[Any]) -> mx.array:
    """The model's final (normed) hidden states for ``tokens`` [S]."""
    return model.language_model.model(tokens[None], cache=cache)


def _verify(model: Any, ys: mx.array, cache: List[Any]) -> Tuple[mx.array, mx.array]:
    """The model over a round's k + 1 positions: (final hidden states [1, k +
    1, D], logits [k + 1, V]). On lily's decode kernels where every layer
    takes them (``layers/verify_step.py``): each position the bits of a
    decode step alone, its head's row as a decode step's [1, 1, D] call;
    elsewhere the model's own call of k + 1 tokens."""
    from .layers.verify_step import verify

    out = verify(model.language_model.model, ys, cache)  # [k + 1, 1, D]
    if out is None:
        out = _hidden(model, ys, cache)
        return out, _head_logits(model, out)[0]
    # The k + 1 rows on the head GEMV (each row a decode step's bits, the
    # weights read once for all).
    return out.reshape(1, ys.size, -1), _head_logits(model, out, cache)[:, 0]


def _greedy_drafts(model: Any, hidden: mx.array, next_tokens: mx.array, head_cache: List[Any], k: int,
                   cache: List[Any]) -> Optional[mx.array]:
    """A round's k greedy drafts [k] from the verified positions (hidden
    [1, S, D], the tokens after them [S]) as one compiled call, where the
    head's rows path takes them (``verify_step.head_drafts``: the head, then k
    times its logits as a decode step's, the argmax and the head on that
    draft); None, with nothing done, elsewhere. ``cache``: the model's
    caches, which decide the logits' head as they do a decode step's."""
    from .layers.verify_step import head_drafts

    head, language = mtp.head_of(model), model.language_model
    if len(head.layers) != 1:
        return None
    embed = language.model.embed_tokens
    takes = getattr(language, "_lily_head_takes", None)
    on_gemv = bool(takes and takes(hidden[:, -1:], cache)) and language.sharding_group is None
    # The head GEMV's own ops (inside the chain's trace, not the head's
    # compiled call), else the head as a decode step calls it.
    logits_of = language._head_gemv if on_gemv else (lambda g: _head_logits(model, g, cache))
    # What the chain reads beyond the head (its retraces follow them).
    weights = [embed] if language.args.tie_word_embeddings else [language.lm_head, embed]
    return head_drafts(head, head.layers[0], hidden, embed(next_tokens[None]), head_cache[0], k,
                       logits_of, embed, on_gemv, weights)


class _Round:
    """A speculative round's arrays: the tokens fed (the pending token and
    the drafts), the drafts, their distributions (sampling with a Sampler),
    the verified hidden states, the log-probs and the greedy targets; and
    how many verified positions its drafting gave the head."""

    def __init__(self, ys, drafts, q, out, logprobs, targets, head_positions):
        self.ys, self.drafts, self.q, self.out, self.logprobs, self.targets = ys, drafts, q, out, logprobs, targets
        self.head_positions = head_positions


def _end(cache: List[Any], ahead: Optional[_Round], unyielded: int, back_out: Callable) -> None:
    """The caches when the generator ends: the round built ahead backed out,
    then the tokens past the last one yielded (the caches hold what was
    yielded but its last token, as when max_tokens ends it)."""
    if ahead is not None:
        back_out()
    for c in cache:
        c.trim(unyielded)


def mtp_generate_step(
    prompt: mx.array,
    model: Any,
    *,
    num_draft_tokens: int = 1,
    max_tokens: int = 256,
    sampler: Optional[Callable[[mx.array], mx.array]] = None,
    logits_processors: Optional[List[Callable]] = None,
    prompt_cache: Optional[List[Any]] = None,
    prefill_step_size: int = 2048,
    stats: Optional[dict] = None,
    draft_hook: Optional[Callable[[int, mx.array], List[int]]] = None,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Yield (token, logprobs, from_draft) as ``speculative_generate_step``
    does, drafting with ``model``'s MTP head. ``sampler``: None or mlx-lm's
    greedy sampler (greedy: the argmax tokens), a ``mtp_sampling.Sampler``
    (rejection sampling against the head's distribution) or any other sampler
    (point-mass drafts; see ``mtp_sampling``); ``logits_processors`` as
    ``generate_step`` applies them. ``prompt_cache``: the model's caches
    (``make_prompt_cache(model)``; updated in place: when the generator ends
    they hold the prompt and every token yielded but the last). ``stats``,
    where given, gets ``rounds`` and ``accepted`` (and, where it holds a
    ``seconds`` dict, the host's seconds per ``ROUND_PARTS``), ``plain``
    (tokens decoded without drafts while drafting paused: greedy,
    ``PAUSE_AFTER_MISSES``) and ``pauses``. ``draft_hook(tokens_so_far,
    drafts) -> drafts`` (a list of k tokens), where given, replaces each
    round's drafts (the head still runs: ``drafts`` is its output, an array
    not yet evaluated; they count as drawn from a point mass): the tests' and
    the bench's oracle (always accepted) and adversarial (never) drafts."""
    head = mtp.head_of(model)
    if head is None:
        raise ValueError(NO_HEAD)
    k = int(num_draft_tokens)
    if not 1 <= k <= MAX_DRAFT:
        raise ValueError(f"num_draft_tokens must be 1 to {MAX_DRAFT}, got {k}")
    kind = mtp_sampling.kind_of(sampler)
    max_tokens = max_tokens if max_tokens >= 0 else float("inf")  # -1: no limit, as mlx-lm
    cache = prompt_cache if prompt_cache is not None else make_prompt_cache(model)
    head_cache = [KVCache() for _ in head.layers]
    embed = model.language_model.model.embed_tokens
    stats = stats if stats is not None else {}
    stats.update(rounds=0, accepted=0, plain=0, pauses=0, checks=0)
    # The tokens fed to the model before the current call (for the logits
    # processors, which see these and the call's own up to each row, as
    # generate_step's ``tokens``).
    history = prompt.astype(mx.uint32)[:-1] if logits_processors else None

    def process(logits: mx.array, fed: mx.array) -> mx.array:
        """[S, V] logits of the S positions fed ``fed`` [S] -> log-probs, each
        row through the processors with the tokens up to its own."""
        if logits_processors:
            rows = []
            for i in range(logits.shape[0]):
                row = logits[i : i + 1]
                seen = mx.concatenate([history, fed[: i + 1]])
                for processor in logits_processors:
                    row = processor(seen, row)
                rows.append(row)
            logits = mx.concatenate(rows, axis=0)
        # As mlx-lm's samplers see them; its greedy sampler takes the argmax
        # of these (in bf16 a tie here need not be one in the logits).
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True)

    def draft(hidden: mx.array, next_tokens: mx.array, count: int = k) -> Tuple[mx.array, Optional[mx.array]]:
        """The head over the new verified positions (hidden [1, S, D], the
        tokens after them [S]), then ``count`` drafts [count] and, for a
        ``Sampler``, the distributions q [count, V] they were drawn from; its
        entries past the verified positions (count - 1) are trimmed again
        after the round."""
        if kind != "distribution":
            drafts = _greedy_drafts(model, hidden, next_tokens, head_cache, count, cache)
            if drafts is not None:
                return drafts, None
        g = head(hidden, embed(next_tokens[None]), head_cache)[:, -1:]
        drafts, qs = [], []
        for j in range(count):
            logits = _head_logits(model, g, cache)[0]  # [1, V], on the head GEMV as a decode step's
            if kind == "distribution":
                q = sampler.probs(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
                d = mtp_sampling.draw(q)
                qs.append(q)
            else:
                d = mx.argmax(logits, axis=-1)
            drafts.append(d)
            if j + 1 < count:
                g = head(g, embed(d[None]), head_cache)
        return mx.concatenate(drafts).astype(mx.uint32), (mx.concatenate(qs) if qs else None)

    def accept(logprobs: mx.array, drafts: mx.array, q: Optional[mx.array],
               targets: Optional[mx.array]) -> Tuple[int, int]:
        """The round's accepted count n and the token after them (greedy: the
        model's ``targets``, evaluated with the round)."""
        d = drafts.tolist()
        if kind == "greedy":
            return mtp_sampling.point_mass_step(targets.tolist(), d)
        if kind == "opaque":
            return mtp_sampling.point_mass_step(sampler(logprobs).tolist(), d)
        if q is None:  # the hook's drafts: a point mass each
            q = (mx.arange(logprobs.shape[-1])[None] == drafts[:, None]).astype(mx.float32)
        return mtp_sampling.rejection_step(sampler.probs(logprobs), q, drafts)

    try:
        tokens = prompt.astype(mx.uint32)
        # As generate_step: the prompt but its last token in chunks, then the
        # last token alone (the same bits for the first generated token).
        # The head's prompt (position t pairs h_t with token t + 1) goes with
        # each chunk: every pair but the last is known before the first
        # token, so the head's share of the prompt is prompt work (in the
        # time to the first token, in the same bounded chunks), not the
        # first round's.
        while tokens.size > 1:
            n = min(prefill_step_size, tokens.size - 1)
            chunk = _hidden(model, tokens[:n], cache)
            fed = head(chunk, embed(tokens[1 : n + 1][None]), head_cache)
            mx.eval(chunk, fed, [c.state for c in cache])
            tokens = tokens[n:]
        last = _hidden(model, tokens, cache)
        logits = _head_logits(model, last, cache)
        logprobs = process(logits[0, -1:], tokens[-1:])
        x = (sampler or greedy_sampler)(logprobs)[0].astype(mx.uint32)
        logprobs = logprobs[0]
        mx.eval(x)
        ntoks = 1
        yield int(x), logprobs, False
        if ntoks >= max_tokens:
            return
        if history is not None:
            history = prompt.astype(mx.uint32)
        # Greedy rounds are pipelined: after a round that kept all its drafts,
        # the next round is built and submitted, as if every draft of the
        # current one is kept, before the current one's accepted count is
        # read; a rejection backs out of it (its k + 1 positions), so the
        # caches go back up to 2k + 1 tokens. After any other round the next
        # is built once the count is known (a round backed out still runs on
        # the GPU). They also pause drafting while it does not pay
        # (PAUSE_AFTER_MISSES).
        pipelined = kind == "greedy" and not logits_processors
        # Trimmable after the prompt: its calls run whole, as generate_step's.
        make_trimmable(cache, depth=2 * (k + 1) if pipelined else k + 1)
        timing = stats.get("seconds")  # where given: the host's time per part of the rounds

        def build(verified: mx.array, after: mx.array, x: mx.array, done: int) -> _Round:
            """A round after ``done`` tokens: the head's drafts from the
            verified positions ``verified`` and the tokens after them
            (submitted), then the verify pass over ``x`` and the drafts (the
            model's caches advance k + 1; the head keeps its entries for the
            verified positions only)."""
            t0 = time.perf_counter()
            drafts, q = draft(verified, after)
            # The head runs on the GPU while the host builds the verify pass.
            mx.async_eval(drafts)
            if draft_hook is not None:  # the head still runs (its cost counts)
                drafts, q = mx.array(draft_hook(done, drafts), dtype=mx.uint32), None
            for c in head_cache:  # its entries for d_2..d_k, drafted from its own outputs
                c.trim(k - 1)
            t1 = time.perf_counter()
            ys = mx.concatenate([x[None], drafts])
            out, logits = _verify(model, ys, cache)  # [1, k + 1, D], [k + 1, V]
            logprobs = process(logits, ys)
            targets = mx.argmax(logprobs, axis=-1) if kind == "greedy" else None
            if timing is not None:
                timing["draft"] = timing.get("draft", 0.0) + t1 - t0
                timing["verify_build"] = timing.get("verify_build", 0.0) + time.perf_counter() - t1
            return _Round(ys, drafts, q, out, logprobs, targets, int(verified.shape[1]))

        def back_out() -> None:
            """Undo the round built ahead: its k + 1 positions in the model's
            caches and its verified entries in the head's."""
            for c in cache:
                c.trim(k + 1)
            for c in head_cache:
                c.trim(k + 1)

        def back_out_probe(probe: _Round) -> None:
            """Undo a probe round built on a pause's last token: its k + 1
            positions in the model's caches, its verified positions (all
            but the drafts, which ``build`` trimmed) in the head's."""
            for c in cache:
                c.trim(k + 1)
            for c in head_cache:
                c.trim(probe.head_positions)

        def check_draft(hidden: mx.array, next_tokens: mx.array, done: int) -> Any:
            """While drafting pauses: the head takes verified positions
            (hidden [1, S, D], the tokens after them [S]) and drafts the
            token after them, token ``done`` (its first draft, queued, not
            read; the hook's draft where there is one: a list)."""
            drafts, _ = draft(hidden, next_tokens, 1)
            mx.async_eval(drafts)
            return draft_hook(done, drafts) if draft_hook is not None else drafts

        def plain_step(x: mx.array) -> Tuple[mx.array, mx.array, mx.array]:
            """generate_step's greedy decode step on the pending token x (the
            model's call, as ``LilyLanguageModel.__call__`` makes it): the
            final hidden state [1, 1, D] (the head's position), the log-probs
            [V] and the next token."""
            out = _hidden(model, x[None], cache)
            logprobs = process(_head_logits(model, out, cache)[0], x[None])
            return out, logprobs[0], mx.argmax(logprobs, axis=-1)[0].astype(mx.uint32)

        # The prompt's last position, paired with the first generated token.
        verified, after = last, x[None]
        current = build(verified, after, x, ntoks)
        full, misses = True, 0
        while True:
            ahead = None
            if pipelined and full:
                mx.async_eval(current.logprobs, current.targets)
                ahead = build(current.out, mx.concatenate([current.drafts, current.targets[k:]]),
                              current.targets[k], ntoks + k + 1)
                t0 = time.perf_counter()
                mx.async_eval(ahead.logprobs, ahead.targets)
                if timing is not None:
                    timing["submit"] = timing.get("submit", 0.0) + time.perf_counter() - t0
            t0 = time.perf_counter()
            mx.eval(current.logprobs, current.drafts, current.targets)
            t1 = time.perf_counter()
            n, last = accept(current.logprobs, current.drafts, current.q, current.targets)
            emitted = current.drafts.tolist()[:n] + [last]
            stats["rounds"] += 1
            stats["accepted"] += n
            full, misses = n == k, (misses + 1 if n == 0 else 0)
            if ahead is not None and n < k:  # built on a draft the model rejected
                back_out()
                ahead = None
            # Back k - n tokens: the model keeps x, d_1..d_n.
            for c in cache:
                c.trim(k - n)
            if timing is not None:
                timing["wait"] = timing.get("wait", 0.0) + t1 - t0
                timing["accept"] = timing.get("accept", 0.0) + time.perf_counter() - t1
            for i in range(n + 1):
                ntoks += 1
                try:
                    yield emitted[i], current.logprobs[i], i < n
                except GeneratorExit:
                    _end(cache, ahead, n - i, back_out)
                    raise
                if ntoks >= max_tokens:
                    _end(cache, ahead, n - i, back_out)
                    return
            if ahead is not None:
                current = ahead
                continue
            if history is not None:
                history = mx.concatenate([history, current.ys[: n + 1]])
            verified, after = current.out[:, : n + 1], mx.array(emitted, dtype=mx.uint32)
            probe = None
            if pipelined and misses >= PAUSE_AFTER_MISSES:
                # Drafting paused: plain steps, each built and submitted
                # before the token before it is read. The head takes their
                # positions k + 1, then 2(k + 1), 4(k + 1), ... at a time,
                # up to PAUSE_WIDTH_MAX (one call per position would cost a
                # call's host work each; a catch-up call over a whole pause
                # would exceed the head's rows path), each call queued
                # before the next step and drafting the plain token it
                # precedes (a check, read once that token is out). A check
                # whose draft is the model's token ends the pause after one
                # more plain token; the positions left then open the next
                # round, with the last. That round (the probe) is built on
                # the last plain token before it is read, as a plain step
                # would be: the GPU runs it while the host yields.
                stats["pauses"] += 1
                held = [(verified, after)]  # positions the head has not taken yet
                width = k + 1  # the positions of the pause's next head call
                step = plain_step(after[-1])
                mx.async_eval(step[1], step[2])
                last, first = False, True
                while True:
                    out, logprobs, y = step
                    if not first:
                        held.append((verified, after))
                    check = None
                    if sum(h.shape[1] for h, _ in held) >= width:
                        check = check_draft(mx.concatenate([h for h, _ in held], axis=1),
                                            mx.concatenate([t for _, t in held]), ntoks)
                        held = []
                        width = min(2 * width, PAUSE_WIDTH_MAX)
                    upcoming = None if last else plain_step(y)
                    if upcoming is not None:
                        mx.async_eval(upcoming[1], upcoming[2])
                    verified, after = out, y[None]
                    ntoks += 1
                    stats["plain"] += 1
                    if upcoming is None and ntoks < max_tokens:
                        probe = build(mx.concatenate([h for h, _ in held] + [verified], axis=1),
                                      mx.concatenate([t for _, t in held] + [after]), y, ntoks)
                        t0 = time.perf_counter()
                        mx.async_eval(probe.logprobs, probe.targets)
                        if timing is not None:
                            timing["submit"] = timing.get("submit", 0.0) + time.perf_counter() - t0
                    token = int(y)
                    try:
                        yield token, logprobs, False
                    except GeneratorExit:
                        _end(cache, None, int(upcoming is not None), back_out)
                        if probe is not None:
                            back_out_probe(probe)
                        raise
                    if ntoks >= max_tokens:
                        _end(cache, None, int(upcoming is not None), back_out)
                        return
                    if upcoming is None:
                        break
                    if check is not None:
                        # The head's call ran before the step now running;
                        # read as it is (an op on it would queue behind that step).
                        stats["checks"] += 1
                        last = (check if isinstance(check, list) else check.tolist())[0] == token
                    step, first = upcoming, False
                # The round that follows tries the head again: one more miss
                # pauses again.
                misses, full = PAUSE_AFTER_MISSES - 1, False
            current = probe if probe is not None else build(verified, after, after[-1], ntoks)
    finally:
        make_plain(cache)


# ------------------------------------------------ mlx-lm's generate_step, drafting

_stock_generate_step = None
# The commands' --mtp (``mlx_lily.mtp_cli``): drafts per round for every lily
# model with a head that generate_step meets; None: off.
cli_draft_tokens: Optional[int] = None
# generate_step's options the MTP loop does not take: a call with one decodes
# without drafts (with a notice).
_UNSUPPORTED = ("input_embeddings", "max_kv_size", "kv_bits")
_DROPPED = _UNSUPPORTED + ("kv_group_size", "quantized_kv_start", "prompt_progress_callback")


def _drafts_for(prompt: mx.array, model: Any, k: Optional[int], kwargs: dict) -> int:
    """The drafts per round for this call of generate_step; 0: none."""
    from ._notice import notice_once
    from .trimmable_cache import is_lily_model

    if not k or not is_lily_model(model) or prompt.size == 0:
        return 0
    if mtp.head_of(model) is None:
        notice_once("mtp-no-head", "--mtp: " + NO_HEAD.replace("the model has", "this checkpoint has")
                    + "; decoding without drafts")
        return 0
    unsupported = [name for name in _UNSUPPORTED if kwargs.get(name) is not None]
    if unsupported:
        notice_once(f"mtp-{unsupported}", f"--mtp: decoding without drafts (not with {', '.join(unsupported)})")
        return 0
    if k > MAX_DRAFT:
        notice_once("mtp-k", f"--mtp: {MAX_DRAFT} drafts per round at most; drafting {MAX_DRAFT}, not {k}")
    return min(int(k), MAX_DRAFT)


def generate_step(prompt: mx.array, model: Any, *args: Any, mtp_draft_tokens: Optional[int] = None,
                  **kwargs: Any):
    """mlx-lm's ``generate_step``, drafting with the MTP head where asked
    (``mtp_draft_tokens``, else the commands' --mtp) and the model has one;
    yields (token, logprobs) as stock does."""
    k = _drafts_for(prompt, model, mtp_draft_tokens if mtp_draft_tokens is not None else cli_draft_tokens, kwargs)
    if not k:
        yield from _stock_generate_step(prompt, model, *args, **kwargs)
        return
    from mlx_lm.generate import generation_stream

    stream = args[0] if args else kwargs.pop("stream", generation_stream)
    progress = kwargs.get("prompt_progress_callback") or (lambda *_: None)
    for name in _DROPPED:
        kwargs.pop(name, None)
    progress(0, prompt.size)
    with mx.stream(stream):
        for i, (token, logprobs, _) in enumerate(mtp_generate_step(prompt, model, num_draft_tokens=k, **kwargs)):
            if i == 0:
                progress(prompt.size, prompt.size)
            yield token, logprobs


def install() -> None:
    """Put ``generate_step`` in place of mlx-lm's (``mlx_lm.generate``'s
    module global); idempotent. Calls without drafts pass through to stock."""
    global _stock_generate_step
    from ._patches import program_module

    # At model load: the program's own module (``python -m mlx_lm.generate``'s __main__).
    generate = program_module("mlx_lm.generate")
    current = generate.generate_step
    if getattr(current, "_lily_mtp", False):
        return
    _stock_generate_step = current
    generate_step._lily_mtp = True
    generate.generate_step = generate_step


def mtp_stream_generate(model: Any, tokenizer: Any, prompt: Any, num_draft_tokens: int = 1, **kwargs: Any):
    """``mlx_lm.stream_generate`` (same arguments, the same GenerationResponses)
    drafting ``num_draft_tokens`` per round with the model's MTP head (a
    model without one decodes without drafts, after one notice)."""
    from mlx_lm.generate import stream_generate

    install()
    yield from stream_generate(model, tokenizer, prompt, mtp_draft_tokens=num_draft_tokens, **kwargs)


def mtp_generate(model: Any, tokenizer: Any, prompt: Any, num_draft_tokens: int = 1, **kwargs: Any) -> str:
    """``mlx_lm.generate`` (same arguments, e.g. ``verbose``, ``sampler``,
    ``max_tokens``), drafting with the model's MTP head."""
    from mlx_lm.generate import generate

    install()
    return generate(model, tokenizer, prompt, mtp_draft_tokens=num_draft_tokens, **kwargs)
