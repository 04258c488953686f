"""Prompt cache files with their Gated DeltaNet checkpoints (prefix reuse).

A file holds one prompt cache entry: its tokens, each layer's cache and the
entry's checkpoints (``prefix_reuse.Checkpoint``), in safetensors whose
metadata names the format and the model (``fingerprint``). ``load_cache_file``
refuses, in one line, a file of another model or another format (a stock
``mlx_lm.cache_prompt`` file included): its states would load without an
error and answer wrongly. Design: docs/prefix-reuse.md.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, Iterable, List, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from .errors import LilyError
from .prefix_reuse import Checkpoint

FILE_FORMAT = "lily-prefix-checkpoints/1"


class PromptCacheFileError(LilyError):
    """A prompt cache file lily will not load (another model, another format)."""


def fingerprint(model: Any) -> str:
    """Which model a cache file's states belong to: every parameter's name,
    shape and dtype, and a few of its values (so another checkpoint of the
    same architecture differs too)."""
    from mlx.utils import tree_flatten

    digest = hashlib.sha256()
    params = tree_flatten(model.parameters())
    for name, a in params:
        digest.update(f"{name}:{tuple(a.shape)}:{a.dtype};".encode())
    for _, a in params[:: max(1, len(params) // 16)]:
        sample = a.reshape(-1)[:64]
        digest.update(memoryview(sample.view(mx.uint8) if sample.dtype != mx.bool_ else sample.astype(mx.uint8)))
    return digest.hexdigest()[:32]


def save_cache_file(path: str, model: Any, tokens: Sequence[int], prompt_cache: List[Any],
                    checkpoints: Iterable[Checkpoint] = ()) -> None:
    """A prompt cache with its tokens and checkpoints, for ``load_cache_file``
    (safetensors; the metadata names the format and the model)."""
    arrays: Dict[str, mx.array] = {}
    layers = []
    for i, c in enumerate(prompt_cache):
        if type(c) is KVCache:
            layers.append("KVCache")
            if c.keys is not None:
                arrays[f"cache.{i}.keys"] = c.keys[..., :c.offset, :]
                arrays[f"cache.{i}.values"] = c.values[..., :c.offset, :]
        elif type(c) is ArraysCache:
            layers.append(f"ArraysCache:{len(c.cache)}")
            for e, a in enumerate(c.cache):
                if a is not None:
                    arrays[f"cache.{i}.{e}"] = a
        else:
            raise PromptCacheFileError(f"cannot save a {type(c).__name__} (layer {i}) with prefix checkpoints")
    listed = []
    for n, ck in enumerate(checkpoints):
        listed.append([ck.position, None if ck.cuts is None else list(ck.cuts), ck.step,
                       {str(j): len(v) for j, v in ck.states.items()}])
        for j, states in ck.states.items():
            for e, a in enumerate(states):
                arrays[f"checkpoint.{n}.{j}.{e}"] = a
    metadata = {
        "format": FILE_FORMAT, "model": fingerprint(model), "tokens": json.dumps(list(tokens)),
        "layers": json.dumps(layers), "checkpoints": json.dumps(listed),
    }
    mx.save_safetensors(str(path), arrays, metadata)


def load_cache_file(path: str, model: Any) -> Tuple[List[int], List[Any], List[Checkpoint]]:
    """(tokens, prompt cache, checkpoints) from ``save_cache_file``'s file;
    another format (a stock ``mlx_lm.cache_prompt`` file, any other file) or
    another model's file is refused with one line (PromptCacheFileError)."""
    try:
        arrays, metadata = mx.load(str(path), return_metadata=True)
    except Exception as exc:  # noqa: BLE001 - say which file, in one line
        raise PromptCacheFileError(f"{path}: not a prompt cache file ({exc})") from None
    found = metadata.get("format")
    if found != FILE_FORMAT:
        kind = "a stock mlx-lm prompt cache (no tokens or checkpoints)" if found is None else f"format {found!r}"
        raise PromptCacheFileError(f"{path}: {kind}; lily reads {FILE_FORMAT!r} files only")
    if metadata.get("model") != fingerprint(model):
        raise PromptCacheFileError(f"{path}: made with another model (fingerprint {metadata.get('model')}, "
                                   f"this model's {fingerprint(model)})")
    try:
        tokens = [int(t) for t in json.loads(metadata["tokens"])]
        layers = json.loads(metadata["layers"])
        cache: List[Any] = []
        for i, kind in enumerate(layers):
            if kind == "KVCache":
                c = KVCache()
                if f"cache.{i}.keys" in arrays:
                    keys, values = arrays[f"cache.{i}.keys"], arrays[f"cache.{i}.values"]
                    c.state = (keys, values, keys.shape[2])
            else:
                c = ArraysCache(int(kind.split(":")[1]))
                c.cache = [arrays.get(f"cache.{i}.{e}") for e in range(len(c.cache))]
            cache.append(c)
        checkpoints = [
            Checkpoint(int(p), None if cuts is None else tuple(cuts), int(step),
                       {int(j): tuple(arrays[f"checkpoint.{n}.{j}.{e}"] for e in range(k)) for j, k in states.items()})
            for n, (p, cuts, step, states) in enumerate(json.loads(metadata["checkpoints"]))
        ]
    except (KeyError, ValueError, TypeError, IndexError) as exc:
        raise PromptCacheFileError(f"{path}: a damaged {FILE_FORMAT!r} file ({type(exc).__name__}: {exc})") from None
    expected = model.make_cache() if hasattr(model, "make_cache") else None
    if expected is not None and [type(c) for c in expected] != [type(c) for c in cache]:
        raise PromptCacheFileError(f"{path}: its layers do not match this model's caches")
    return tokens, cache, checkpoints


