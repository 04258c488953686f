"""Qwen3.5/3.6 MoE (mlx-lm model_type ``qwen3_5_moe``) with lily's layers.

The model is built by stock mlx-lm's code, then each attention, Gated DeltaNet
and MoE module is specialized in place to lily's subclass of the same stock
class. The subclasses add no parameters, so parameter names and shapes,
``sanitize``, quantization predicates, caches and sharding are stock's by
construction, and every checkpoint stock loads, lily loads.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3_5_moe as stock
from mlx_lm.models.qwen3_5 import DecoderLayer, GatedDeltaNet, Qwen3_5TextModel
from mlx_lm.models.qwen3_next import Qwen3NextAttention, Qwen3NextSparseMoeBlock

from ..errors import CheckpointError, ConfigError
from ..layers import LilyAttention, LilyDecoderLayer, LilyGatedDeltaNet, LilySparseMoeBlock, LilyTextModel

# Quantizations MLX can load; lily's kernels target affine 4-bit group 64 and
# every other valid one runs the reference (stock) path.
_VALID_BITS = {"affine": {2, 3, 4, 5, 6, 8}, "mxfp4": {4}, "nvfp4": {4}, "mxfp8": {8}}
_VALID_GROUPS = {"affine": {32, 64, 128}, "mxfp4": {32}, "nvfp4": {16}, "mxfp8": {32}}

_SPECIALIZE = {
    Qwen3_5TextModel: LilyTextModel,
    DecoderLayer: LilyDecoderLayer,
    GatedDeltaNet: LilyGatedDeltaNet,
    Qwen3NextAttention: LilyAttention,
    Qwen3NextSparseMoeBlock: LilySparseMoeBlock,
}


# text_config fields with no sensible default for this family (stock's
# defaults are a dense model's, or 0 for the MoE sizes): each must be a
# positive integer.
_REQUIRED_FIELDS = {
    "hidden_size": "the model width",
    "num_hidden_layers": "the number of layers",
    "num_attention_heads": "query heads of the full-attention layers",
    "num_key_value_heads": "KV heads of the full-attention layers",
    "linear_num_key_heads": "key heads of the Gated DeltaNet layers",
    "linear_num_value_heads": "value heads of the Gated DeltaNet layers",
    "linear_key_head_dim": "the Gated DeltaNet key head size",
    "linear_value_head_dim": "the Gated DeltaNet value head size",
    "num_experts": "routed experts per layer",
    "num_experts_per_tok": "experts each token is routed to",
    "moe_intermediate_size": "each routed expert's hidden size",
    "shared_expert_intermediate_size": "the shared expert's hidden size",
    "vocab_size": "the vocabulary size",
}


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def check_config(params: Dict[str, Any]) -> None:
    """Name the first config.json field that is missing or out of range."""
    text = params.get("text_config", params)
    where = "text_config." if "text_config" in params else ""
    for name, meaning in _REQUIRED_FIELDS.items():
        if name not in text:
            raise ConfigError(f"config.json has no {where}{name} ({meaning}: a positive integer)")
        if not _is_positive_int(text[name]):
            raise ConfigError(
                f"config.json {where}{name} is {text[name]!r}; expected {meaning}, a positive integer"
            )
    if text["num_experts_per_tok"] > text["num_experts"]:
        raise ConfigError(
            f"config.json {where}num_experts_per_tok is {text['num_experts_per_tok']}; expected "
            f"at most {where}num_experts ({text['num_experts']})"
        )
    for many, few in (("num_attention_heads", "num_key_value_heads"),
                      ("linear_num_value_heads", "linear_num_key_heads")):
        if text[many] % text[few]:
            raise ConfigError(
                f"config.json {where}{many} ({text[many]}) is not a multiple of "
                f"{where}{few} ({text[few]})"
            )
    quant = params.get("quantization")
    if isinstance(quant, dict):
        mode = quant.get("mode", "affine")
        if mode not in _VALID_BITS:
            raise ConfigError(f"config.json quantization mode {mode!r} is not one MLX supports "
                              f"({', '.join(_VALID_BITS)})")
        for path, override in quant.items():
            if isinstance(override, dict):
                _check_quantization(override, f"tensor {path!r}")


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
        check_config(params)
        args = super().from_dict(params)
        # What config.json declares, to check the tensors against in sanitize.
        args.declared_quantization = params.get("quantization")
        return args


def specialize(model: stock.Model, lily: bool = True) -> stock.Model:
    """Switch a built qwen3_5_moe model's layers to lily's classes (or back to
    stock's) in place. The weights are shared, not copied, so one model can be
    measured both ways in one process (bench/)."""
    table = _SPECIALIZE if lily else {v: k for k, v in _SPECIALIZE.items()}
    text = getattr(getattr(model, "language_model", None), "model", None)
    if type(text) in table:
        text.__class__ = table[type(text)]
    for layer in model.layers:
        if type(layer) in table:
            layer.__class__ = table[type(layer)]
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

    def sanitize(self, weights):
        weights = super().sanitize(weights)
        declared = getattr(self.args, "declared_quantization", None)
        # Before mlx-lm quantizes the model: it infers each layer's bits from
        # the tensor shapes, so a tensor that contradicts config.json would
        # load silently (or fail deep inside mlx-lm).
        _check_packed_tensors(self, weights, declared if isinstance(declared, dict) else None)
        return weights

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


def _check_packed_tensors(model: Model, weights: Dict[str, mx.array], declared: Optional[Dict[str, Any]]) -> None:
    """Each quantized layer has its packed weight, and is packed at the bits and
    group size config.json declares for it."""
    modules = dict(model.named_modules())
    for name in sorted(weights):
        if not name.endswith(".scales"):
            continue
        prefix = name[: -len(".scales")]
        weight = weights.get(f"{prefix}.weight")
        module = modules.get(prefix)
        if module is None or not hasattr(module, "weight"):
            continue  # an unexpected tensor: named by _check_weights
        in_dims = module.weight.shape[-1]
        if weight is None:
            raise CheckpointError(
                f"checkpoint is missing tensor '{prefix}.weight' (its '{name}' is there; expected "
                f"a packed weight for {tuple(module.weight.shape)} values)"
            )
        if declared is None:
            continue
        want = declared.get(prefix, declared)
        if not isinstance(want, dict):
            continue
        group = in_dims // weights[name].shape[-1] if weights[name].shape[-1] else 0
        bits, exact = divmod(weight.shape[-1] * 32, in_dims)
        if exact or (bits, group) != (want.get("bits"), want.get("group_size")):
            source = f"quantization.{prefix}" if prefix in declared else "quantization"
            got = f"{weight.shape[-1] * 32 / in_dims:.3g}" if exact else str(bits)
            unsupported = ""
            mode = want.get("mode", "affine")
            if want.get("bits") not in _VALID_BITS.get(mode, ()):
                unsupported = f" (MLX has no {want.get('bits')}-bit {mode} quantization)"
            raise CheckpointError(
                f"checkpoint tensor '{prefix}.weight' is packed at {got} bits, group size {group} "
                f"(shape {tuple(weight.shape)}, scales {tuple(weights[name].shape)}, {in_dims} inputs), "
                f"but config.json {source} declares {want.get('bits')} bits, group size "
                f"{want.get('group_size')}{unsupported}; lily loads only tensors that match config.json"
            )
