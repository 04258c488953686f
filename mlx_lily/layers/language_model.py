"""The language model's head for the server's decode steps.

Stock's ``TextModel`` ends in ``lm_head`` (an ``nn.QuantizedLinear``), which
MLX runs with a kernel it picks by the number of rows; the choice can change
a row's bits with the batch size. For a decode token on the server's batch
caches (1 to 16 rows) lily runs the head on its quantized GEMV instead, which
reduces every row in the same order whatever the batch: with the batched
decode step, a stream's logits are the same alone or in a batch. Everything
else (prompts, ``mlx_lm.generate``'s caches, tied embeddings, a sharded
head) is stock's code.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.qwen3_5 import TextModel, gather_last_axis

from .. import kernels as K
from .batch_step import MAX_BATCH, batch_rows


def _plain_head(head: Any) -> bool:
    return isinstance(head, nn.QuantizedLinear) and "bias" not in head and getattr(head, "mode", "affine") == "affine"


class LilyLanguageModel(TextModel):
    def __call__(self, inputs: mx.array, cache: Optional[Any] = None, input_embeddings: Optional[mx.array] = None):
        return self.head(self.model(inputs, cache, input_embeddings=input_embeddings), cache)

    def head(self, out: mx.array, cache: Optional[Any] = None) -> mx.array:
        """The logits of final hidden states ``out`` (the model's call ends
        in it; the MTP loop calls it on its own)."""
        if self._lily_head_takes(out, cache):
            head = self.lm_head
            (logits,) = K.quantized_matvec(out, ((head.weight, head.scales, head.biases),))
            return logits
        # Stock's head.
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(out)
        out = self.lm_head(out)
        if self.sharding_group is not None:
            out = gather_last_axis(out, self.sharding_group)
        return out

    def _lily_head_takes(self, out: mx.array, cache: Any) -> bool:
        if self.args.tie_word_embeddings or self.sharding_group is not None or cache is None:
            return False
        if out.ndim != 3 or out.shape[1] != 1 or not 1 <= out.shape[0] <= MAX_BATCH:
            return False
        return batch_rows(cache) == out.shape[0] and _plain_head(self.lm_head)
