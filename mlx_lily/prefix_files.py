"""Prompt cache files with their Gated DeltaNet checkpoints (prefix reuse).

Lily's file *is* an ``mlx_lm.cache_prompt`` file: mlx-lm's own layout (the
caches' states, their classes, ``save_prompt_cache``'s metadata), so
``mlx_lm.generate --prompt-cache-file`` loads it on either backend. Lily adds,
where stock's loader never looks:

* metadata keys ``lily_format``, ``lily_model`` (``fingerprint``) and
  ``lily_checkpoints`` (each checkpoint's position, cut history, chunk size
  and layers), beside stock's ``model`` and ``tokenizer_config``;
* arrays under the index one past the last layer (``{L}.tokens``: the
  prompt's tokens; ``{L}.checkpoints.{n}.{layer}.{i}``: the states), which
  stock's loader unflattens into a trailing list item and drops when it pairs
  states with classes.

``load_cache_file`` (tokens, cache, checkpoints for a prompt cache entry)
reads only lily's files of this model; ``check_file`` (``mlx_lm.generate
--prompt-cache-file`` on lily) also takes a stock file whose layers fit the
model. Any other file is refused in one line (``PromptCacheFileError``): its
states would load without an error and answer wrongly. Design:
docs/prefix-reuse.md.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models.cache import ArraysCache, load_prompt_cache

from .errors import LilyError
from .prefix_reuse import Checkpoint

FILE_FORMAT = "lily-prefix-checkpoints/2"
# Keys lily adds to save_prompt_cache's metadata.
FORMAT_KEY, MODEL_KEY, CHECKPOINTS_KEY = "lily_format", "lily_model", "lily_checkpoints"


class PromptCacheFileError(LilyError):
    """A prompt cache file lily will not load (another model, another format)."""


def fingerprint(model: Any) -> str:
    """Which model a cache file's states belong to: every parameter's name,
    shape and dtype, and a few of its values (so another checkpoint of the
    same architecture differs too)."""
    digest = hashlib.sha256()
    params = tree_flatten(model.parameters())
    for name, a in params:
        digest.update(f"{name}:{tuple(a.shape)}:{a.dtype};".encode())
    for _, a in params[:: max(1, len(params) // 16)]:
        sample = a.reshape(-1)[:64]
        digest.update(memoryview(sample.view(mx.uint8) if sample.dtype != mx.bool_ else sample.astype(mx.uint8)))
    return digest.hexdigest()[:32]


# ------------------------------------------------------------------ writing


def _stock_layout(cache: List[Any], metadata: Dict[str, str]) -> Tuple[Dict[str, mx.array], Dict[str, str]]:
    """The arrays and metadata ``save_prompt_cache`` writes for ``cache``:
    each state leaf under its flattened path, a leaf that is not an array
    stored as one and listed with its kind, then [metadata, classes, kinds]
    flattened into the safetensors metadata."""
    arrays: Dict[str, mx.array] = {}
    kinds: List[Any] = [""]  # a list tree_flatten keeps even when nothing follows
    for key, leaf in tree_flatten([c.state for c in cache]):
        if isinstance(leaf, mx.array):
            arrays[key] = leaf
        elif leaf is None:
            kinds.append((key, "none"))
            arrays[key] = mx.array([])
        elif isinstance(leaf, str):
            kinds.append((key, "string"))
            arrays[key] = mx.array([ord(ch) for ch in leaf])
        elif isinstance(leaf, (bool, int, float)):
            kinds.append((key, "scalar"))
            arrays[key] = mx.array(leaf)
        else:
            raise PromptCacheFileError(f"cannot save a {type(leaf).__name__} in a prompt cache file ({key})")
    classes = [type(c).__name__ for c in cache]
    return arrays, dict(tree_flatten([dict(metadata), classes, kinds]))


def save_cache_file(path: str, model: Any, tokens: Sequence[int], prompt_cache: List[Any],
                    checkpoints: Iterable[Checkpoint] = (), metadata: Optional[Dict[str, str]] = None) -> None:
    """A prompt cache with its tokens and checkpoints: mlx-lm's prompt cache
    file (``metadata`` as ``save_prompt_cache``'s: model, tokenizer_config)
    plus lily's keys and arrays (module docstring)."""
    extra = dict(metadata or {})
    tail = len(prompt_cache)
    ours: Dict[str, mx.array] = {f"{tail}.tokens": mx.array(list(tokens), dtype=mx.int32)}
    listed = []
    for n, ck in enumerate(checkpoints):
        listed.append([ck.position, None if ck.cuts is None else list(ck.cuts), ck.step,
                       {str(j): len(v) for j, v in ck.states.items()}])
        for j, states in ck.states.items():
            for e, a in enumerate(states):
                ours[f"{tail}.checkpoints.{n}.{j}.{e}"] = a
    extra.update({FORMAT_KEY: FILE_FORMAT, MODEL_KEY: fingerprint(model), CHECKPOINTS_KEY: json.dumps(listed)})
    arrays, flat_metadata = _stock_layout(prompt_cache, extra)
    mx.save_safetensors(str(path), {**arrays, **ours}, flat_metadata)


# ------------------------------------------------------------------ reading


def read_header(path: str) -> Tuple[Dict[str, mx.array], Dict[str, str], List[str]]:
    """(arrays, save_prompt_cache's metadata, cache classes) of a prompt
    cache file; the arrays are lazy (nothing is read until used). A file that
    is not an mlx-lm prompt cache file is refused in one line."""
    try:
        arrays, flat = mx.load(str(path), return_metadata=True)
    except Exception as exc:  # noqa: BLE001 - say which file, in one line
        raise PromptCacheFileError(f"{path}: not a prompt cache file ({type(exc).__name__}: {exc})") from None
    if not isinstance(arrays, dict):
        raise PromptCacheFileError(f"{path}: not a prompt cache file (not safetensors)")
    try:
        metadata, classes, _ = tree_unflatten(list(flat.items()))
        if not isinstance(metadata, dict) or not all(isinstance(c, str) for c in classes):
            raise TypeError("unexpected layout")
    except (ValueError, TypeError, AttributeError) as exc:
        found = flat.get("format")
        kind = f"format {found!r} (an earlier lily format)" if found else "not an mlx-lm prompt cache file"
        raise PromptCacheFileError(f"{path}: {kind}; lily reads mlx-lm prompt cache files "
                                   f"(mlx_lm.cache_prompt, python -m mlx_lily cache-prompt)") from None
    return arrays, metadata, list(classes)


def _check_lily_file(path: str, metadata: Dict[str, str], model: Any) -> None:
    found = metadata.get(FORMAT_KEY)
    if found != FILE_FORMAT:
        raise PromptCacheFileError(f"{path}: lily checkpoint format {found!r}; this lily reads {FILE_FORMAT!r}")
    if metadata.get(MODEL_KEY) != fingerprint(model):
        raise PromptCacheFileError(f"{path}: made with another model (fingerprint {metadata.get(MODEL_KEY)}, "
                                   f"this model's {fingerprint(model)})")


def _expected_shapes(model: Any) -> Optional[List[Tuple[str, Optional[List[Tuple[int, ...]]]]]]:
    """Per layer: the cache class the model makes and, where known, the
    state shapes without the batch and token axes (KV: heads, head dim;
    DeltaNet: conv rows and width, recurrent heads x Dv x Dk). None where the
    model does not say."""
    try:
        classes = [type(c).__name__ for c in model.make_cache()]
        layers = list(model.layers)
    except Exception:  # noqa: BLE001 - a model without these: no check by shape
        return None
    out = []
    for cls, layer in zip(classes, layers):
        shapes = None
        try:
            if cls == "ArraysCache":
                la = layer.linear_attn
                shapes = [(la.conv_kernel_size - 1, la.conv_dim), (la.num_v_heads, la.head_v_dim, la.head_k_dim)]
            elif cls == "KVCache":
                sa = layer.self_attn
                shapes = [(sa.num_key_value_heads, sa.head_dim)] * 2
        except AttributeError:
            pass
        out.append((cls, shapes))
    return out if len(out) == len(classes) else None


def _check_layers(path: str, arrays: Dict[str, mx.array], classes: List[str], model: Any) -> None:
    """A stock file's layers against the caches the model makes: the same
    kinds, and the states' shapes where the model says them."""
    expected = _expected_shapes(model)
    if expected is None:
        return
    if len(classes) != len(expected):
        raise PromptCacheFileError(f"{path}: {len(classes)} layer caches; this model has {len(expected)}")
    for i, (found, (cls, shapes)) in enumerate(zip(classes, expected)):
        fits = found == cls or (cls == "KVCache" and found.endswith("KVCache"))
        if not fits:
            raise PromptCacheFileError(f"{path}: layer {i} holds a {found}; this model's layer {i} takes a {cls}")
        if shapes is None or found != cls:
            continue
        if cls == "KVCache":
            got = [arrays[f"{i}.{e}"].shape for e in range(2) if f"{i}.{e}" in arrays]
            got = [(s[1], s[3]) for s in got if len(s) == 4]
        else:
            got = [arrays[f"{i}.0.{e}"].shape[1:] for e in range(2) if f"{i}.0.{e}" in arrays]
        if got and [tuple(g) for g in got] != shapes[: len(got)]:
            raise PromptCacheFileError(f"{path}: layer {i}'s states are {[tuple(g) for g in got]} per row; "
                                       f"this model's are {shapes} (another model's file)")


def check_file(path: str, model: Any) -> Dict[str, str]:
    """Whether ``mlx_lm.generate --prompt-cache-file`` may continue from
    this file on ``model``: a lily file of this model (fingerprint), or a
    stock mlx-lm file whose layers are this model's kinds and shapes.
    Returns the file's metadata; refuses anything else in one line."""
    arrays, metadata, classes = read_header(path)
    if FORMAT_KEY in metadata or MODEL_KEY in metadata:
        _check_lily_file(path, metadata, model)
    _check_layers(path, arrays, classes, model)
    return metadata


def load_cache_file(path: str, model: Any) -> Tuple[List[int], List[Any], List[Checkpoint]]:
    """(tokens, prompt cache, checkpoints) from ``save_cache_file``'s file
    (``prefix_reuse.add_entry`` puts them in a prompt cache). A stock
    ``mlx_lm.cache_prompt`` file (no token list), another model's file or
    any other file is refused with one line (PromptCacheFileError)."""
    arrays, metadata, classes = read_header(path)
    if FORMAT_KEY not in metadata:
        raise PromptCacheFileError(f"{path}: a stock mlx-lm prompt cache (no tokens or checkpoints); "
                                   "write it with python -m mlx_lily cache-prompt")
    _check_lily_file(path, metadata, model)
    _check_layers(path, arrays, classes, model)
    tail = len(classes)
    try:
        tokens = [int(t) for t in arrays[f"{tail}.tokens"].tolist()]
        cache = load_prompt_cache(str(path))
        checkpoints = [
            Checkpoint(int(p), None if cuts is None else tuple(int(c) for c in cuts), int(step),
                       {int(j): tuple(arrays[f"{tail}.checkpoints.{n}.{j}.{e}"] for e in range(k))
                        for j, k in states.items()})
            for n, (p, cuts, step, states) in enumerate(json.loads(metadata[CHECKPOINTS_KEY]))
        ]
    except (KeyError, ValueError, TypeError, IndexError) as exc:
        raise PromptCacheFileError(f"{path}: a damaged {FILE_FORMAT!r} file ({type(exc).__name__}: {exc})") from None
    for ck in checkpoints:
        if any(type(cache[j]) is not ArraysCache for j in ck.states if j < len(cache)) or \
                any(j >= len(cache) for j in ck.states):
            raise PromptCacheFileError(f"{path}: a checkpoint names a layer that is not a DeltaNet cache")
    return tokens, cache, checkpoints
