"""Which calls a lily layer serves itself, and the notice when it does not."""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache

from .._notice import notice_once


def why_stock(
    layer: Any, x: mx.array, mask: Any = None, cache: Any = None, cache_kind: Any = None
) -> Optional[str]:
    """None when lily's path takes this call, else the reason stock code runs it."""
    if layer.training:
        return "training mode"
    if getattr(layer, "sharding_group", None) is not None:
        return "sharded model"
    if x.shape[0] != 1:
        return "batch size > 1"
    if mask is not None and not isinstance(mask, str):
        return "padding mask"
    if cache is None:
        return None
    if cache_kind is ArraysCache:
        if type(cache) is not ArraysCache:
            return f"cache type {type(cache).__name__}"
        if cache.lengths is not None or cache.left_padding is not None:
            return "left-padded or length-limited batch"
    elif cache_kind is KVCache and type(cache) is not KVCache:
        return f"cache type {type(cache).__name__} (quantized, rotating or batched KV cache)"
    return None


def note_stock(layer_kind: str, reason: str) -> None:
    notice_once(
        f"stock:{layer_kind}:{reason}",
        f"{layer_kind}: {reason}; this layer runs stock mlx-lm code for such calls",
    )
