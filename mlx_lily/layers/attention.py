"""Full attention: gated query projection, q/k norm, partial RoPE, GQA."""

from __future__ import annotations

from typing import Any, Optional, Union

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache
from mlx_lm.models.qwen3_next import Qwen3NextAttention

from .. import kernels as K
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
    values = v.reshape(B, L, attn.num_key_value_heads, -1).transpose(0, 2, 1, 3)
    queries, keys = K.qk_norm_rope(
        queries, keys, attn.q_norm.weight, attn.k_norm.weight, attn.q_norm.eps, attn.rope, offset
    )
    return queries, keys, values, gate


class LilyAttention(Qwen3NextAttention):
    def __call__(self, x: mx.array, mask: Mask = None, cache: Any = None):
        if runs_stock(self, "full attention", x, mask, cache, KVCache):
            return super().__call__(x, mask, cache)
        return self._lily(x, mask, cache)

    def _lily(self, x: mx.array, mask: Mask, cache: Optional[KVCache]) -> mx.array:
        """mask: None, 'causal', or an array broadcasting to [B, Hq, L, S]
        (boolean or additive). With a BatchKVCache, cache.offset is one
        position per row (left padding makes them differ)."""
        B, L, _ = x.shape
        offset = cache.offset if cache is not None else 0
        queries, keys, values, gate = attention_heads(self, self.q_proj(x), self.k_proj(x), self.v_proj(x), offset)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)

        out = K.attention(queries, keys, values, self.scale, plain_causal(mask, cache, L))
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(out * mx.sigmoid(gate.reshape(B, L, -1)))
