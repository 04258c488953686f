"""Random checkpoints in the original (Hugging Face) layout of Qwen3.5/3.6
MoE: the names, fused experts, conv layout and norm offsets that mlx-lm's
sanitize converts from, so that tests load and graft what Qwen publishes
(``make_checkpoint(..., original=True)``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Dict

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten


# RMSNorm weights the original checkpoint stores as offsets from 1 (mlx-lm's
# sanitize adds 1 to them; the Gated DeltaNet's gated norm is stored as is).
_OFFSET_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight",
                 ".k_norm.weight", "model.norm.weight", "mtp.norm.weight", "mtp.pre_fc_norm_embedding.weight",
                 "mtp.pre_fc_norm_hidden.weight")


def original_weights(model: nn.Module) -> Dict[str, mx.array]:
    """An unquantized model's weights under the original (Hugging Face)
    checkpoint's names and layouts: what mlx-lm's sanitize turns back into
    the model's parameters."""
    params = dict(tree_flatten(model.parameters()))
    out: Dict[str, mx.array] = {}
    for key, value in params.items():
        if value.dtype == mx.uint32:
            raise ValueError(f"original_weights takes an unquantized model ({key} is packed)")
        if ".switch_mlp." in key:
            base, rest = key.split(".switch_mlp.")
            if rest == "gate_proj.weight":  # [E, I, D] each, fused as [E, 2I, D]
                up = params[f"{base}.switch_mlp.up_proj.weight"]
                value, rest = mx.concatenate([value, up], axis=-2), "experts.gate_up_proj"
            elif rest == "down_proj.weight":
                rest = "experts.down_proj"
            else:
                continue  # up_proj: fused above
            key = f"{base}.{rest}"
        if key.startswith("language_model.model."):
            key = "model.language_model." + key[len("language_model.model."):]
        elif key.startswith("language_model."):  # lm_head, mtp
            key = key[len("language_model."):]
        if key.endswith("conv1d.weight"):
            value = value.moveaxis(1, 2)  # mlx [C, K, 1] -> [C, 1, K]
        elif key.endswith(_OFFSET_NORMS) and value.ndim == 1:
            value = value - 1.0
        out[key] = value
    return out


def save_original(folder: Path, model: nn.Module) -> None:
    """The original layout's two shards (the MTP head's tensors in the
    second, as in Qwen's checkpoints) and their index."""
    weights = original_weights(model)
    shards = [{k: v for k, v in weights.items() if not k.startswith("mtp.")},
              {k: v for k, v in weights.items() if k.startswith("mtp.")}]
    shards = [shard for shard in shards if shard]
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        mx.save_safetensors(str(folder / name), shard, metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
    total = sum(v.nbytes for v in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
