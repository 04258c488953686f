"""Gated DeltaNet (linear attention with a fixed-size recurrent state per head)."""

from __future__ import annotations

from typing import Any, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.qwen3_5 import GatedDeltaNet

from .. import kernels as K
from ..kernels.gated_delta.chunked import CHUNK, piece_end
from ..kernels.gated_delta.recurrence import CHUNKED_FROM
from ..kernels.gated_delta.rows import takes_rows
from ..toolchain.tracing import contiguous
from .prompt_rows import BatchedRows, packed_from_padded, padded_rows, split_rows
from .sharded import all_sum
from .stock_gate import runs_stock


def next_conv_state(conv_input: mx.array, n_keep: int, lengths: Optional[mx.array]) -> mx.array:
    """The last n_keep rows each batch entry's convolution saw: the call's last
    rows, or, with lengths (right-padded prompts), the rows before each entry's
    end, as stock keeps them."""
    if lengths is None:
        return contiguous(conv_input[:, -n_keep:, :])
    steps = conv_input.shape[1] - n_keep
    ends = mx.clip(lengths, 0, steps)
    positions = (ends[:, None] + mx.arange(n_keep))[..., None]
    return mx.take_along_axis(conv_input, positions, axis=1)


# The last mask padding_only read and its answer. One model call passes the
# same mask object to all its DeltaNet layers, so one read (a wait on the GPU)
# serves the call, not one per layer; holding the mask keeps its identity
# from being reused.
_last_read: list = [None, None]


def padding_only(mask: Optional[mx.array], steps: int) -> Optional[mx.array]:
    """None for a prompt chunk's mask that masks no step, else the mask.

    The server's batch generator passes its caches' padding mask with every
    call, a single unpadded request's too, and the chunked kernels take no
    mask (calls with one keep the sequential scan). An all-True mask changes
    nothing, so it is dropped; checking reads the mask, which depends only
    on the cache's padding (evaluated after each chunk), and only for calls
    long enough for the chunked kernels."""
    if mask is None or steps < CHUNKED_FROM:
        return mask
    if _last_read[0] is not mask:
        _last_read[:] = [mask, None if mx.all(mask).item() else mask]
    return _last_read[1]


def _never(tokens: int) -> bool:
    return False


# Padded tokens (rows times the longest row) of one batch of prompt rows at
# most: bounds the padded copies of the rows' activations.
ROWS_MAX_TOKENS = 8192


def _row_batches(rows: List[int], lengths: List[int]) -> List[List[int]]:
    """``rows`` in batches of two or more, longest first, each padded to its
    longest at most ROWS_MAX_TOKENS tokens; a row left alone is left out."""
    batches: List[List[int]] = []
    for r in sorted(rows, key=lambda r: -lengths[r]):
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= ROWS_MAX_TOKENS:
            batches[-1].append(r)
        else:
            batches.append([r])
    return [b for b in batches if len(b) > 1]


def _plain_prompt(cache: Any, steps: int) -> bool:
    """A packed row's cache runs the prompt path (no per-step states kept,
    no decode step): a plain ``ArraysCache`` of one row, more than one step."""
    return type(cache) is ArraysCache and cache.lengths is None and steps > 1


def wants_piece_state(cache: Any, steps: int) -> bool:
    """Whether this call keeps, on its cache, the DeltaNet states after its
    last whole chunk (``lily_piece_state``: position in the call, conv rows,
    recurrent state). Prefix reuse sets ``lily_capture`` on the caches of a
    prompt's chunk; a call ending on a chunk boundary has its end state."""
    return (getattr(cache, "lily_capture", False) and cache.lengths is None
            and steps > CHUNK and steps % CHUNK != 0)


class LilyGatedDeltaNet(GatedDeltaNet):
    def __call__(self, inputs: mx.array, mask: Optional[mx.array] = None, cache: Any = None):
        if runs_stock(self, "Gated DeltaNet", inputs, mask, cache, ArraysCache):
            return super().__call__(inputs, mask, cache)
        # Sharded (mlx-lm's shard()): the rank's heads give a partial sum of
        # the output projection, summed across the group where stock sums it.
        return all_sum(self._lily(inputs, mask, cache), self.sharding_group)

    def packed_rows(self, inputs: mx.array, lengths: List[int], masks: list, caches: list) -> mx.array:
        """Several sequences' prompt tokens, one after another in ``inputs``
        [1, sum(lengths), D], each on its own cache (``masks`` and
        ``caches``: one per row): the projections and the output norm over
        all rows' tokens at once (token-wise: a token's bits do not depend
        on what is packed with it, where the caller packs); the convolution
        and the recurrence on each row's state, as one right-padded batch
        for the rows that alone take the chunked passes (``_recur_rows``),
        alone for the others. The same as calling the layer on each row."""
        rows = split_rows(inputs, lengths)
        if any(runs_stock(self, "Gated DeltaNet", x, m, c, ArraysCache) for x, m, c in zip(rows, masks, caches)) \
                or not all(_plain_prompt(c, n) for c, n in zip(caches, lengths)):
            return mx.concatenate([self(x, m, c) for x, m, c in zip(rows, masks, caches)], axis=1)
        qkv, z, a, b = self._project(inputs)
        outs: list = [None] * len(lengths)
        # Rows that alone take the chunked passes run them together, right-
        # padded (gated_delta_rows); the others one at a time.
        together = [r for r, (n, m) in enumerate(zip(lengths, masks)) if m is None and n >= CHUNKED_FROM]
        for group in _row_batches(together, lengths):
            done = self._recur_rows(qkv, a, b, lengths, group, [caches[r] for r in group])
            if done is None:
                continue
            if len(group) == len(lengths):  # every row: back to packed order in one gather
                return all_sum(self._output(packed_from_padded(done, lengths, group), z), self.sharding_group)
            for slot, r in enumerate(group):
                outs[r] = done[slot:slot + 1, : lengths[r]]
        parts = list(zip(*(split_rows(t, lengths) for t in (qkv, a, b))))
        for r, (q_, a_, b_) in enumerate(parts):
            if outs[r] is None:
                outs[r] = self._recur(q_, a_, b_, masks[r], caches[r])
        return all_sum(self._output(mx.concatenate(outs, axis=1), z), self.sharding_group)

    def _recur_rows(self, qkv: mx.array, a: mx.array, b: mx.array, lengths: List[int], group: List[int],
                    caches: list) -> Optional[mx.array]:
        """``_recur`` of rows ``group`` of the packed call (qkv, a, b [1,
        sum(lengths), *]; ``caches``: the group's one-row caches) as one
        right-padded batch: the outputs [R, longest, Hv, Dv], row ``slot``
        of them group[slot]'s (as the row alone gets them up to its length),
        and each cache as the row alone leaves it; None (nothing done) where
        the rows' op would not give those bits."""
        n_keep = self.conv_kernel_size - 1
        qkv, a, b = (padded_rows(t, lengths, group) for t in (qkv, a, b))
        lengths = [lengths[r] for r in group]
        R = len(group)
        conv_state = mx.zeros((R, n_keep, self.conv_dim), qkv.dtype) if all(c[0] is None for c in caches) \
            else mx.concatenate([c[0] if c[0] is not None else mx.zeros((1, n_keep, self.conv_dim), qkv.dtype)
                                 for c in caches])
        held = [c[1] for c in caches]
        state = None if all(s is None for s in held) else mx.concatenate(
            [s if s is not None else mx.zeros((1, self.num_v_heads, self.head_v_dim, self.head_k_dim), mx.float32)
             for s in held])
        q, k, v = K.conv_qk_norm(
            qkv, conv_state, self.conv1d.weight, self.num_k_heads, self.num_v_heads,
            self.head_k_dim, self.head_v_dim,
        )
        args = (q, k, v, a, b, self.A_log, self.dt_bias, state, tuple(lengths))
        # Prefix reuse's checkpoints, for the rows that ask (as _recur keeps one).
        capture = any(wants_piece_state(c, n) for c, n in zip(caches, lengths))
        if not takes_rows(*args, capture=capture):
            return None
        out, state, *piece = K.gated_delta_rows(*args, capture=capture)
        # Each row's convolution rows end at its own length (as alone: the
        # last K-1 rows of [state; its tokens]).
        if min(lengths) >= n_keep:  # every row's last K-1 rows are its own tokens: no copy of the batch
            ends = (mx.array(lengths)[:, None] - n_keep + mx.arange(n_keep))[..., None]
            conv_next = mx.take_along_axis(qkv, ends, axis=1)
        else:
            conv_next = next_conv_state(mx.concatenate([conv_state, qkv], axis=1), n_keep, mx.array(lengths))
        for r, (c, n) in enumerate(zip(caches, lengths)):
            if wants_piece_state(c, n):
                cut = piece_end(n)
                c.lily_piece_state = (cut, qkv[r : r + 1, cut - n_keep : cut] * mx.array(1, qkv.dtype),
                                      piece[0][r : r + 1])
            c.advance(n)
        # Each cache its row of the batch's states; the batch's caches take
        # them back whole (prompt_rows.batched_entries).
        BatchedRows([conv_next, state]).hand_out(caches)
        return out

    def _project(self, inputs: mx.array):
        """The token-wise input projections: qkv [B, S, conv_dim], z [B, S,
        Hv, Dv], a and b [B, S, Hv]."""
        B, S, _ = inputs.shape
        qkv = self.in_proj_qkv(inputs)
        z = self.in_proj_z(inputs).reshape(B, S, self.num_v_heads, self.head_v_dim)
        return qkv, z, self.in_proj_a(inputs), self.in_proj_b(inputs)

    def _output(self, out: mx.array, z: mx.array) -> mx.array:
        """The recurrence's output [B, S, Hv, Dv] through the gated norm and
        the output projection."""
        B, S = out.shape[:2]
        out = K.gated_rms_norm(out, z, self.norm.weight, self.norm.eps)
        return self.out_proj(out.reshape(B, S, -1))

    def _lily(
        self, inputs: mx.array, mask: Optional[mx.array], cache: Optional[ArraysCache]
    ) -> mx.array:
        """mask [B, S] bool (padding steps False), from the batch generator's
        ArraysCache.make_mask; None when every step is real."""
        B, S, _ = inputs.shape
        if S > 1 and mask is None and getattr(cache, "keeps_steps", _never)(S):
            # A trimmable cache (speculative decoding, trimmable_cache.py)
            # keeps each token's state: the call runs a token at a time, each
            # as a decode step alone.
            return mx.concatenate([self._lily(inputs[:, t : t + 1], None, cache) for t in range(S)], axis=1)
        qkv, z, a, b = self._project(inputs)

        if mask is None and cache is not None and cache.lengths is None:
            step = self._decode_step(qkv, z, a, b, cache)
            if step is not None:
                return self.out_proj(step.reshape(B, S, -1))
        return self._output(self._recur(qkv, a, b, mask, cache), z)

    def _recur(self, qkv: mx.array, a: mx.array, b: mx.array, mask: Optional[mx.array],
               cache: Optional[ArraysCache]) -> mx.array:
        """The convolution and the gated delta rule over the call's steps,
        from and into the cache's states: the output [B, S, Hv, Dv]."""
        B, S, _ = qkv.shape
        mask = padding_only(mask, S)
        # Padding steps enter the convolution as zeros, as in stock.
        if mask is not None:
            qkv = mx.where(mask[..., None], qkv, 0)

        # The convolution sees the last K-1 rows of the previous call first.
        n_keep = self.conv_kernel_size - 1
        conv_state = cache[0] if cache is not None and cache[0] is not None else None
        if conv_state is None:
            conv_state = mx.zeros((B, n_keep, self.conv_dim), dtype=qkv.dtype)
        if cache is not None:
            # The rows the next call's convolution starts from: without
            # lengths the last K-1 of [state; qkv], so no copy of the chunk.
            tail = qkv if cache.lengths is not None else qkv[:, -n_keep:]
            cache[0] = next_conv_state(mx.concatenate([conv_state, tail], axis=1), n_keep, cache.lengths)
        q, k, v = K.conv_qk_norm(
            qkv, conv_state, self.conv1d.weight, self.num_k_heads, self.num_v_heads,
            self.head_k_dim, self.head_v_dim,
        )

        # Masked steps leave the recurrent state untouched.
        state = cache[1] if cache is not None else None
        if mask is None and wants_piece_state(cache, S):
            # Prefix reuse asked for the states after the call's last whole
            # chunk: a checkpoint a later prompt can resume from exactly.
            cut = piece_end(S)
            out, state, at_cut = K.gated_delta(q, k, v, a, b, self.A_log, self.dt_bias, state, None, capture=True)
            conv_at_cut = qkv[:, cut - n_keep : cut] * mx.array(1, qkv.dtype)  # a copy, not a view of qkv
            cache.lily_piece_state = (cut, conv_at_cut, at_cut)
        else:
            out, state = K.gated_delta(q, k, v, a, b, self.A_log, self.dt_bias, state, mask)
        if cache is not None:
            cache[1] = state
            cache.advance(S)
        return out

    def _decode_step(self, qkv, z, a, b, cache: ArraysCache) -> Optional[mx.array]:
        """One token of one sequence through ``gated_delta_decode`` (the whole
        step between the projections in one kernel), updating the cache; None
        (nothing done) when the op does not take the call."""
        conv_state = cache[0]
        if conv_state is None:
            n_keep = self.conv_kernel_size - 1
            conv_state = mx.zeros((qkv.shape[0], n_keep, self.conv_dim), dtype=qkv.dtype)
        args = (
            qkv, z, a, b, conv_state, self.conv1d.weight, self.A_log, self.dt_bias,
            cache[1], self.norm.weight, self.norm.eps, self.num_k_heads,
        )
        if K.gated_delta_decode.supports(*args) is not None:
            return None
        out, cache[0], cache[1] = K.gated_delta_decode(*args)
        cache.advance(qkv.shape[1])
        return out
