"""Batched decode attention: rows of a left-padded batch KV cache, each with
its own key span, read in place (the ``start`` argument of the attention op).

The decode kernel's launcher and its B = 1 forms live in ``sdpa.py``; this
module holds what the batched form adds: the key-span mask the reference
applies, each row's key blocks (a function of the row's own span length only:
the batch invariance), the grid that covers them for a view of given capacity,
and the checks of a batched call. Notes: docs/kernel-notes.md#sdpa.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

# Rows per batched decode call: mlx-lm's server batches up to this many
# requests per step by default; a larger batch runs the reference.
MAX_BATCH = 16


@dataclass(frozen=True)
class RowForm:
    """How a row of a batched decode splits its keys, from its span length n
    alone: one block below ``split_from`` keys, else blocks of ``min_block``
    keys, doubled up to ``max_block`` while the row's blocks times the KV
    heads exceed ``split_threadgroups`` (the B = 1 spread over the GPU)."""

    split_from: int
    min_block: int
    max_block: int
    split_threadgroups: int

    def block(self, n: int, kv_heads: int) -> int:
        """Keys per block of a row of n keys (the body computes the same)."""
        if n < self.split_from:
            return n
        block = self.min_block
        while block < self.max_block and math.ceil(n / block) * kv_heads > self.split_threadgroups:
            block *= 2
        return block

    def blocks(self, n: int, kv_heads: int) -> int:
        """Key blocks of a row of n keys (at least one)."""
        return 1 if n < self.split_from else math.ceil(n / self.block(n, kv_heads))

    def grid_blocks(self, capacity: int, kv_heads: int) -> int:
        """Blocks the grid needs so that every span of up to ``capacity`` keys
        has all of its own: the most over n in [1, capacity]. Within one block
        size the count grows with n, so the most is at the end of a size's
        range (or at the capacity)."""
        ends = {capacity}
        block = self.min_block
        while block < self.max_block:
            # The longest span that still takes this block size.
            ends.add(self.split_threadgroups // max(kv_heads, 1) * block)
            block *= 2
        return max(self.blocks(n, kv_heads) for n in ends if 1 <= n <= capacity)


def key_span_mask(capacity: int, length=None, start=None) -> mx.array:
    """The boolean mask of keys [start, length) over a view of ``capacity``
    rows: [capacity] for one length alone (as before), else [B, 1, 1, capacity]
    (``start`` [B] or None: 0; ``length`` [1] shared or [B] per row, or None:
    the view's end)."""
    positions = mx.arange(capacity, dtype=mx.int32)
    if start is None:
        if length.size > 1:  # rows of one view, each ending at its own length
            return (positions < length.reshape(-1, 1)).reshape(-1, 1, 1, capacity)
        return positions < length
    mask = positions >= start.reshape(-1, 1)
    if length is not None:
        mask = mask & (positions < length.reshape(-1, 1))
    return mask.reshape(-1, 1, 1, capacity)


def span_reason(q, k, mask, length, start) -> Optional[str]:
    """Why the decode kernel does not take these ``length`` / ``start``
    arguments, or None (shapes of q and k are checked elsewhere)."""
    if length is None and start is None:
        return None
    if start is None:
        if mask is not None or length.dtype != mx.int32 or length.ndim != 1:
            return "a length bound needs no mask and int32 lengths [1] or [B]"
        # One length; or (the verification pass's positions) one per row, each
        # row read as a one-row call bounded by its own length.
        B = q.shape[0] if q.ndim == 4 else 0
        if length.size != 1 and (length.size != B or B > MAX_BATCH):
            return f"length {tuple(length.shape)} (decode kernel: [1], or [B] for B <= {MAX_BATCH} rows)"
        return None
    if mask is not None:
        return "a key start needs no mask"
    B = q.shape[0] if q.ndim == 4 else 0
    if length is not None and (length.dtype != mx.int32 or length.ndim != 1 or length.size not in (1, B)):
        return f"length {length.dtype} {tuple(length.shape)} (decode kernel: int32 [1] or [B] with a start)"
    if start.dtype != mx.int32 or start.shape != (B,):
        return f"start {start.dtype} {tuple(start.shape)} (decode kernel: int32 [B] = [{B}])"
    if B > MAX_BATCH:
        return f"batch {B} (decode kernel: at most {MAX_BATCH} rows)"
    if k.ndim == 4 and k.shape[0] != B:
        return f"batch {B} of queries on {k.shape[0]} of keys"
    return None


def batch_check_inputs(Hq=4, Hkv=2, D=64, seed=12):
    """The attention self-check's batched call: three rows of a left-padded
    batch cache (spans of 2, 19 and 7 keys, per-row ends) in a view of 24
    rows, as (q, k, v, scale, mask, {length, start})."""
    from .testing import batch_decode_inputs, decode_request

    requests = [decode_request(n, Hq, Hkv, D, seed=seed + n) for n in (2, 19, 7)]
    args, kwargs = batch_decode_inputs(requests, [22, 3, 0], 24, per_row_ends=True)
    return (*args, kwargs)


def rows_of_one_view(q, k, v, scale, mask, length=None, start=None, gate=None) -> bool:
    """B rows, no start, a length per row: a stream's positions over one
    view, each read as a one-row call bounded at its own length."""
    return start is None and length is not None and length.size > 1


def rows_check_inputs(lengths, capacity, Hq=4, Hkv=2, D=64, seed=13):
    """The attention self-check's rows of one view (a speculative round's
    positions): len(lengths) queries over one cache of ``capacity`` rows,
    broadcast to them (no copy), whose rows past the longest length are
    large (reading one shows), and lengths [B], as (q, k, v, scale, mask,
    length)."""
    keys = mx.random.split(mx.random.key(seed), 3)
    B = len(lengths)
    q = mx.random.normal((B, Hq, 1, D), key=keys[0]).astype(mx.bfloat16)
    past = mx.arange(capacity)[None, None, :, None] >= max(lengths)
    k, v = (mx.where(past, 64.0, mx.random.normal((1, Hkv, capacity, D), key=key)).astype(mx.bfloat16)
            for key in keys[1:])
    rows = (B, Hkv, capacity, D)
    return q, mx.broadcast_to(k, rows), mx.broadcast_to(v, rows), D**-0.5, None, mx.array(lengths, dtype=mx.int32)
