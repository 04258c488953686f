"""The language model's head for decode steps.

Stock's ``TextModel`` ends in ``lm_head`` (an ``nn.QuantizedLinear``), which
MLX runs with a kernel it picks by the number of rows; the choice can change
a row's bits with the batch size, and for rows of [B, 1, D] it reads the
weights once per row (four 286 MB reads for a 4-position verification pass
on the H200: 1,118 us against 294 on lily's GEMV). For decode rows (1 to 16
rows of one position each) lily runs the head on its quantized GEMV instead,
which reads the weights once for all rows and reduces every row in the same
order whatever the batch: a token of the server's batch caches (and, where
``ONE_STREAM_BACKENDS`` names the GPU, one stream's decode rows: a token of
``mlx_lm.generate``'s caches, the MTP loop's drafts and the rows of a
verification pass, ``mtp_decode``, whose logits then have the same bits in
each). A head sharded by mlx-lm's ``shard()`` (a
``QuantizedAllToShardedLinear``: the rank's slice of the vocabulary) runs
the same GEMV on the slice, then stock's ``gather_last_axis`` (sharded.py).
Everything else (prompts, calls without a cache, a batch cache of another
row count, tied embeddings, ``MLX_LILY_SHARDED=0``) is stock's code, and so
is one stream's head (``ONE_STREAM_BACKENDS``: its greedy tokens stay
stock's head's).
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import QuantizedAllToShardedLinear
from mlx_lm.models.qwen3_5 import TextModel, gather_last_axis

from .. import kernels as K
from ..toolchain.registry import kernel_backend
from .batch_step import MAX_BATCH, batch_rows
from .decoder import compile_enabled, compiled_step, weights_version
from .sharded import SHARDED_HEAD, sharded_enabled
from .stock_gate import record


# Where one stream's decode rows (``mlx_lm.generate``'s tokens, the MTP
# loop's drafts and verification rows) take lily's head GEMV: nowhere. On the
# H200 it ran the 248,320 x 2048 head in 233.5 us against stock's 283.5 at
# one row, 293.8 against 1,117.7 at four
# (bench/results/2026-12-03-nvidia-h200-2b882a1), but it sums each logit in
# another order than stock's head, and on the conditioned checkpoint that
# changed generate's greedy tokens from the ninth on
# (bench/results/2026-12-03-nvidia-h200-b941f9d): one stream keeps stock's
# head, and its tokens. ("cuda" here turns it on there.) The server's batch
# caches take the GEMV everywhere (batch invariance). A decode step and a
# verification pass decide alike, so a pass's rows keep a decode step's bits
# either way.
ONE_STREAM_BACKENDS: tuple = ()


def _plain_head(head: Any, sharded: bool) -> bool:
    """A quantized head without a bias: whole, or (``sharded``) the rank's
    slice of the vocabulary."""
    kind = QuantizedAllToShardedLinear if sharded else nn.QuantizedLinear
    return isinstance(head, kind) and "bias" not in head and getattr(head, "mode", "affine") == "affine"


class LilyLanguageModel(TextModel):
    def __call__(self, inputs: mx.array, cache: Optional[Any] = None, input_embeddings: Optional[mx.array] = None):
        return self.head(self.model(inputs, cache, input_embeddings=input_embeddings), cache)

    def head(self, out: mx.array, cache: Optional[Any] = None) -> mx.array:
        """The logits of final hidden states ``out`` (the model's call ends
        in it; the MTP loop calls it on its own)."""
        if self._lily_head_takes(out, cache):
            if self.sharding_group is not None:  # the rank's vocabulary slice: gathered as stock
                record("head", SHARDED_HEAD, out)
                return gather_last_axis(self._head_gemv(out), self.sharding_group)
            if not compile_enabled():
                return self._head_gemv(out)
            # Compiled per row count: the GEMV's launch built once, not per
            # token (outside the compiled steps, its checks and launch cost
            # the host about 40 times stock's QuantizedLinear call).
            version, _ = weights_version(self.__dict__, [self.lm_head])
            store = self.__dict__.setdefault("_lily_head_steps", {})
            return compiled_step(store, out.shape[0], version, lambda: self._head_gemv)(out)
        # Stock's head.
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(out)
        out = self.lm_head(out)
        if self.sharding_group is not None:
            out = gather_last_axis(out, self.sharding_group)
        return out

    def _head_gemv(self, out: mx.array) -> mx.array:
        head = self.lm_head
        (logits,) = K.decode_matvec(out, ((head.weight, head.scales, head.biases),))
        return logits

    def _lily_head_takes(self, out: mx.array, cache: Any) -> bool:
        sharded = self.sharding_group is not None
        if self.args.tie_word_embeddings or (sharded and not sharded_enabled()) or cache is None:
            return False
        if out.ndim != 3 or out.shape[1] != 1 or not 1 <= out.shape[0] <= MAX_BATCH:
            return False
        # The server's batch caches: their rows. Other caches (generate's, the
        # MTP loop's): one stream, whose decode rows are independent, where
        # lily's GEMV is measured faster than stock's head.
        rows = batch_rows(cache)
        if rows is None:
            return kernel_backend()[0] in ONE_STREAM_BACKENDS and _plain_head(self.lm_head, sharded)
        return rows == out.shape[0] and _plain_head(self.lm_head, sharded)
