"""Full attention: gated query projection, q/k norm, partial RoPE, GQA."""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3_next import Qwen3NextAttention

from .. import kernels as K
from .fast_path import note_stock, why_stock


class LilyAttention(Qwen3NextAttention):
    def __call__(self, x: mx.array, mask: Optional[Any] = None, cache: Any = None):
        reason = why_stock(self, x, mask, cache, KVCache)
        if reason is not None:
            note_stock("full attention", reason)
            return super().__call__(x, mask, cache)
        return self._lily(x, mask, cache)

    def _lily(self, x: mx.array, mask: Optional[str], cache: Optional[KVCache]) -> mx.array:
        B, L, _ = x.shape
        # q_proj yields each head's query and its output gate side by side.
        queries, gate = mx.split(
            self.q_proj(x).reshape(B, L, self.num_attention_heads, -1), 2, axis=-1
        )
        keys = self.k_proj(x).reshape(B, L, self.num_key_value_heads, -1)
        values = self.v_proj(x).reshape(B, L, self.num_key_value_heads, -1)
        values = values.transpose(0, 2, 1, 3)

        offset = cache.offset if cache is not None else 0
        queries, keys = K.qk_norm_rope(
            queries, keys, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
            self.rope, offset,
        )
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)

        out = K.attention(queries, keys, values, self.scale, mask)
        out = out.transpose(0, 2, 1, 3).reshape(B, L, -1)
        return self.o_proj(out * mx.sigmoid(gate.reshape(B, L, -1)))
