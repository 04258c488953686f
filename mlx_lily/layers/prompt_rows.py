"""A batch's prompt under mlx-lm's ``BatchGenerator``, each row as if alone.

The server prefills the prompts of requests that arrive together as one
right-padded batch (``PromptProcessingBatch.prompt``): the rows share each
chunk's matrix products, and the padding steps run masked. Lily runs such a
chunk row by row instead: each row's real tokens of the chunk, through the
same code a request alone takes (a one-row ``BatchKVCache`` and
``ArraysCache`` holding that row's history), written back into the batch's
caches at the row's place. So each row's caches after its prompt are, bit
for bit, those the same request alone would have, which the batch-invariant
decode step then keeps (docs/serving.md). Prefill is matrix-bound and lily's
runs one row at full speed, so little is lost; many short prompts arriving
together pay one prefill call each.

The padding steps' keys (the rows past a row's length) are left zeros; they
end up in the row's left padding, which no attention reads.
``MLX_LILY_PROMPT_ROWS=0`` prefills such batches as stock does, all rows in
each call (padding masks and all): faster for many short prompts, but a
row's caches then depend on the batch it was prefilled with.
"""

from __future__ import annotations

import os
from typing import Any, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache

ROWS_ENV = "MLX_LILY_PROMPT_ROWS"


def rows_enabled() -> bool:
    return os.environ.get(ROWS_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _is_prompt_chunk(cache: Any, length: int) -> bool:
    """A chunk of prompts rather than a decode token: more than one token,
    or DeltaNet caches still empty or holding prompt lengths."""
    if length > 1:
        return True
    return any(type(c) is ArraysCache and (c.lengths is not None or c[1] is None) for c in cache)


def prompt_rows(model: Any, inputs: mx.array, cache: Any) -> Optional[mx.array]:
    """The hidden states [B, L, D] of a batch's prompt chunk, computed row by
    row (module docstring); None where this does not apply (no cache, not
    the server's batch caches, a decode token)."""
    if cache is None or getattr(model, "pipeline_size", 1) != 1 or len(cache) != len(model.layers):
        return None
    if not rows_enabled():
        return None
    if not all(type(c) is (ArraysCache if layer.is_linear else BatchKVCache) for layer, c in zip(model.layers, cache)):
        return None
    linear = [c for c in cache if type(c) is ArraysCache]
    if not linear or not _is_prompt_chunk(cache, inputs.shape[1]):
        return None
    B, L = inputs.shape
    lengths = linear[0].lengths
    real = [L] * B if lengths is None else [max(0, min(L, int(n))) for n in lengths.tolist()]
    if not any(real):
        return None  # no row has a token in this chunk: nothing to do row by row
    kv = [c for c in cache if type(c) is BatchKVCache]
    start = kv[0]._idx if kv else 0
    # Each row's left padding (one list for every attention layer: they pad alike).
    paddings = [int(p) for p in kv[0].left_padding.tolist()] if kv else [0] * B

    outputs: List[mx.array] = []
    row_caches = []
    for b in range(B):
        if real[b] == 0:
            outputs.append(None)
            row_caches.append(None)
            continue
        rows = [_row_cache(c, b, paddings[b]) for c in cache]
        out = model(inputs[b:b + 1, : real[b]], cache=rows)
        mx.eval(out, [c.state for c in rows])
        outputs.append(out)
        row_caches.append(rows)

    for i, c in enumerate(cache):
        per_row = [None if rows is None else rows[i] for rows in row_caches]
        if type(c) is BatchKVCache:
            _write_keys(c, per_row, start, L, real, paddings)
        else:
            _write_states(c, per_row)
            c.advance(L)

    D = next(o for o in outputs if o is not None).shape[-1]
    dtype = next(o for o in outputs if o is not None).dtype
    padded = [
        mx.zeros((1, L, D), dtype=dtype) if o is None
        else o if o.shape[1] == L
        else mx.concatenate([o, mx.zeros((1, L - o.shape[1], D), dtype=o.dtype)], axis=1)
        for o in outputs
    ]
    return mx.concatenate(padded, axis=0)


def _row_cache(c: Any, b: int, padding: int) -> Any:
    """Row b of a batch cache as the one-row cache a request alone holds: its
    history without the batch's left padding (``padding`` rows: a request
    resuming a saved cache shorter than the others')."""
    if type(c) is ArraysCache:
        row = ArraysCache(len(c.cache), left_padding=[0])
        row.cache = [None if a is None else a[b:b + 1] for a in c.cache]
        return row
    row = BatchKVCache([0])
    if c.keys is not None and c._idx > padding:
        row.keys = c.keys[b:b + 1, :, padding: c._idx]
        row.values = c.values[b:b + 1, :, padding: c._idx]
        row._idx = c._idx - padding
        row.offset = mx.array([row._idx])
    return row


def _write_keys(c: BatchKVCache, rows: list, start: int, length: int, real: list, paddings: list) -> None:
    """Advance the batch's KV cache by the chunk (its buffer grown as stock's
    write grows it, zeros written), then place each row's new keys and
    values (at ``start`` in the batch, ``start`` less its left padding in
    the row's own cache)."""
    B = len(rows)
    sample = next(r for r in rows if r is not None)
    _, H, _, Dk = sample.keys.shape
    Dv = sample.values.shape[-1]
    c.update_and_fetch(mx.zeros((B, H, length, Dk), sample.keys.dtype), mx.zeros((B, H, length, Dv), sample.values.dtype))
    for b, row in enumerate(rows):
        if row is None:
            continue
        n, own = real[b], start - paddings[b]
        c.keys[b:b + 1, :, start:start + n, :] = row.keys[..., own:own + n, :]
        c.values[b:b + 1, :, start:start + n, :] = row.values[..., own:own + n, :]


def _write_states(c: ArraysCache, rows: list) -> None:
    """Each row's DeltaNet states after its tokens (a row without tokens in
    this chunk keeps its own, zeros if it had none yet)."""
    sample = next(r for r in rows if r is not None)
    for e in range(len(c.cache)):
        like = sample.cache[e]
        if like is None:
            continue
        parts = []
        for b, row in enumerate(rows):
            if row is not None:
                parts.append(row.cache[e])
            elif c.cache[e] is not None:
                parts.append(c.cache[e][b:b + 1])
            else:
                parts.append(mx.zeros(like.shape, like.dtype))
        c.cache[e] = mx.concatenate(parts, axis=0)
