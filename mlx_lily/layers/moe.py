"""Sparse MoE block: router top-k over the experts plus a gated shared expert."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.qwen3_next import Qwen3NextSparseMoeBlock

from .. import kernels as K
from .sharded import all_sum
from .stock_gate import runs_stock


class LilySparseMoeBlock(Qwen3NextSparseMoeBlock):
    def __call__(self, x: mx.array) -> mx.array:
        # Any batch: every token is routed on its own (padding rows too, as in
        # stock; their outputs are never read).
        if runs_stock(self, "MoE", x):
            return super().__call__(x)
        inds, scores = K.router_topk(self.gate(x), self.top_k, self.norm_topk_prob)
        y = K.moe_experts(x, inds, self.switch_mlp)
        shared = self.shared_expert(x)
        # Sharded (mlx-lm's shard()): each rank's slice of every expert's
        # hidden rows gives a partial sum, summed where stock sums it.
        return all_sum(K.moe_combine(y, scores, shared, self.shared_expert_gate(x)), self.sharding_group)
