"""A Gated DeltaNet cache that can go back a few tokens, for speculative decoding.

mlx-lm's speculative loop (``mlx_lm.generate.speculative_generate_step``, used
by ``--draft-model``) runs the model over the last token and the draft's k
tokens in one call, then ``trim_prompt_cache``s the tokens it rejected. A KV
cache trims by moving its offset back; a Gated DeltaNet layer's
``ArraysCache`` holds one fixed-size state (the convolution's last rows and
the recurrent state) and cannot, so stock refuses the loop for this family.

``TrimmableArraysCache`` keeps, for each of the last ``depth`` tokens, the
state it had before that token: references to the arrays the layer replaced
(MLX arrays are immutable, so nothing is copied), taken in ``__setitem__`` and
``advance`` whatever path wrote the state (lily's compiled decode step, its
fused or unfused layer, stock's code). ``trim(n)`` puts back the state from n
tokens ago. For a call of several tokens to leave a state per token, lily's
Gated DeltaNet layer runs such a call one token at a time when its cache
``keeps_steps`` (up to ``depth + 1`` tokens; longer calls, prompts, are run
whole and cannot be trimmed into). Each token then runs as it does in a
decode step alone, so a trimmed cache is the cache a run that never drafted
would hold. On lily's kernels the verify call is instead lily's verification
pass (``layers/verify_step.py``: each position on the decode kernels, the
states after each handed over by ``push_steps``); the wrapper below gives
mlx-lm's loop lily's model as a ``VerifyingModel`` for that.

It costs only where it is installed: ``install()`` (called by
``mlx_lily.enable()``) wraps mlx-lm's speculative loop so that, for lily's
models, the loop's caches are made trimmable for its duration (``depth``: its
``num_draft_tokens``) and plain ``ArraysCache`` again when it ends (the
server keeps them in its prompt cache, which treats trimmable caches as
trimmable by any amount). Normal decoding never sees this class.
"""

from __future__ import annotations

import functools
from typing import Any, List, Optional

from mlx_lm.models.cache import ArraysCache

# Tokens a cache can go back when nobody says (stock's num_draft_tokens
# default is 2; the verify call is one longer).
DEFAULT_DEPTH = 4


class TrimmableArraysCache(ArraysCache):
    def __init__(self, size: int = 2, depth: int = DEFAULT_DEPTH, left_padding: Optional[List[int]] = None):
        super().__init__(size, left_padding=left_padding)
        self.depth = depth
        # The state before each of the last len(_past) tokens, oldest first.
        self._past: List[tuple] = []
        # The state before the writes of the call in progress (None: no write yet).
        self._before: Optional[tuple] = None

    @classmethod
    def of(cls, cache: ArraysCache, depth: int = DEFAULT_DEPTH) -> "TrimmableArraysCache":
        """A trimmable cache holding ``cache``'s arrays (not copied)."""
        new = cls(len(cache.cache), depth)
        new.cache = list(cache.cache)
        new.left_padding, new.lengths = cache.left_padding, cache.lengths
        return new

    def plain(self) -> ArraysCache:
        """A stock ArraysCache holding this cache's arrays."""
        plain = ArraysCache(len(self.cache))
        plain.cache = list(self.cache)
        plain.left_padding, plain.lengths = self.left_padding, self.lengths
        return plain

    def __setitem__(self, idx, value):
        if self._before is None:
            self._before = tuple(self.cache)
        self.cache[idx] = value

    def advance(self, N):
        super().advance(N)
        before, self._before = self._before, None
        if before is not None and N == 1:
            self._past.append(before)
            del self._past[: -self.depth]
        else:
            # Several tokens at once (a prompt): no state inside the call was
            # kept, so nothing before its end can be restored.
            self._past.clear()

    def push_stacked(self, convs: Any, states: Any) -> None:
        """``push_steps`` for the states after each of P tokens given stacked,
        [P, ...] each (lily's verification pass gives them so): the cache
        holds the last position's, and a position's state before the last is
        sliced out only if ``trim`` goes back to it. (A pass's slices were a
        graph node each, 2P a layer a round, where 2 are read.)"""
        P = convs.shape[0]
        if self.lengths is not None or self.left_padding is not None:
            self.push_steps([(convs[p:p + 1], states[p:p + 1]) for p in range(P)])
            return
        rest = tuple(self.cache[2:])
        self._past.append(tuple(self.cache))
        self._past.extend(_StepState(convs, states, p, rest) for p in range(P - 1))
        self.cache = [convs[P - 1:], states[P - 1:], *rest]
        del self._past[: -self.depth]
        self._before = None

    def push_steps(self, states: List[tuple]) -> None:
        """Take the states after each of several tokens, in order (lily's
        verification pass, ``layers/verify_step.py``, computes them): each
        token's state before it is kept, as ``advance(1)`` keeps it."""
        if self.lengths is not None or self.left_padding is not None:
            for conv, state in states:
                self._before = None
                self[0], self[1] = conv, state
                self.advance(1)
            return
        # One stream's cache (the pass's): what the loop above does, without
        # its per-token calls (a round pushes P states into 30 layers).
        for conv, state in states:
            self._past.append(tuple(self.cache))
            self.cache = [conv, state, *self.cache[2:]]
        del self._past[: -self.depth]
        self._before = None

    def keeps_steps(self, tokens: int) -> bool:
        """Whether a call of ``tokens`` tokens should run one token at a
        time, leaving a state per token (lily's Gated DeltaNet asks)."""
        return 1 < tokens <= self.depth + 1 and self.lengths is None and self.left_padding is None

    def is_trimmable(self) -> bool:
        return True

    def trimmable_tokens(self) -> int:
        return len(self._past)

    def trim(self, n: int) -> int:
        if n <= 0:
            return 0
        if n > len(self._past):
            raise ValueError(
                f"a Gated DeltaNet cache can go back {len(self._past)} token(s) here, not {n} (it keeps the "
                f"states of the last {self.depth} tokens decoded one call at a time or in calls of at most "
                f"{self.depth + 1} tokens)"
            )
        self.cache = list(self._past[-n])
        del self._past[-n:]
        self._before = None
        return n

    # Whole-state changes forget the history.
    @ArraysCache.state.setter
    def state(self, v):
        self.cache, self.left_padding, self.lengths = v
        self._past, self._before = [], None

    def filter(self, batch_indices):
        super().filter(batch_indices)
        self._past, self._before = [], None

    def extend(self, other):
        super().extend(other)
        self._past, self._before = [], None


class _StepState:
    """A cache's arrays after position ``p`` of a verification pass, read
    from its stacked outputs when iterated (``trim`` going back to it)."""

    __slots__ = ("convs", "states", "p", "rest")

    def __init__(self, convs: Any, states: Any, p: int, rest: tuple):
        self.convs, self.states, self.p, self.rest = convs, states, p, rest

    def __iter__(self):
        return iter((self.convs[self.p:self.p + 1], self.states[self.p:self.p + 1], *self.rest))


# The cache types lily's Gated DeltaNet reads and writes itself.
LILY_ARRAYS_CACHES = (ArraysCache, TrimmableArraysCache)


def make_trimmable(caches: List[Any], depth: int = DEFAULT_DEPTH) -> None:
    """Replace, in place, each plain single-sequence ArraysCache of ``caches``
    with a TrimmableArraysCache holding the same arrays."""
    for i, c in enumerate(caches):
        if type(c) is ArraysCache and c.lengths is None and c.left_padding is None:
            caches[i] = TrimmableArraysCache.of(c, depth)
        elif type(c) is TrimmableArraysCache:
            c.depth = max(c.depth, depth)


def make_plain(caches: List[Any]) -> None:
    """Undo ``make_trimmable`` in place (the arrays are kept)."""
    for i, c in enumerate(caches):
        if type(c) is TrimmableArraysCache:
            caches[i] = c.plain()


def is_lily_model(model: Any) -> bool:
    from .models.qwen3_5_moe import Model

    return isinstance(model, Model)


_stock_speculative = None


def speculative_generate_step(prompt, model, draft_model, *args, prompt_cache=None, **kwargs):
    """mlx-lm's ``speculative_generate_step``, with lily's models' Gated
    DeltaNet caches trimmable while it runs."""
    from mlx_lm.models.cache import make_prompt_cache

    lily = [is_lily_model(model), is_lily_model(draft_model)]
    if not any(lily):
        yield from _stock_speculative(prompt, model, draft_model, *args, prompt_cache=prompt_cache, **kwargs)
        return
    if prompt_cache is None:
        prompt_cache = make_prompt_cache(model) + make_prompt_cache(draft_model)
    depth = max(int(kwargs.get("num_draft_tokens", 2)), 1) + 1
    n_model = len(model.layers)
    parts = [prompt_cache[:n_model], prompt_cache[n_model:]]
    for part, is_lily in zip(parts, lily):
        if is_lily:
            make_trimmable(part, depth)
    prompt_cache[:] = parts[0] + parts[1]  # in place: the caller's list is the loop's
    if lily[0]:
        # The verify calls on the decode kernels where they take them
        # (layers/verify_step.py): each position the bits of a decode step.
        from .layers.verify_step import VerifyingModel

        model = VerifyingModel(model, prompt.size - 1)
    try:
        yield from _stock_speculative(prompt, model, draft_model, *args, prompt_cache=prompt_cache, **kwargs)
    finally:
        make_plain(prompt_cache)


def _generate_module():
    # Not ``import mlx_lm.generate``: the package's ``generate`` attribute
    # is the function of that name.
    import importlib

    return importlib.import_module("mlx_lm.generate")


def install(generate: Any = None) -> None:
    """Wrap mlx-lm's speculative loop (``mlx_lm.generate``'s module global,
    which ``stream_generate`` calls; or ``generate``'s: the program's own
    module, ``__main__`` under ``python -m mlx_lm.generate``, which the
    backend wraps too once the model loads); idempotent."""
    global _stock_speculative
    generate = generate if generate is not None else _generate_module()

    current = generate.speculative_generate_step
    if getattr(current, "_lily", False):
        return
    _stock_speculative = current
    wrapped = functools.wraps(current)(speculative_generate_step)
    wrapped._lily = True
    generate.speculative_generate_step = wrapped


def uninstall() -> None:
    generate = _generate_module()

    if getattr(generate.speculative_generate_step, "_lily", False) and _stock_speculative is not None:
        generate.speculative_generate_step = _stock_speculative
