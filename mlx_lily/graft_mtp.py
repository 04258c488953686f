"""``python -m mlx_lily graft-mtp CHECKPOINT ORIGINAL``: add the MTP head of
Qwen's original safetensors to an mlx-lm checkpoint that lacks it (mlx-lm's
conversion drops ``mtp.*``; the mlx-community 4-bit checkpoints have none).

The head's tensors are read from ORIGINAL (a local folder of the original
checkpoint: its ``model.safetensors.index.json`` names the shards that hold
them, else every ``*.safetensors`` file is searched; only those tensors are
read), brought into mlx-lm's layout (``mlx_lily.mtp.sanitize_original``),
checked against the head that CHECKPOINT's config.json builds, cast to the
checkpoint's dtype and quantized as ``mlx_lm.convert`` quantizes a layer: the
checkpoint's group size, bits and mode, mlx-lm's quant predicate for the
model (router and shared-expert gates at 8 bits), a layer whose input is no
whole number of groups left unquantized, and the predicate's per-layer
settings recorded in config.json. They go to ``model-mtp.safetensors`` in
CHECKPOINT (the index, where there is one, lists them), and config.json gets
``text_config.mtp_num_hidden_layers``. Nothing else in CHECKPOINT changes.

Every refusal is one line naming the file or tensor (CheckpointError).
"""

from __future__ import annotations

import json
import os
import struct
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from . import mtp
from .errors import CheckpointError

OUTPUT_FILE = "model-mtp.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def _read_header(path: Path) -> Dict[str, Any]:
    """A safetensors file's tensor table (name -> dtype, shape, offsets),
    read without loading the tensors."""
    try:
        with open(path, "rb") as f:
            size = struct.unpack("<Q", f.read(8))[0]
            if size > os.path.getsize(path):
                raise ValueError("header longer than the file")
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as exc:
        raise CheckpointError(f"{path} is not a readable safetensors file ({exc})") from None
    header.pop("__metadata__", None)
    return header


def _read_json(path: Path) -> Dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path} does not exist") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not readable JSON ({exc})") from None


def _weight_files(folder: Path) -> List[Path]:
    return sorted(p for p in folder.glob("*.safetensors") if p.is_file())


def head_files(original: Path) -> Dict[str, Path]:
    """{tensor name: file} for the ``mtp.*`` tensors of the original folder."""
    if not original.is_dir():
        raise CheckpointError(f"{original} is not a folder (expected the original checkpoint's safetensors)")
    index = original / INDEX_FILE
    found: Dict[str, Path] = {}
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map")
        for name, file in weight_map.items():
            if name.startswith("mtp."):
                path = original / file
                if not path.is_file():
                    raise CheckpointError(f"{index} puts tensor {name!r} in {file}, which is not in {original}")
                found[name] = path
        searched = f"{index}'s weight_map"
    else:
        files = _weight_files(original)
        if not files:
            raise CheckpointError(f"{original} has no .safetensors file")
        for path in files:
            for name in _read_header(path):
                if name.startswith("mtp."):
                    found[name] = path
        searched = f"the {len(files)} safetensors file{'s' if len(files) != 1 else ''} in {original}"
    if not found:
        raise CheckpointError(
            f"no MTP head in {original}: no 'mtp.*' tensor in {searched} (expected Qwen's original "
            "checkpoint, whose config.json declares mtp_num_hidden_layers)"
        )
    # Each listed tensor must be in its file (an index can be stale).
    headers: Dict[Path, Dict[str, Any]] = {}
    for name, path in found.items():
        header = headers.setdefault(path, _read_header(path))
        if name not in header:
            raise CheckpointError(f"{path.name} has no tensor {name!r}, which {INDEX_FILE} puts there")
    return found


def _checkpoint_keys(checkpoint: Path) -> Dict[str, Path]:
    """{tensor name: file} of an mlx checkpoint (headers only)."""
    files = sorted(checkpoint.glob("model*.safetensors"))
    if not files:
        raise CheckpointError(f"{checkpoint} has no model*.safetensors file (expected an mlx-lm checkpoint)")
    return {name: path for path in files for name in _read_header(path)}


def _text_args(config: Dict[str, Any]):
    from mlx_lm.models.qwen3_5 import TextModelArgs

    from .models.qwen3_5_moe import check_config

    check_config(config)
    return TextModelArgs.from_dict(config.get("text_config", config))


def quant_predicate(text_args) -> Optional[Any]:
    """mlx-lm's quant predicate for the language model (its TextModel's)."""
    from mlx_lm.models.qwen3_5 import TextModel

    return TextModel.quant_predicate.fget(SimpleNamespace(args=text_args))


def quantize_head(head: nn.Module, quantization: Dict[str, Any], predicate: Any,
                  prefix: str = mtp.PREFIX) -> Dict[str, Dict[str, Any]]:
    """Quantize ``head`` in place as mlx-lm's ``quantize_model`` quantizes a
    model's layers: the given group size, bits and mode, the model's
    predicate at each layer's full path (``prefix`` + its path), layers whose
    input is no whole number of groups left as they are. Returns the
    per-layer settings mlx-lm records in config.json (the predicate's dicts)."""
    group_size, bits = quantization["group_size"], quantization["bits"]
    mode = quantization.get("mode", "affine")
    recorded: Dict[str, Dict[str, Any]] = {}

    def class_predicate(path: str, module: nn.Module):
        if not hasattr(module, "to_quantized") or module.weight.shape[-1] % group_size != 0:
            return False
        choice = predicate(prefix + path, module) if predicate is not None else True
        if isinstance(choice, dict):
            recorded[prefix + path] = dict(choice)
        return choice

    nn.quantize(head, group_size=group_size, bits=bits, mode=mode, class_predicate=class_predicate)
    return recorded


def _dtype_of(checkpoint_keys: Dict[str, Path]) -> mx.Dtype:
    """The checkpoint's activation dtype: its quantization scales', else its
    embedding's."""
    for wanted in (".scales", "embed_tokens.weight"):
        for name, path in checkpoint_keys.items():
            if name.endswith(wanted):
                dtype = _read_header(path)[name]["dtype"]
                return {"BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32}.get(dtype, mx.bfloat16)
    return mx.bfloat16


def graft(checkpoint: Path, original: Path, *, force: bool = False) -> Tuple[Path, int]:
    """Add ORIGINAL's MTP head to the mlx checkpoint CHECKPOINT; returns the
    file written and the number of tensors in it."""
    checkpoint, original = Path(checkpoint), Path(original)
    config_path = checkpoint / "config.json"
    config = _read_json(config_path)
    if config.get("model_type") != "qwen3_5_moe":
        raise CheckpointError(
            f"{config_path} has model_type {config.get('model_type')!r}; graft-mtp takes qwen3_5_moe checkpoints"
        )
    keys = _checkpoint_keys(checkpoint)
    existing = sorted(k for k in keys if mtp.split_head_tensors({k: None}))
    if existing:
        where = {keys[k].name for k in existing}
        if not force or where != {OUTPUT_FILE}:
            hint = " (--force replaces it)" if where == {OUTPUT_FILE} else ""
            raise CheckpointError(
                f"{checkpoint} already has an MTP head: tensor {existing[0]!r} in {keys[existing[0]].name}{hint}"
            )
    text_args = _text_args(config)

    files = head_files(original)
    tensors: Dict[str, mx.array] = {}
    for path in sorted(set(files.values())):
        loaded = mx.load(str(path))  # lazy: only the head's tensors are read
        tensors.update({name[len("mtp."):]: loaded[name] for name, p in files.items() if p == path})
    sources: Dict[str, str] = {}
    where = f"{original}"
    sanitized = mtp.sanitize_original(tensors, norm_offsets=True, where=where, sources=sources)
    if any(v.dtype == mx.uint32 for v in tensors.values()):
        packed = next(k for k, v in tensors.items() if v.dtype == mx.uint32)
        raise CheckpointError(
            f"tensor 'mtp.{packed}' in {files['mtp.' + packed].name} is packed (uint32); graft-mtp reads the "
            "original, unquantized safetensors"
        )
    n = mtp.num_layers_of(sanitized, where)
    declared = mtp.declared_layers(config.get("text_config", config))
    if declared is not None and declared != n:
        raise CheckpointError(
            f"{config_path} declares text_config.{mtp.LAYERS_FIELD} = {declared}, but {original}'s head has {n} "
            f"layer{'s' if n != 1 else ''}"
        )
    head = mtp.MTPHead(text_args, n)
    expected = dict(tree_flatten(head.parameters()))

    def original_name(key: str) -> str:
        name = "mtp." + sources.get(key, key)
        file = files.get(name)
        return f"{name!r} in {file.name}" if file is not None else repr(name)

    missing = sorted(expected.keys() - sanitized.keys())
    if missing:
        more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
        raise CheckpointError(
            f"{original} is missing tensor {_original_form(missing[0])!r} (shape "
            f"{_original_shape(missing[0], expected)}){more}"
        )
    extra = sorted(sanitized.keys() - expected.keys())
    if extra:
        raise CheckpointError(
            f"{original} has tensor {original_name(extra[0])}, which the MTP head of this config.json does not use"
        )
    for key, value in expected.items():
        got = sanitized[key]
        if tuple(got.shape) != tuple(value.shape):
            source = tensors.get(sources.get(key, key))
            shape, want = (tuple(source.shape), _original_shape(key, expected)) if source is not None else (
                tuple(got.shape), tuple(value.shape))  # experts one tensor each: as stacked
            raise CheckpointError(
                f"tensor {original_name(key)} has shape {shape}; expected {want} from {config_path}"
            )

    dtype = _dtype_of(keys)
    head.load_weights([(k, v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v)
                       for k, v in sanitized.items()])
    quantization = config.get("quantization")
    recorded: Dict[str, Dict[str, Any]] = {}
    if quantization is not None:
        recorded = quantize_head(head, quantization, quant_predicate(text_args))
        # mlx-lm's entries in this checkpoint carry a mode or not: the same here.
        with_mode = any(isinstance(v, dict) and "mode" in v for v in quantization.values())
        if with_mode:
            recorded = {k: dict(v, mode=v.get("mode", quantization.get("mode", "affine"))) for k, v in recorded.items()}
    out = {mtp.PREFIX + k: v for k, v in tree_flatten(head.parameters())}
    mx.eval(out)

    # Written beside, then moved into place: an interrupted graft leaves the
    # checkpoint as it was.
    target = checkpoint / OUTPUT_FILE
    partial = checkpoint / ".model-mtp.partial.safetensors"  # hidden: no model*.safetensors glob sees it
    mx.save_safetensors(str(partial), out, metadata={"format": "mlx"})
    new_config = dict(config)
    new_config.get("text_config", new_config)[mtp.LAYERS_FIELD] = n
    for field in ("quantization", "quantization_config"):
        if isinstance(new_config.get(field), dict):
            new_config[field] = {k: v for k, v in new_config[field].items() if not k.startswith(mtp.PREFIX)}
            new_config[field].update(recorded)
    index_path = checkpoint / INDEX_FILE
    index = _read_json(index_path) if index_path.is_file() else None
    if index is not None:
        weight_map = {k: v for k, v in index.get("weight_map", {}).items() if not k.startswith(mtp.PREFIX)}
        weight_map.update({k: OUTPUT_FILE for k in out})
        index["weight_map"] = dict(sorted(weight_map.items()))
        others = {p for p in keys.values() if p.name != OUTPUT_FILE}
        index.setdefault("metadata", {})["total_size"] = (
            sum(v.nbytes for v in out.values()) + sum(_tensor_bytes(p) for p in others))
    os.replace(partial, target)
    _write_json(config_path, new_config)
    if index is not None:
        _write_json(index_path, index)
    return target, len(out)


def _tensor_bytes(path: Path) -> int:
    return sum(t["data_offsets"][1] - t["data_offsets"][0] for t in _read_header(path).values())


def _write_json(path: Path, content: Dict[str, Any]) -> None:
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(content, indent=4, sort_keys=path.name == "config.json") + "\n")
    os.replace(partial, path)


def _original_form(key: str) -> str:
    """The original checkpoint's name for a head parameter (mlx layout key
    relative to ``mtp.``)."""
    if ".switch_mlp." in key:
        base, rest = key.split(".switch_mlp.")
        return f"mtp.{base}.experts.{'down_proj' if rest.startswith('down_proj') else 'gate_up_proj'}"
    return f"mtp.{key}"


def _original_shape(key: str, expected: Dict[str, mx.array]) -> Tuple[int, ...]:
    shape = tuple(expected[key].shape)
    if ".switch_mlp." in key and not key.endswith("down_proj.weight"):
        return shape[:-2] + (2 * shape[-2], shape[-1])
    return shape


USAGE = """usage: python -m mlx_lily graft-mtp CHECKPOINT ORIGINAL [--force]

Add the MTP (multi-token prediction) head of Qwen's original safetensors in the
folder ORIGINAL to the mlx-lm checkpoint CHECKPOINT, quantized as mlx-lm
quantizes the rest (CHECKPOINT's group size and bits, mlx-lm's predicate). It
writes CHECKPOINT/model-mtp.safetensors and updates config.json (and the index,
where there is one). --force replaces a head grafted before."""


def main(argv: List[str]) -> int:
    args = [a for a in argv if a != "--force"]
    if any(a in ("-h", "--help") for a in argv):
        print(USAGE)
        return 0
    if len(args) != 2 or any(a.startswith("-") for a in args):
        print(USAGE, file=sys.stderr)
        return 2
    target, count = graft(Path(args[0]), Path(args[1]), force="--force" in argv)
    print(f"mlx-lily: grafted the MTP head ({count} tensors) into {target}")
    return 0
