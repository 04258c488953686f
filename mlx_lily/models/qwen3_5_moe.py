"""Qwen3.5/3.6 MoE (mlx-lm model_type ``qwen3_5_moe``) with lily's layers.

The model is built by stock mlx-lm's code, then each attention, Gated DeltaNet
and MoE (or, without ``num_experts``, dense MLP) module is specialized in place
to lily's subclass of the same stock class. The subclasses add no parameters,
so parameter names and shapes, ``sanitize``, quantization predicates, caches
and sharding are stock's by construction, and every checkpoint stock loads,
lily loads: its checks (``check_config``, ``_check_packed_tensors``,
``_check_weights``) refuse, with one line naming the field or tensor, only
what stock's loader fails on deep inside or would load other than the
checkpoint says.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import qwen3_5_moe as stock
from mlx_lm.models.qwen3_5 import DecoderLayer, GatedDeltaNet, Qwen3_5TextModel, TextModel
from mlx_lm.models.qwen3_next import Qwen3NextAttention, Qwen3NextMLP, Qwen3NextSparseMoeBlock
from mlx_lm.utils import infer_quant_config

from .. import mtp
from ..errors import CheckpointError, ConfigError
from ..layers import (
    LilyAttention, LilyDecoderLayer, LilyDenseMLP, LilyGatedDeltaNet, LilyLanguageModel, LilySparseMoeBlock,
    LilyTextModel,
)

_SPECIALIZE = {
    # The head (lm_head on lily's GEMV for the server's decode batches).
    TextModel: LilyLanguageModel,
    Qwen3_5TextModel: LilyTextModel,
    DecoderLayer: LilyDecoderLayer,
    GatedDeltaNet: LilyGatedDeltaNet,
    Qwen3NextAttention: LilyAttention,
    Qwen3NextSparseMoeBlock: LilySparseMoeBlock,
    # A layer's dense MLP (no num_experts). The MoE block's shared expert is
    # the same stock class and stays stock's: the MoE paths read its weights.
    Qwen3NextMLP: LilyDenseMLP,
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
    "vocab_size": "the vocabulary size",
}

# Required as well where the layers are MoE blocks (num_experts > 0); without
# num_experts (or with 0) stock builds dense MLP layers and reads none of them.
_MOE_FIELDS = {
    "num_experts_per_tok": "experts each token is routed to",
    "moe_intermediate_size": "each routed expert's hidden size",
    "shared_expert_intermediate_size": "the shared expert's hidden size",
}


def _is_positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def is_moe(text_config: Dict[str, Any]) -> bool:
    """Whether stock builds MoE blocks (num_experts > 0) or dense MLP layers."""
    experts = text_config.get("num_experts", 0)
    return isinstance(experts, int) and not isinstance(experts, bool) and experts > 0


def check_config(params: Dict[str, Any]) -> None:
    """Name the first config.json field that is missing or out of range."""
    text = params.get("text_config", params)
    where = "text_config." if "text_config" in params else ""
    experts = text.get("num_experts", 0)
    if not isinstance(experts, int) or isinstance(experts, bool):
        raise ConfigError(
            f"config.json {where}num_experts is {experts!r}; expected an integer (routed experts "
            "per layer; 0 or absent for dense MLP layers)"
        )
    required = dict(_REQUIRED_FIELDS, **(_MOE_FIELDS if is_moe(text) else {}))
    for name, meaning in required.items():
        if name not in text:
            raise ConfigError(f"config.json has no {where}{name} ({meaning}: a positive integer)")
        if not _is_positive_int(text[name]):
            raise ConfigError(
                f"config.json {where}{name} is {text[name]!r}; expected {meaning}, a positive integer"
            )
    if is_moe(text) and text["num_experts_per_tok"] > experts:
        raise ConfigError(
            f"config.json {where}num_experts_per_tok is {text['num_experts_per_tok']}; expected "
            f"at most {where}num_experts ({experts})"
        )
    for many, few in (("num_attention_heads", "num_key_value_heads"),
                      ("linear_num_value_heads", "linear_num_key_heads")):
        if text[many] % text[few]:
            raise ConfigError(
                f"config.json {where}{many} ({text[many]}) is not a multiple of "
                f"{where}{few} ({text[few]})"
            )
    # mlx-lm's loader reads the top level's group_size and bits (and nothing
    # else of it: each layer's quantization comes from its own entry or its
    # tensors, checked in sanitize); null means no quantization, as there.
    quant = params.get("quantization")
    if quant is not None:
        if not isinstance(quant, dict):
            raise ConfigError(f"config.json quantization is {quant!r}; expected an object with "
                              "group_size and bits")
        for name in ("group_size", "bits"):
            if name not in quant:
                raise ConfigError(f"config.json quantization has no {name}")


class ModelArgs(stock.ModelArgs):
    @classmethod
    def from_dict(cls, params):
        check_config(params)
        args = super().from_dict(params)
        # What config.json declares, to check the tensors against in sanitize.
        args.declared_quantization = params.get("quantization")
        return args


def specialize(model: stock.Model, lily: bool = True) -> stock.Model:
    """Switch a built qwen3_5_moe model's layers (its MTP head's included) to
    lily's classes (or back to stock's) in place. The weights are shared, not copied, so one model can be
    measured both ways in one process (bench/)."""
    table = _SPECIALIZE if lily else {v: k for k, v in _SPECIALIZE.items()}
    language = getattr(model, "language_model", None)
    text = getattr(language, "model", None)
    for module in (language, text):
        if type(module) in table:
            module.__class__ = table[type(module)]
    head = mtp.head_of(model)
    for layer in [*model.layers, *(head.layers if head is not None else [])]:
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
        raw = weights
        weights = super().sanitize(weights)
        # Stock drops the MTP head's tensors (mtp.*); lily keeps the head
        # where the checkpoint has one, built here so mlx-lm quantizes it
        # with the rest (mlx_lily/mtp.py).
        weights = mtp.keep_head(self, raw, weights)
        specialize(self)  # the head's layer too: its drafts on lily's ops
        if not is_moe(self.args.text_config):
            _check_dense_weights(self, weights)
        declared = getattr(self.args, "declared_quantization", None)
        # Before mlx-lm quantizes the model, which fails deep inside (or in
        # load_weights) on a layer's quantization MLX cannot build or tensors
        # of another packing than the one it builds.
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


def _check_dense_weights(model: Model, weights: Dict[str, mx.array]) -> None:
    """Without num_experts stock builds dense MLP layers: MoE tensors in the
    checkpoint mean config.json lost the field (stock lists every one of them
    as a parameter not in the model)."""
    for name in sorted(weights):
        if ".mlp.switch_mlp." in name or ".mlp.shared_expert" in name or ".mlp.gate." in name:
            text = model.args.text_config
            state = f"is {text['num_experts']}" if "num_experts" in text else "is missing"
            raise ConfigError(
                f"config.json text_config.num_experts {state}, so each layer's MLP is dense, but the "
                f"checkpoint holds MoE tensors (e.g. {name!r}); set num_experts to the routed experts per layer"
            )


def _stock_quantization(path: str, module: Any, weights: Dict[str, mx.array],
                        declared: Dict[str, Any]) -> Tuple[Optional[Dict[str, Any]], str]:
    """(parameters, source): the quantization mlx-lm 0.32's loader gives the
    layer at ``path``, and where it takes it from. As its ``class_predicate``:
    config.json's entry for the layer where there is one (a dict; True: the
    top level's; anything else: not quantized), else, where the checkpoint has
    the layer's scales, what ``infer_quant_config`` reads off the tensors
    (the top-level bits and group size are not used for it); else none."""
    if path in declared:
        entry = declared[path]
        if entry is True:
            entry = {k: declared[k] for k in ("group_size", "bits", "mode") if k in declared}
        return (entry if isinstance(entry, dict) else None), f"config.json quantization.{path}"
    if f"{path}.scales" not in weights:
        return None, ""
    try:
        return infer_quant_config(path, module, weights), "tensors"
    except ZeroDivisionError:
        raise CheckpointError(
            f"checkpoint tensor '{path}.scales' has shape {tuple(weights[f'{path}.scales'].shape)}: "
            "no quantization group"
        ) from None
    except ValueError as exc:  # scales of an fp mode (uint8) at bits and group size no mode has
        raise CheckpointError(f"checkpoint tensor '{path}.weight': {exc}") from None


_PACKINGS: Dict[str, Tuple[Optional[Tuple[int, int]], str]] = {}


def _packing(in_dims: int, group_size: Any, bits: Any, mode: Any) -> Tuple[Optional[Tuple[int, int]], str]:
    """((words, groups) per row, "") that MLX packs a row of ``in_dims`` inputs
    into at this quantization, or (None, MLX's reason) where it cannot. MLX
    itself is asked (the layer's ``to_quantized`` calls the same
    ``mx.quantize``), so lily accepts exactly the quantizations this MLX
    builds."""
    key = repr((in_dims, group_size, bits, mode))  # config.json values need not be hashable
    if key not in _PACKINGS:
        try:
            packed = mx.quantize(mx.zeros((1, in_dims)), group_size=group_size, bits=bits, mode=mode)
            _PACKINGS[key] = (packed[0].shape[-1], packed[1].shape[-1]), ""
        except (ValueError, TypeError, RuntimeError) as exc:
            _PACKINGS[key] = None, " ".join(str(exc).split())
    return _PACKINGS[key]


def _check_packed_tensors(model: Model, weights: Dict[str, mx.array], declared: Optional[Dict[str, Any]]) -> None:
    """Each quantized layer has its packed weight, MLX can build the layer's
    quantization, and the tensors are packed the way it builds them.

    The quantization of each layer is the one stock's loader gives it
    (``_stock_quantization``): config.json's entry for the layer, else what
    the tensors themselves say. So lily loads exactly what stock loads, at the
    same bits and group size per layer (e.g. 8-bit router gates under a
    config.json that declares only 4 bits at its top level), and refuses what
    stock fails on: a layer entry MLX has no quantization for, tensors of
    another packing than a layer entry declares, tensors that are no whole
    number of bits per weight or of inputs per group."""
    modules = dict(model.named_modules())
    for name in sorted(weights):
        if not name.endswith(".scales"):
            continue
        prefix = name[: -len(".scales")]
        module = modules.get(prefix)
        if module is not None and hasattr(module, "weight") and f"{prefix}.weight" not in weights:
            raise CheckpointError(
                f"checkpoint is missing tensor '{prefix}.weight' (its '{name}' is there; expected "
                f"a packed weight for {tuple(module.weight.shape)} values)"
            )
    if declared is None:
        return
    for path, module in sorted(modules.items()):
        if not hasattr(module, "to_quantized") or not hasattr(module, "weight"):
            continue
        params, source = _stock_quantization(path, module, weights, declared)
        if params is None:
            continue
        in_dims = module.weight.shape[-1]
        mode, bits, group = params.get("mode", "affine"), params.get("bits"), params.get("group_size")
        weight, scales = weights.get(f"{path}.weight"), weights.get(f"{path}.scales")
        if source == "tensors" and ((weight.shape[-1] * 32) % in_dims or in_dims % scales.shape[-1]):
            raise CheckpointError(
                f"checkpoint tensor '{path}.weight' (shape {tuple(weight.shape)}, scales "
                f"{tuple(scales.shape)}) is no quantized layer of {in_dims} inputs: "
                f"{weight.shape[-1] * 32 / in_dims:.3g} bits per weight, "
                f"{in_dims / scales.shape[-1]:.3g} inputs per group"
            )
        packing, reason = _packing(in_dims, group, bits, mode)
        if packing is None:
            what = f"{source} declares" if source != "tensors" else "its tensors are packed at"
            raise CheckpointError(
                f"unsupported quantization for tensor {path!r}: {what} mode={mode}, bits={bits}, "
                f"group_size={group}, which MLX cannot build ({reason})"
            )
        if weight is None or scales is None:
            continue  # a declared layer without its tensors: named by _check_weights
        if (weight.shape[-1], scales.shape[-1]) != packing:
            group_got = in_dims // scales.shape[-1] if scales.shape[-1] else 0
            bits_got, inexact = divmod(weight.shape[-1] * 32, in_dims)
            got = f"{weight.shape[-1] * 32 / in_dims:.3g}" if inexact else str(bits_got)
            raise CheckpointError(
                f"checkpoint tensor '{path}.weight' is packed at {got} bits, group size {group_got} "
                f"(shape {tuple(weight.shape)}, scales {tuple(scales.shape)}, {in_dims} inputs), "
                f"but {source} declares {bits} bits, group size {group}; mlx-lm builds the layer "
                "as config.json names it"
            )
