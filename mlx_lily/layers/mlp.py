"""Dense MLP layer (a ``qwen3_5_moe`` config without ``num_experts``):
``down(silu(gate(x)) * up(x))``, stock's ``Qwen3NextMLP``.

For one decode token of one sequence the gate and up projections are one
``quantized_matvec`` call (one launch reading x once) and the down projection
another; the op runs its kernel where the quantization fits it (affine,
group 64, 4 or 8 bits) and stock's ``mx.quantized_matmul`` otherwise, so the
reference path is stock's to the bit. Prompts, batches of several rows,
unquantized or non-affine projections and training run stock's code; a
sharded MLP (mlx-lm's ``shard()``) runs the rank's slice and sums as stock.
The decoder layer's fused decode step and the compiled whole-stack and
segmented steps are built for MoE blocks: a layer with this MLP takes the
per-layer path (see ``LilyDecoderLayer._layer_fits``).
"""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.activations import swiglu
from mlx_lm.models.qwen3_next import Qwen3NextMLP

from .. import kernels as K
from .decoder import _plain_quantized, _triple
from .sharded import all_sum, summing_group
from .stock_gate import runs_stock


class LilyDenseMLP(Qwen3NextMLP):
    def __call__(self, x: mx.array) -> mx.array:
        one_token = x.ndim == 3 and x.shape[:2] == (1, 1)
        takes = one_token and _plain_quantized(self.gate_proj, self.up_proj, self.down_proj)
        if runs_stock(self, "MLP", x, takes=takes):
            return super().__call__(x)
        gate, up = K.decode_matvec(x, (_triple(self.gate_proj), _triple(self.up_proj)))
        (out,) = K.decode_matvec(swiglu(gate, up), (_triple(self.down_proj),))
        # Sharded (mlx-lm's shard()): down_proj's slice gives a partial sum,
        # which its own call would sum across the group.
        return all_sum(out, summing_group(self.down_proj))
