"""Qwen3.5/3.6 MoE (mlx-lm model_type ``qwen3_5_moe``) with lily's layers.

The model is built by stock mlx-lm's code, then each attention, Gated DeltaNet
and MoE module is specialized in place to lily's subclass of the same stock
class. The subclasses add no parameters, so parameter names and shapes,
``sanitize``, quantization predicates, caches and sharding are stock's by
construction, and every checkpoint stock loads, lily loads.
"""

from __future__ import annotations

from typing import Any, Dict

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3_5_moe as stock
from mlx_lm.models.qwen3_5 import GatedDeltaNet
from mlx_lm.models.qwen3_next import Qwen3NextAttention, Qwen3NextSparseMoeBlock

from ..errors import CheckpointError
from ..layers import LilyAttention, LilyGatedDeltaNet, LilySparseMoeBlock

# Quantizations MLX can load; lily's kernels target affine 4-bit group 64 and
# every other valid one runs the reference (stock) path.
_VALID_BITS = {"affine": {2, 3, 4, 5, 6, 8}, "mxfp4": {4}, "nvfp4": {4}, "mxfp8": {8}}
_VALID_GROUPS = {"affine": {32, 64, 128}, "mxfp4": {32}, "nvfp4": {16}, "mxfp8": {32}}

_SPECIALIZE = {
    GatedDeltaNet: LilyGatedDeltaNet,
    Qwen3NextAttention: LilyAttention,
    Qwen3NextSparseMoeBlock: LilySparseMoeBlock,
}


def _check_quantization(q: Dict[str, Any], where: str) -> None:
    mode = q.get("mode", "affine")
    bits, group = q.get("bits"), q.get("group_size")
    if mode not in _VALID_BITS:
        raise CheckpointError(f"unsupported quantization mode {mode!r} for {where}")
    if bits not in _VALID_BITS[mode] or group not in _VALID_GROUPS[mode]:
        raise CheckpointError(
            f"unsupported quantization for {where}: mode={mode}, bits={bits}, "
            f"group_size={group} (MLX supports bits {sorted(_VALID_BITS[mode])} "
            f"with group sizes {sorted(_VALID_GROUPS[mode])} in {mode} mode)"
        )


class ModelArgs(stock.ModelArgs):
    @classmethod
    def from_dict(cls, params):
        quant = params.get("quantization")
        if isinstance(quant, dict):
            _check_quantization(quant, "the model (config.json 'quantization')")
            for path, override in quant.items():
                if isinstance(override, dict):
                    _check_quantization(override, f"tensor {path!r}")
        return super().from_dict(params)


def specialize(model: stock.Model, lily: bool = True) -> stock.Model:
    """Switch a built qwen3_5_moe model's layers to lily's classes (or back to
    stock's) in place. The weights are shared, not copied, so one model can be
    measured both ways in one process (bench/)."""
    table = _SPECIALIZE if lily else {v: k for k, v in _SPECIALIZE.items()}
    for layer in model.layers:
        for name in ("linear_attn", "self_attn", "mlp"):
            module = getattr(layer, name, None)
            new_class = table.get(type(module))
            if new_class is not None:
                module.__class__ = new_class  # same instance layout, other __call__
    return model


class Model(stock.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        specialize(self)

    def load_weights(self, file_or_weights, strict: bool = True):
        if strict and not isinstance(file_or_weights, str):
            _check_weights(self, dict(file_or_weights))
        return super().load_weights(file_or_weights, strict=strict)


def _check_weights(model: Model, weights: Dict[str, mx.array]) -> None:
    """Name the first missing, unexpected or mis-shaped tensor, with a hint."""
    expected = dict(tree_flatten(model.parameters()))
    # A packed (uint32) weight without its scales: mlx-lm then leaves the layer
    # unquantized, and the mismatch would surface far from its cause.
    for name, value in sorted(weights.items()):
        prefix = name[: -len(".weight")]
        if name.endswith(".weight") and value.dtype == mx.uint32 and f"{prefix}.scales" not in weights:
            raise CheckpointError(
                f"checkpoint is missing tensor '{prefix}.scales': '{name}' is "
                "quantized (packed uint32) but has no scales"
            )
    missing = sorted(expected.keys() - weights.keys())
    if missing:
        name = missing[0]
        hint = ""
        if name.endswith((".scales", ".biases")):
            hint = " (the layer is quantized in this model but the checkpoint has no quantization data for it)"
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointError(
            f"checkpoint is missing tensor {name!r} (expected shape "
            f"{tuple(expected[name].shape)}){more}{hint}"
        )
    extra = sorted(weights.keys() - expected.keys())
    if extra:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise CheckpointError(
            f"checkpoint has tensor {extra[0]!r}, which this {model.model_type} "
            f"model does not use{more}; is config.json right for these weights?"
        )
    for name, value in expected.items():
        got = weights[name]
        if tuple(got.shape) != tuple(value.shape):
            raise CheckpointError(
                f"checkpoint tensor {name!r} has shape {tuple(got.shape)}, "
                f"expected {tuple(value.shape)} from config.json"
            )
