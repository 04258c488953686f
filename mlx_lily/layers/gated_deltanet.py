"""Gated DeltaNet (linear attention with a fixed-size recurrent state per head)."""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache
from mlx_lm.models.qwen3_5 import GatedDeltaNet

from .. import kernels as K
from .fast_path import note_stock, why_stock


class LilyGatedDeltaNet(GatedDeltaNet):
    def __call__(self, inputs: mx.array, mask: Optional[mx.array] = None, cache: Any = None):
        reason = why_stock(self, inputs, mask, cache, ArraysCache)
        if reason is not None:
            note_stock("Gated DeltaNet", reason)
            return super().__call__(inputs, mask, cache)
        return self._lily(inputs, cache)

    def _lily(self, inputs: mx.array, cache: Optional[ArraysCache]) -> mx.array:
        B, S, _ = inputs.shape
        qkv = self.in_proj_qkv(inputs)
        z = self.in_proj_z(inputs).reshape(B, S, self.num_v_heads, self.head_v_dim)
        b = self.in_proj_b(inputs)
        a = self.in_proj_a(inputs)

        # The convolution sees the last K-1 rows of the previous call first.
        n_keep = self.conv_kernel_size - 1
        conv_state = cache[0] if cache is not None and cache[0] is not None else None
        if conv_state is None:
            conv_state = mx.zeros((B, n_keep, self.conv_dim), dtype=inputs.dtype)
        conv_input = mx.concatenate([conv_state, qkv], axis=1)
        if cache is not None:
            cache[0] = mx.contiguous(conv_input[:, -n_keep:, :])
        conv_out = K.conv1d_silu(conv_input, self.conv1d.weight)

        q, k, v = mx.split(conv_out, [self.key_dim, 2 * self.key_dim], axis=-1)
        q = q.reshape(B, S, self.num_k_heads, self.head_k_dim)
        k = k.reshape(B, S, self.num_k_heads, self.head_k_dim)
        v = v.reshape(B, S, self.num_v_heads, self.head_v_dim)
        q, k = K.l2norm_qk(q, k, self.head_k_dim**-0.5)

        state = cache[1] if cache is not None else None
        out, state = K.gated_delta(q, k, v, a, b, self.A_log, self.dt_bias, state)
        if cache is not None:
            cache[1] = state
            cache.advance(S)

        out = K.gated_rms_norm(out, z, self.norm.weight, self.norm.eps)
        return self.out_proj(out.reshape(B, S, -1))
