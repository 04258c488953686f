"""Full attention: gated query projection, q/k norm, partial RoPE, GQA."""

from __future__ import annotations

from typing import Any, List, Optional, Union

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache
from mlx_lm.models.qwen3_next import Qwen3NextAttention

from .. import kernels as K
from .prompt_rows import BatchedRows, packed_from_padded, padded_rows, split_rows
from .stock_gate import runs_stock

Mask = Union[None, str, mx.array]


def plain_causal(mask: Mask, cache: Any, n_queries: int) -> Mask:
    """'causal' for a BatchKVCache's prefill mask when no row is left-padded.

    BatchKVCache.make_mask builds the causal mask as an array (plus each row's
    left padding); without padding it is exactly sdpa's bottom-right 'causal',
    which lets sdpa take its fused causal path instead of reading an L x S
    array. Only prefill asks: left_padding is already evaluated there (the
    batch generator evaluates cache state after each chunk), so reading it
    does not wait on queued work, as it would in the decode loop.
    """
    if n_queries == 1 or not isinstance(mask, mx.array) or type(cache) is not BatchKVCache:
        return mask
    return "causal" if max(cache.left_padding.tolist()) <= 0 else mask


def attention_heads(attn: Any, q: mx.array, k: mx.array, v: mx.array, offset: Any):
    """The q/k/v projections' outputs [B, L, *] as heads: (queries, keys,
    values, gate), queries and keys through q/k RMSNorm and RoPE at
    ``offset``, values [B, Hkv, L, D]. q_proj yields each head's query and
    its output gate side by side. ``attn``: the attention module (its head
    counts, norms, RoPE); the layer's call and the decoder's fused step both
    split here."""
    B, L, _ = q.shape
    queries, gate = mx.split(q.reshape(B, L, attn.num_attention_heads, -1), 2, axis=-1)
    keys = k.reshape(B, L, attn.num_key_value_heads, -1)
    if L == 1:  # [B, 1, H, D] -> [B, H, 1, D] moves no element: one view node, not two
        values = v.reshape(B, attn.num_key_value_heads, 1, -1)
    else:
        values = v.reshape(B, L, attn.num_key_value_heads, -1).transpose(0, 2, 1, 3)
    queries, keys = K.qk_norm_rope(
        queries, keys, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, attn.rope, offset
    )
    return queries, keys, values, gate


def _fresh(cache: Any) -> bool:
    """A one-row KV cache with no history yet (a new request's prompt)."""
    return type(cache) in (KVCache, BatchKVCache) and cache.keys is None and (
        type(cache) is KVCache or cache.offset.size == 1)


def _hold(cache: Any, keys: mx.array, values: mx.array) -> None:
    """An empty one-row cache given ``keys`` and ``values`` [1, H, n, D] as
    its history, as its own update would leave it (the same values, the
    same counters) but without copying them into a buffer of its own."""
    cache.keys, cache.values = keys, values
    if type(cache) is BatchKVCache:
        cache._idx = keys.shape[2]
        cache.offset = cache.offset + keys.shape[2]
    else:
        cache.offset = keys.shape[2]


def _attention_path(q: mx.array, k: mx.array, v: mx.array, scale: float) -> str:
    """Which of the attention op's paths a causal prompt call takes: lily's
    prefill kernel (one row a call) or its reference, MLX's sdpa (on CUDA
    every call from 64 queries, keys padded to a multiple of 8). On the
    reference a causal query gets the same bits in a right-padded batch as
    alone: measured on the H200 (``bench.diagnostics.prefill.packed_rows
    --generator``), tested on the CPU."""
    return K.attention.choose(q, k, v, scale, "causal")[1]


class LilyAttention(Qwen3NextAttention):
    def __call__(self, x: mx.array, mask: Mask = None, cache: Any = None):
        if runs_stock(self, "full attention", x, mask, cache, KVCache):
            return super().__call__(x, mask, cache)
        return self._lily(x, mask, cache)

    def packed_rows(self, x: mx.array, lengths: List[int], masks: list, caches: list) -> mx.array:
        """Several sequences' prompt tokens, one after another in ``x`` [1,
        sum(lengths), D], each on its own cache (``masks`` and ``caches``:
        one per row): the q/k/v projections, the output gate and the output
        projection over all rows' tokens at once (token-wise: a token's bits
        do not depend on what is packed with it, where the caller packs);
        q/k norm, RoPE and attention per row, at its positions in its
        cache. The same as calling the layer on each row."""
        rows = split_rows(x, lengths)
        if any(runs_stock(self, "full attention", r, m, c, KVCache) for r, m, c in zip(rows, masks, caches)):
            return mx.concatenate([self(r, m, c) for r, m, c in zip(rows, masks, caches)], axis=1)
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        # Fresh rows (no history) run as one right-padded causal batch where
        # each would alone take the path the batch takes (``_attend_rows``).
        fresh = [r for r, c in enumerate(caches) if _fresh(c) and lengths[r] > 1]
        took, out, gate = self._attend_rows(q, k, v, lengths, fresh, [caches[r] for r in fresh]) \
            if len(fresh) > 1 else ([], None, None)
        if len(took) == len(lengths):  # every row: back to packed order in one gather each
            return self._output(packed_from_padded(out, lengths, took), packed_from_padded(gate, lengths, took))
        parts = list(zip(*(split_rows(t, lengths) for t in (q, k, v))))
        outs, gates = [], []
        for r, ((q_, k_, v_), mask, cache) in enumerate(zip(parts, masks, caches)):
            if r in took:
                slot = took.index(r)
                o, g = out[slot:slot + 1, : lengths[r]], gate[slot:slot + 1, : lengths[r]]
            else:
                o, g = self._attend(q_, k_, v_, mask, cache)
            outs.append(o)
            gates.append(g)
        return self._output(mx.concatenate(outs, axis=1), mx.concatenate(gates, axis=1))

    def _attend_rows(self, q: mx.array, k: mx.array, v: mx.array, lengths: List[int], rows: List[int],
                     caches: list) -> tuple:
        """``_attend`` of fresh rows ``rows`` of the packed call (q, k, v [1,
        sum(lengths), *]; ``caches``: their empty one-row caches) as one
        batch, right-padded to the longest: causal, so a row's queries see
        only its own keys. (the rows taken, their outputs [R', longest, Hq *
        D], their output gates [R', longest, Hq * D]): the rows whose
        attention alone takes the path the batch takes (then each query gets
        the bits it gets alone: ``_attention_path``), each cache holding its
        row's keys and values; no rows where fewer than two take it (the
        others are left to run alone)."""
        q, k, v = (padded_rows(t, lengths, rows) for t in (q, k, v))
        lengths = [lengths[r] for r in rows]
        steps = max(lengths)
        # Fresh caches: every row at position 0.
        queries, keys, values, gate = attention_heads(self, q, k, v, mx.zeros((len(rows),), mx.int32))
        path = _attention_path(queries, keys, values, self.scale)
        took = [i for i, n in enumerate(lengths)
                if _attention_path(queries[i : i + 1, :, :n], keys[i : i + 1, :, :n], values[i : i + 1, :, :n],
                                   self.scale) == path]
        if len(took) < 2:
            return [], None, None
        if len(took) < len(rows):
            keep = mx.array(took)
            queries, keys, values, gate = (t[keep] for t in (queries, keys, values, gate))
        out = K.attention(queries, keys, values, self.scale, "causal")
        B = out.shape[0]
        out = out.transpose(0, 2, 1, 3).reshape(B, steps, -1)
        gate = gate.reshape(B, steps, -1)
        # Each cache its row's keys and values (as its own update would hold
        # them); the batch's cache takes them back whole, zeros after each
        # row's end as its chunk holds them (prompt_rows.batched_entries).
        taken = [lengths[i] for i in took]
        ends = mx.arange(steps)[None, None, :, None] < mx.array(taken)[:, None, None, None]
        zero = mx.zeros((), keys.dtype)
        rows_kv = BatchedRows([mx.where(ends, keys, zero), mx.where(ends, values, zero)])
        for slot, i in enumerate(took):
            _hold(caches[i], keys[slot : slot + 1, :, : lengths[i]], values[slot : slot + 1, :, : lengths[i]])
            rows_kv.tag(caches[i], slot)
        return [rows[i] for i in took], out, gate

    def _lily(self, x: mx.array, mask: Mask, cache: Optional[KVCache]) -> mx.array:
        """mask: None, 'causal', or an array broadcasting to [B, Hq, L, S]
        (boolean or additive). With a BatchKVCache, cache.offset is one
        position per row (left padding makes them differ)."""
        return self._output(*self._attend(self.q_proj(x), self.k_proj(x), self.v_proj(x), mask, cache))

    def _attend(self, q: mx.array, k: mx.array, v: mx.array, mask: Mask, cache: Optional[KVCache]):
        """The projections' outputs [B, L, *] -> the heads' attention
        outputs [B, L, Hq * D] and the output gate [B, L, Hq * D], the
        cache updated."""
        B, L, _ = q.shape
        offset = cache.offset if cache is not None else 0
        queries, keys, values, gate = attention_heads(self, q, k, v, offset)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        out = K.attention(queries, keys, values, self.scale, plain_causal(mask, cache, L))
        return out.transpose(0, 2, 1, 3).reshape(B, L, -1), gate.reshape(B, L, -1)

    def _output(self, out: mx.array, gate: mx.array) -> mx.array:
        return self.o_proj(out * mx.sigmoid(gate))
