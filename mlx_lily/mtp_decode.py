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
(``mlx_lily.trimmable_cache``): the verify call runs them a token at a time,
each as a decode step alone, so a rejection puts back the state of the last
kept token without recomputing it, and the KV caches move their offsets back.

The head keeps its own KV cache, one entry per position of the model's
verified tokens: position t holds (h_t, x_{t+1}), h_t the model's final
(normed) hidden state. After a round the head sees the n + 1 new verified
positions in one call, whose last output drafts the next round's d_1; its
entries for d_2..d_k (drafted from its own outputs) are trimmed.

Greedy only: the emitted tokens are the model's greedy tokens (the argmax at
every position), so the output is ``mlx_lm.generate_step``'s greedy output
token for token, where the model's verify call gives each position the bits
a decode step alone gives it (lily's reference path does; see
docs/speculative.md for kernels).
"""

from __future__ import annotations

from typing import Any, Callable, Generator, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.cache import KVCache, make_prompt_cache

from . import mtp
from .trimmable_cache import make_plain, make_trimmable

MAX_DRAFT = 3


def _head_logits(model: Any, hidden: mx.array, cache: Any = None) -> mx.array:
    """The language model's head on final hidden states, as its own call."""
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


def mtp_generate_step(
    prompt: mx.array,
    model: Any,
    *,
    num_draft_tokens: int = 1,
    max_tokens: int = 256,
    prompt_cache: Optional[List[Any]] = None,
    prefill_step_size: int = 2048,
    stats: Optional[dict] = None,
    draft_hook: Optional[Callable[[int, List[int]], List[int]]] = None,
) -> Generator[Tuple[int, mx.array, bool], None, None]:
    """Yield (token, logprobs, from_draft) as ``speculative_generate_step``
    does, drafting with ``model``'s MTP head. ``prompt_cache``: the model's
    caches (``make_prompt_cache(model)``; updated in place: when the
    generator ends they hold the prompt and every token yielded but the
    last). ``stats``, where given, gets ``rounds`` and ``accepted``.
    ``draft_hook(tokens_so_far, drafts) -> drafts``, where given, replaces
    each round's drafts (the head still runs): the tests' and the bench's
    oracle (always accepted) and adversarial (never) drafts."""
    head = mtp.head_of(model)
    if head is None:
        raise ValueError("the model has no MTP head (its checkpoint has no mtp.* tensors; "
                         "python -m mlx_lily graft-mtp adds one)")
    k = int(num_draft_tokens)
    if not 1 <= k <= MAX_DRAFT:
        raise ValueError(f"num_draft_tokens must be 1 to {MAX_DRAFT}, got {k}")
    cache = prompt_cache if prompt_cache is not None else make_prompt_cache(model)
    make_trimmable(cache, depth=k + 1)
    head_cache = [KVCache() for _ in head.layers]
    embed = model.language_model.model.embed_tokens
    stats = stats if stats is not None else {}
    stats.update(rounds=0, accepted=0)

    def argmax_and_logprobs(logits: mx.array):
        # As mlx-lm's greedy sampler: the argmax of the log-probabilities (in
        # bf16 a tie there need not be one in the logits).
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return mx.argmax(logprobs, axis=-1), logprobs

    def draft(hidden: mx.array, next_tokens: mx.array) -> List[int]:
        """The head over the new verified positions (hidden [1, S, D], the
        tokens after them [S]), then k drafts; its entries past the verified
        positions are trimmed again in ``rounds``."""
        g = head(hidden, embed(next_tokens[None]), head_cache)[:, -1:]
        drafts = []
        for j in range(k):
            d = mx.argmax(_head_logits(model, g), axis=-1)  # [1, 1]
            drafts.append(d)
            if j + 1 < k:
                g = head(g, embed(d), head_cache)
        return mx.concatenate(drafts, axis=1)[0]

    try:
        tokens = prompt.astype(mx.uint32)
        # As generate_step: the prompt but its last token in chunks, then the
        # last token alone (the same bits for the first generated token).
        hidden = []
        while tokens.size > 1:
            n = min(prefill_step_size, tokens.size - 1)
            hidden.append(_hidden(model, tokens[:n], cache))
            mx.eval(hidden[-1], [c.state for c in cache])
            tokens = tokens[n:]
        hidden.append(_hidden(model, tokens, cache))
        logits = _head_logits(model, hidden[-1][:, -1:], cache)
        x, logprobs = argmax_and_logprobs(logits[0, -1])
        mx.eval(x)
        ntoks = 1
        yield int(x), logprobs, False
        if ntoks >= max_tokens:
            return
        # The head's prompt: position t pairs h_t with token t + 1.
        verified = mx.concatenate(hidden, axis=1)
        after = mx.concatenate([prompt.astype(mx.uint32)[1:], x[None]])
        while True:
            drafts = draft(verified, after)
            if draft_hook is not None:
                drafts = mx.array(draft_hook(ntoks, drafts.tolist()), dtype=mx.uint32)
            ys = mx.concatenate([x[None], drafts])
            out = _hidden(model, ys, cache)  # [1, k + 1, D]
            logits = _head_logits(model, out)[0]
            targets, logprobs = argmax_and_logprobs(logits)
            mx.eval(targets, drafts)
            t, d = targets.tolist(), drafts.tolist()
            n = 0
            while n < k and d[n] == t[n]:
                n += 1
            stats["rounds"] += 1
            stats["accepted"] += n
            # Back k - n tokens: the model keeps x, d_1..d_n; the head drops
            # its entries for d_2..d_k.
            for c in cache:
                c.trim(k - n)
            for c in head_cache:
                c.trim(k - 1)
            for i in range(n + 1):
                ntoks += 1
                yield t[i], logprobs[i], i < n
                if ntoks >= max_tokens:
                    # The caches hold what was yielded but its last token.
                    for c in cache:
                        c.trim(n - i)
                    return
            x = targets[n]
            verified = out[:, : n + 1]
            after = targets[: n + 1]
    finally:
        make_plain(cache)
