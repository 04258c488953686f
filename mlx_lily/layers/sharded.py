"""Tensor parallelism: lily's layers after mlx-lm's ``shard()``.

``Model.shard(group)`` (mlx-lm's ``qwen3_5``) splits each layer across the
group's N ranks and leaves every module of stock's class (so lily's
subclasses stay in place); per layer:

* Gated DeltaNet: ``in_proj_qkv`` (by q, k, v segment), ``in_proj_z``,
  ``in_proj_b``, ``in_proj_a``, ``conv1d``, ``A_log`` and ``dt_bias`` keep a
  rank's 1/N of the heads, sliced in place (they stay ``QuantizedLinear``);
  ``out_proj`` keeps 1/N of its inputs, so it yields a partial sum; the head
  counts and widths are divided by N; ``sharding_group`` is set and stock's
  call ends in ``all_sum`` of the output projection's result.
* Attention: ``q_proj``, ``k_proj``, ``v_proj`` become
  ``QuantizedAllToShardedLinear`` (1/N of the heads; KV heads repeated first
  where N exceeds them), ``o_proj`` a ``QuantizedShardedToAllLinear``, whose
  call does the ``all_sum``; the head counts are divided by N. The module
  has no ``sharding_group``: its group is ``o_proj.group``.
* MoE: the router and the shared expert's gate stay whole on every rank;
  every expert's and the shared expert's gate/up keep 1/N of their hidden
  rows, down 1/N of its inputs (in place); ``sharding_group`` is set and
  stock's call ends in ``all_sum`` of (routed + gated shared).
* Dense MLP (no ``num_experts``): gate/up ``QuantizedAllToShardedLinear``,
  down ``QuantizedShardedToAllLinear`` (its call sums).
* Head (untied): ``lm_head`` a ``QuantizedAllToShardedLinear`` (1/N of the
  vocabulary), the logits gathered along the last axis (``all_gather``).

Lily mirrors that: each op runs on the rank's slice (its head counts, its
hidden rows), and the partial sums are summed across the group exactly
where stock sums them, then the residual is added, as stock adds it. The
fused decode step and the compiled segments / whole step keep the
``all_sum`` inside their compiled graphs (MLX compiles collectives). A
sharded layer's MoE decode runs the fused chain (``moe_decode``) in its
no-residual form (``residual=False``: the rank's partial MoE output), then
the ``all_sum``, then the residual. ``MLX_LILY_SHARDED=0`` gives sharded layers stock's code
(one notice per kind of layer). Details: docs/distributed.md.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import (
    QuantizedAllToShardedLinear, QuantizedShardedToAllLinear, ShardedToAllLinear,
)

SHARDED_ENV = "MLX_LILY_SHARDED"
# call_trace's path for a sharded layer's MoE decode: moe_decode without the
# residual, all_sum, then the residual.
SHARDED_MOE_DECODE = "lily moe_decode (no residual), all_sum, residual"
# call_trace's path for a sharded head on lily's GEMV (language_model.py):
# the rank's vocabulary slice, then stock's gather of the last axis.
SHARDED_HEAD = "lily GEMV of the vocabulary slice, all_gather"

# Quantized linears whose (weight, scales, biases) lily's GEMV reads as the
# rank's slice: a sharded-to-all one yields the rank's partial sum.
QUANTIZED_LINEARS = (nn.QuantizedLinear, QuantizedAllToShardedLinear, QuantizedShardedToAllLinear)
_SUMMING_LINEARS = (ShardedToAllLinear, QuantizedShardedToAllLinear)


def sharded_enabled() -> bool:
    return os.environ.get(SHARDED_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def summing_group(linear: Any) -> Optional[mx.distributed.Group]:
    """The group a sharded-to-all linear sums over, else None."""
    return linear.group if isinstance(linear, _SUMMING_LINEARS) else None


def group_of(module: Any) -> Optional[mx.distributed.Group]:
    """The group whose ranks each hold a slice of ``module`` (an attention,
    Gated DeltaNet, MoE or MLP module), None when it is whole."""
    group = getattr(module, "sharding_group", None)
    if group is not None:
        return group
    for name in ("o_proj", "down_proj"):
        linear = getattr(module, name, None)
        if linear is not None and summing_group(linear) is not None:
            return linear.group
    return None


def why_stock(module: Any) -> Optional[str]:
    """None when lily's path takes this (sharded or whole) module, else why
    stock's code runs it."""
    if group_of(module) is None:
        return None
    if not sharded_enabled():
        return f"sharded model and {SHARDED_ENV}=0"
    for heads in ("num_k_heads", "num_v_heads", "num_attention_heads", "num_key_value_heads"):
        if getattr(module, heads, 1) < 1:
            return f"sharded to {heads}={getattr(module, heads)} (more ranks than heads)"
    return None


def all_sum(x: mx.array, group: Optional[mx.distributed.Group]) -> mx.array:
    """``x`` summed across ``group`` (``x`` itself where the layer is whole)."""
    return x if group is None else mx.distributed.all_sum(x, group=group)


def describe(model: Any) -> dict:
    """How a loaded model is split: {"tensor": N or 1, "pipeline": N or 1,
    "rank": this process's rank, "layers": [start, end) of the rank's
    layers} (for ``doctor`` and the bench)."""
    text = getattr(model, "language_model", model)
    inner = getattr(text, "model", text)
    tensor = 1
    for layer in getattr(inner, "pipeline_layers", getattr(inner, "layers", [])):
        if layer is None:
            continue
        mixer = layer.linear_attn if layer.is_linear else layer.self_attn
        group = group_of(mixer)
        if group is not None:
            tensor = group.size()
            break
    pipeline = getattr(inner, "pipeline_size", 1)
    start = getattr(inner, "start_idx", 0)
    end = getattr(inner, "end_idx", None)
    if end is None:
        end = len(getattr(inner, "layers", []))
    rank = mx.distributed.init().rank() if (tensor > 1 or pipeline > 1) else 0
    return {"tensor": tensor, "pipeline": pipeline, "rank": rank, "layers": [start, end]}


def rank_paths(model: Any) -> list:
    """This rank's layers and the path each kind takes: lines for ``doctor``."""
    from .stock_gate import why_stock as gate_why

    split = describe(model)
    text = getattr(model, "language_model", model)
    inner = getattr(text, "model", text)
    layers = [l for l in getattr(inner, "pipeline_layers", inner.layers) if l is not None]
    start, end = split["layers"]
    lines = [f"rank {split['rank']}: layers {start}-{end - 1}"
             + (f", each split {split['tensor']} ways" if split["tensor"] > 1 else ", not split")
             + (f" (pipeline stage of {split['pipeline']})" if split["pipeline"] > 1 else "")]
    kinds: dict = {}
    for layer in layers:
        mixer = layer.linear_attn if layer.is_linear else layer.self_attn
        mixer_kind = "Gated DeltaNet" if layer.is_linear else "full attention"
        mlp_kind = "MoE" if hasattr(layer.mlp, "switch_mlp") else "MLP"
        fused = layer._lily_fits() if hasattr(layer, "_lily_fits") else False
        for kind, module in ((mixer_kind, mixer), (mlp_kind, layer.mlp)):
            why = gate_why(module)
            if why is not None:
                path = f"stock ({why})"
            else:
                path = "lily's ops" + (", decode fused" if fused else ", decode unfused")
                if group_of(module) is not None:
                    path += ", all_sum where stock sums"
                    if kind == "MoE":
                        path += " (decode: moe_decode without the residual up to it)"
            kinds.setdefault(kind, set()).add(path)
    for kind, paths in kinds.items():
        lines.append(f"  {kind}: {'; '.join(sorted(paths))}")
    if getattr(text, "sharding_group", None) is not None:
        lines.append("  head: the rank's vocabulary slice, all_gather; server decode on lily's GEMV")
    if split["pipeline"] > 1:
        lines.append("  decode: each layer's compiled fused step (the stack's compiled segments "
                     "and whole step run unpipelined models only)")
    return lines
