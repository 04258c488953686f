"""Speculative rejection sampling for the MTP loop (``mlx_lily.mtp_decode``).

With a sampler the loop keeps the output distribution of plain sampling
(``mlx_lm.generate_step`` with the same sampler) exactly. The head drafts d_i
from its own distribution q_i (the head's logits through the same sampling
transform: temperature, top-p, min-p, top-k), the model verifies, and at
verified position i, with p_i the model's distribution there:

    accept d_i with probability min(1, p_i(d_i) / q_i(d_i));
    at the first rejection emit a token drawn from normalize(max(0, p_i - q_i))
    and stop; if all k are accepted, emit a token drawn from p_k (the bonus).

Each emitted token is then distributed as p given the tokens before it,
whatever q is (Leviathan et al. 2023, Chen et al. 2023: the standard scheme).

Which distribution a sampler draws from: mlx-lm's ``make_sampler`` returns a
plain function, so lily's ``make_sampler`` (same arguments, same draws when
called) returns a ``Sampler`` that also says its distribution
(``Sampler.probs``). A sampler that cannot say (a custom function, XTC,
whose filter is itself random) is still served exactly: the head drafts its
argmax (q a point mass) and a draft is accepted when the model's own draw
with that sampler equals it, which is the rule above for a point-mass q.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import mlx.core as mx
from mlx_lm import sample_utils
from mlx_lm.sample_utils import greedy_sampler


class Sampler:
    """A sampler as mlx-lm's ``make_sampler`` makes it (calling it draws as
    mlx-lm's does), which also gives the distribution it draws from."""

    def __init__(self, temp: float, top_p: float = 0.0, min_p: float = 0.0,
                 min_tokens_to_keep: int = 1, top_k: int = 0):
        if temp <= 0:
            raise ValueError("a Sampler samples (temp > 0); temp 0 is mlx-lm's greedy_sampler")
        self.temp, self.top_p, self.min_p = float(temp), float(top_p), float(min_p)
        self.min_tokens_to_keep, self.top_k = int(min_tokens_to_keep), int(top_k)
        self._stock = sample_utils.make_sampler(temp, top_p, min_p, min_tokens_to_keep, top_k=top_k)

    def __call__(self, logprobs: mx.array) -> mx.array:
        return self._stock(logprobs)

    def filtered(self, logprobs: mx.array) -> mx.array:
        """The log-probabilities after mlx-lm's filters, in its order."""
        if 0 < self.top_p < 1.0:
            logprobs = sample_utils.apply_top_p(logprobs, self.top_p)
        if self.min_p != 0.0:
            logprobs = sample_utils.apply_min_p(logprobs, self.min_p, self.min_tokens_to_keep)
        if self.top_k > 0:
            logprobs = sample_utils.apply_top_k(logprobs, self.top_k)
        return logprobs

    def probs(self, logprobs: mx.array) -> mx.array:
        """[..., V] log-probabilities -> the float32 distribution a call draws
        from (mlx-lm draws categorical(filtered / temp))."""
        return mx.softmax(self.filtered(logprobs).astype(mx.float32) / self.temp, axis=-1)

    def __repr__(self) -> str:
        return (f"Sampler(temp={self.temp}, top_p={self.top_p}, min_p={self.min_p}, "
                f"min_tokens_to_keep={self.min_tokens_to_keep}, top_k={self.top_k})")


def make_sampler(temp: float = 0.0, top_p: float = 0.0, min_p: float = 0.0, min_tokens_to_keep: int = 1,
                 top_k: int = 0, xtc_probability: float = 0.0, xtc_threshold: float = 0.1,
                 xtc_special_tokens: Optional[List[int]] = None) -> Callable[[mx.array], mx.array]:
    """``mlx_lm.sample_utils.make_sampler``'s arguments and draws; a
    ``Sampler`` (which says its distribution) wherever there is one to say:
    temp > 0 and no XTC. Otherwise mlx-lm's own sampler."""
    if temp == 0 or xtc_probability > 0.0:
        return sample_utils.make_sampler(temp, top_p, min_p, min_tokens_to_keep, top_k=top_k,
                                         xtc_probability=xtc_probability, xtc_threshold=xtc_threshold,
                                         xtc_special_tokens=xtc_special_tokens)
    return Sampler(temp, top_p, min_p, min_tokens_to_keep, top_k)


def kind_of(sampler: Optional[Callable]) -> str:
    """'greedy' (None or mlx-lm's greedy sampler), 'distribution' (a
    ``Sampler``: rejection sampling against the head's q) or 'opaque' (any
    other callable: point-mass drafts, accepted when the model's draw equals
    them)."""
    if sampler is None or sampler is greedy_sampler:
        return "greedy"
    if isinstance(sampler, Sampler):
        return "distribution"
    return "opaque"


def draw(probs: mx.array) -> mx.array:
    """One token per row of [..., V] probabilities (zeros never drawn)."""
    return mx.random.categorical(mx.log(probs), axis=-1)


def rejection_step(p: mx.array, q: mx.array, drafts: mx.array) -> Tuple[int, int]:
    """One round's acceptance. p [k + 1, V]: the model's distributions at the
    verified positions (position i is the model's distribution for the token
    after d_1..d_i); q [k, V]: the distributions d_1..d_k were drawn from;
    drafts [k]. Returns (n, token): the first n drafts are accepted and
    ``token`` follows them (from the residual at n < k, else the bonus from
    p_k). Consumes mx.random's global key as any mlx-lm sampler does."""
    k = drafts.shape[0]
    idx = drafts.astype(mx.int32)[:, None]
    p_d = mx.take_along_axis(p[:k], idx, axis=-1)[:, 0]
    q_d = mx.take_along_axis(q, idx, axis=-1)[:, 0]
    u = mx.random.uniform(shape=(k,))
    # u < p/q accepts with probability min(1, p/q); q_d > 0 for a drawn d.
    accepted = u * q_d < p_d
    residual = mx.maximum(p[:k] - q, 0.0)
    mass = residual.sum(axis=-1, keepdims=True)
    # A residual of no mass is never reached (rejection has probability 0
    # there); p itself keeps the draw defined.
    residual = mx.where(mass > 0, residual / mx.maximum(mass, 1e-30), p[:k])
    tokens = draw(mx.concatenate([residual, p[k:]], axis=0))
    mx.eval(accepted, tokens)
    acc = accepted.tolist()
    n = 0
    while n < k and acc[n]:
        n += 1
    return n, int(tokens.tolist()[n])


def point_mass_step(targets: List[int], drafts: List[int]) -> Tuple[int, int]:
    """Acceptance for point-mass drafts: ``targets`` [k + 1] are the model's
    own draws (its sampler at each verified position); d_i is accepted while
    it equals t_{i-1}; the token after the accepted ones is the model's draw
    there. For q = delta(d) this is ``rejection_step``'s law."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return n, targets[n]
