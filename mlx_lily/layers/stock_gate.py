"""Which calls a lily layer serves itself, and the notice when it does not.

Lily's layers take every call mlx-lm's generators make at inference: any
batch size, padding masks (boolean or additive arrays), left-padded and
length-limited batches, and the caches ``KVCache``, ``BatchKVCache`` and
``ArraysCache`` (with or without ``left_padding`` / ``lengths``), for prefill
and decode, whole or sharded by mlx-lm's ``shard()`` (sharded.py). Within a
layer, each op picks its kernel or its reference per call.
What remains for the stock layer's own code is listed by ``why_stock``;
``runs_stock`` is the one gate every lily layer asks.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache

from .. import call_trace
from .._notice import notice_once
from ..trimmable_cache import LILY_ARRAYS_CACHES
from .sharded import why_stock as sharded_why_stock

# The KV caches lily's attention reads and writes itself.
LILY_KV_CACHES = (KVCache, BatchKVCache)


def why_stock(layer: Any, cache: Any = None, cache_kind: Any = None) -> Optional[str]:
    """None when lily's path takes this call, else the reason stock code runs it."""
    if layer.training:
        return "training mode (lily's ops have no backward pass)"
    sharded = sharded_why_stock(layer)
    if sharded is not None:
        return sharded
    if cache is None:
        return None
    if cache_kind is ArraysCache and type(cache) not in LILY_ARRAYS_CACHES:
        return f"cache type {type(cache).__name__} (lily's Gated DeltaNet takes ArraysCache)"
    if cache_kind is KVCache and type(cache) not in LILY_KV_CACHES:
        return (
            f"cache type {type(cache).__name__} (lily's attention takes KVCache and "
            "BatchKVCache; quantized, rotating, chunked and concatenating KV caches run stock)"
        )
    return None


def runs_stock(layer: Any, layer_kind: str, x: mx.array, mask: Any = None, cache: Any = None,
               cache_kind: Any = None, takes: bool = True) -> bool:
    """Whether this call runs the stock layer's code: when ``why_stock``
    names a reason (noted once), or when lily's path does not ``takes`` the
    call. Records the path taken either way."""
    reason = why_stock(layer, cache, cache_kind)
    if reason is not None:
        note_stock(layer_kind, reason)
    stock = reason is not None or not takes
    record(layer_kind, "stock" if stock else "lily", x, mask, cache)
    return stock


def note_stock(layer_kind: str, reason: str) -> None:
    notice_once(
        f"stock:{layer_kind}:{reason}",
        f"{layer_kind}: {reason}; every call of this kind runs stock mlx-lm's layer code",
    )


def record(layer_kind: str, path: str, x: mx.array, mask: Any = None, cache: Any = None) -> None:
    """Note the call's path for ``mlx_lily.call_trace`` (a no-op unless recording)."""
    if call_trace.active():
        call_trace.record(
            layer=layer_kind,
            path=path,
            batch=int(x.shape[0]),
            step="decode" if x.shape[1] == 1 else "prefill",
            mask=call_trace.describe_mask(mask),
            cache=call_trace.describe_cache(cache),
        )
