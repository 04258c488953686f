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

**Packed rows.** A prefill call of a few hundred tokens is bound by its fixed
cost (on the H200 at the real shapes, 256 tokens took 52.5 ms and 2,048 took
129.9: ``bench.diagnostics.prefill.packed_rows``), so rows of at least
``PACK_MIN_TOKENS`` tokens share one call. In it every token-wise op runs
once over all rows' tokens: the norms, the mixers' projections, output gate
and output norm (``packed_rows`` of each mixer) and the MoE block (each
expert's weights then read once for all rows). What carries state runs on
each row's tokens and cache: the DeltaNet convolution and recurrence as one
right-padded batch for rows that alone take the chunked passes
(``gated_delta_rows``), attention as one causal batch for fresh rows where
each row alone takes the batch's path, every other row alone. That keeps a row's bits only where those token-wise ops
give a token the same bits whatever is packed with it: measured on CUDA
(MLX's quantized matmul and lily's expert GEMM take other paths below 8
rows; from 8 on a row's outputs packed equal its outputs alone), and on the
CPU, whose matmuls are row-exact. On Metal, whose quantized matmul switches
between its vector and matrix forms at a row count that depends on the GPU
and the shapes, rows are not packed until measured there.
``MLX_LILY_PACK_PROMPTS=0`` turns packing off.
"""

from __future__ import annotations

import os
from itertools import accumulate
from typing import Any, List, Optional

import mlx.core as mx
import numpy as np
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import ArraysCache, BatchKVCache

from ..toolchain.registry import gpu_backend

ROWS_ENV = "MLX_LILY_PROMPT_ROWS"
PACK_ENV = "MLX_LILY_PACK_PROMPTS"
# Rows with fewer tokens in a chunk run alone (module docstring: below 8 rows
# MLX's quantized matmul on CUDA and lily's expert GEMM take other paths).
PACK_MIN_TOKENS = 8
# Tokens of one packed call at most: bounds the MoE's intermediates, as a
# prefill chunk does.
PACK_MAX_TOKENS = 4096
# Where MLX's own matmuls run: the devices on which packing keeps a row's bits
# (measured), None standing for the CPU.
PACKING_DEVICES = ("cuda", None)


def rows_enabled() -> bool:
    return os.environ.get(ROWS_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def packing_enabled() -> bool:
    if os.environ.get(PACK_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    return gpu_backend() in PACKING_DEVICES


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

    row_caches = [None if real[b] == 0 else [_row_cache(c, b, paddings[b]) for c in cache] for b in range(B)]
    outputs: List[Optional[mx.array]] = [None] * B
    for group in pack_groups(real, packing_enabled() and _packable(model)):
        ids = [inputs[b:b + 1, : real[b]] for b in group]
        caches = [row_caches[b] for b in group]
        outs = [model(ids[0], cache=caches[0])] if len(group) == 1 else packed_call(model, ids, caches)
        mx.eval(outs, [c.state for rows in caches for c in rows])
        for b, out in zip(group, outs):
            outputs[b] = out

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


def pack_groups(real: List[int], packing: bool) -> List[List[int]]:
    """The rows with tokens, in groups that share a call: with ``packing``,
    rows of at least ``PACK_MIN_TOKENS`` tokens in order, up to
    ``PACK_MAX_TOKENS`` tokens a group; every other row alone."""
    groups: List[List[int]] = []
    current: List[int] = []
    tokens = 0
    for b, n in enumerate(real):
        if n == 0:
            continue
        if not packing or n < PACK_MIN_TOKENS:
            groups.append([b])
            continue
        if current and tokens + n > PACK_MAX_TOKENS:
            groups.append(current)
            current, tokens = [], 0
        current.append(b)
        tokens += n
    if current:
        groups.append(current)
    return groups


def _packable(model: Any) -> bool:
    """Every layer is lily's, with the stock layer flow ``packed_call``
    follows, and its mixer takes packed rows."""
    from .decoder import LilyDecoderLayer

    return all(type(layer) is LilyDecoderLayer
               and hasattr(layer.linear_attn if layer.is_linear else layer.self_attn, "packed_rows")
               for layer in model.layers)


def packs_prompts(model: Any) -> bool:
    """Whether the prompts of a server batch share calls with ``model`` (the
    model mlx-lm loaded): rows and packing on, and its text model packable."""
    text = getattr(getattr(model, "language_model", None), "model", None)
    return (text is not None and getattr(text, "pipeline_size", 1) == 1 and rows_enabled()
            and packing_enabled() and _packable(text))


def packed_call(model: Any, ids: List[mx.array], caches: List[list]) -> List[mx.array]:
    """The text model's outputs [1, L_r, D] for rows ``ids`` (each [1, L_r])
    on their one-row caches: the layer flow of stock's model and decoder
    layer over all rows' tokens packed, each mixer's stateful part on each
    row's tokens and cache (module docstring)."""
    from .decoder import PACE_MIN_ROWS, pace_prefill

    from .gated_deltanet import padding_only

    hidden = [model.embed_tokens(i) for i in ids]
    lengths = [h.shape[1] for h in hidden]
    fa = [None if model.fa_idx is None else create_attention_mask(h, c[model.fa_idx]) for h, c in zip(hidden, caches)]
    # Each row's DeltaNet mask, resolved once here (an all-True mask is
    # dropped, as each layer would drop it): resolving reads the mask, a
    # wait on the device, which per layer would be one for each row.
    ssm = [None if model.ssm_idx is None else padding_only(create_ssm_mask(h, c[model.ssm_idx]), h.shape[1])
           for h, c in zip(hidden, caches)]
    h = mx.concatenate(hidden, axis=1)
    for i, layer in enumerate(model.layers):
        mixer = layer.linear_attn if layer.is_linear else layer.self_attn
        masks = ssm if layer.is_linear else fa
        x = h + mixer.packed_rows(layer.input_layernorm(h), lengths, masks, [c[i] for c in caches])
        out = x + layer.mlp(layer.post_attention_layernorm(x))
        if out.shape[1] >= PACE_MIN_ROWS:
            # Wait for the layer's input (the layer before's output), as a
            # layer alone paces: this whole layer runs while the host builds
            # the next. Waiting for this layer's mixer left only its MoE to
            # run through that build.
            pace_prefill(h, out)
        h = out
    return split_rows(model.norm(h), lengths)


def split_rows(x: mx.array, lengths: List[int]) -> List[mx.array]:
    """Packed rows [1, sum(lengths), ...] -> each row [1, L_r, ...]."""
    return mx.split(x, list(accumulate(lengths[:-1])), axis=1)


# Each row layout's index arrays (``_layout``), shared by a call's layers; a
# few kept, for the calls of one wave of prompts.
_LAYOUTS: dict = {}
_LAYOUTS_KEPT = 32


def _layout(lengths: List[int], rows: List[int]) -> tuple:
    """(longest, pad_index, keep, unpad_index) for rows ``rows`` (in that
    order) of a packed call whose row r holds ``lengths[r]`` tokens:
    ``pad_index`` [R * longest] the packed position each padded slot reads
    (any, where ``keep`` is False), ``keep`` [R * longest] where a slot holds
    a token (None: everywhere), ``unpad_index`` [sum of the rows' lengths]
    the padded slot of each of the rows' tokens, in packed order."""
    key = (tuple(lengths), tuple(rows))
    found = _LAYOUTS.get(key)
    if found is None:
        starts = np.concatenate([[0], np.cumsum(lengths)])
        longest = max(lengths[r] for r in rows)
        t = np.arange(longest)
        pad = np.concatenate([starts[r] + np.minimum(t, max(lengths[r] - 1, 0)) for r in rows])
        keep = np.concatenate([t < lengths[r] for r in rows])
        slot = {r: i for i, r in enumerate(rows)}
        unpad = np.concatenate([slot[r] * longest + np.arange(lengths[r]) for r in sorted(rows)])
        if len(_LAYOUTS) >= _LAYOUTS_KEPT:
            _LAYOUTS.clear()
        found = _LAYOUTS[key] = (longest, mx.array(pad, dtype=mx.int32),
                                 None if keep.all() else mx.array(keep), mx.array(unpad, dtype=mx.int32))
    return found


def padded_rows(packed: mx.array, lengths: List[int], rows: List[int]) -> mx.array:
    """Rows ``rows`` of a packed call [1, sum(lengths), ...] as one batch
    [len(rows), longest, ...], in that order, each row followed by zeros:
    one gather (and one select where rows differ in length), not a copy per
    row."""
    longest, pad, keep, _ = _layout(lengths, rows)
    flat = mx.take(packed[0], pad, axis=0)
    if keep is not None:
        flat = mx.where(keep.reshape(-1, *([1] * (flat.ndim - 1))), flat, mx.zeros((), flat.dtype))
    return flat.reshape(len(rows), longest, *packed.shape[2:])


def packed_from_padded(padded: mx.array, lengths: List[int], rows: List[int]) -> mx.array:
    """``padded_rows``' inverse: a batch [len(rows), longest, ...] of rows
    ``rows`` -> their tokens packed [1, sum of their lengths, ...], in
    packed (row) order; one gather."""
    _, _, _, unpad = _layout(lengths, rows)
    R, T = padded.shape[:2]
    return mx.take(padded.reshape(R * T, *padded.shape[2:]), unpad, axis=0)[None]


class BatchedRows:
    """Cache entries that one batched call computed for several one-row
    caches at once: ``arrays`` [R, ...], one per entry (an ``ArraysCache``'s
    entries in order; a KV cache's keys and values), row cache ``slot``
    holding its part of each (``tag``). It lets the batch's caches take the
    arrays whole (``batched_entries``) instead of joining the rows' parts
    again, one copy per row."""

    def __init__(self, arrays: List[mx.array]):
        self.arrays = arrays

    def hand_out(self, caches: list) -> None:
        """Each ``ArraysCache`` of ``caches`` its slot's row of every array."""
        for slot, c in enumerate(caches):
            for e, a in enumerate(self.arrays):
                c[e] = a[slot:slot + 1]
            self.tag(c, slot)

    def tag(self, cache: Any, slot: int) -> None:
        """Mark ``cache`` as holding slot ``slot`` (its entries as they are now)."""
        cache.lily_batched_rows = (self, slot, _entries(cache, len(self.arrays)))


def _entries(cache: Any, n: int) -> list:
    if type(cache) is ArraysCache:
        return [cache[e] for e in range(n)]
    return [cache.keys, cache.values][:n]


def batched_entries(rows: list) -> Optional[List[mx.array]]:
    """The entries [B, ...] of one-row caches ``rows`` (batch order) where
    each still holds, untouched, its slot of one ``BatchedRows``: the arrays
    themselves (rows in slot order) or one gather; None otherwise."""
    tags = [getattr(r, "lily_batched_rows", None) if r is not None else None for r in rows]
    if not tags or any(t is None for t in tags):
        return None
    holder = tags[0][0]
    n = len(holder.arrays)
    if any(t[0] is not holder or any(a is not b for a, b in zip(_entries(r, n), t[2])) for r, t in zip(rows, tags)):
        return None
    slots = [t[1] for t in tags]
    if slots == list(range(holder.arrays[0].shape[0])):
        return list(holder.arrays)
    picked = mx.array(slots, dtype=mx.int32)
    return [mx.take(a, picked, axis=0) for a in holder.arrays]


def _row_cache(c: Any, b: int, padding: int) -> Any:
    """Row b of a batch cache as the one-row cache a request alone holds: its
    history without the batch's left padding (``padding`` rows: a request
    resuming a saved cache shorter than the others')."""
    if type(c) is ArraysCache:
        row = ArraysCache(len(c.cache), left_padding=[0])
        row.cache = [None if a is None else a[b:b + 1] for a in c.cache]
        if getattr(c, "lily_capture", False):  # prefix reuse's request (gated_deltanet.wants_piece_state)
            row.lily_capture = True
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
    whole = batched_entries(rows)
    if whole is not None and whole[0].shape[2] == length and all(
            start == paddings[b] and row._idx == real[b] for b, row in enumerate(rows)):
        # Every row began this chunk empty and holds its slot of one batched
        # attention's keys (zeros after each row's end): the chunk as it is.
        c.update_and_fetch(*whole)
        return
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
    this chunk keeps its own, zeros if it had none yet), and the states a
    row's call kept after its last whole chunk (``lily_piece_states``, one
    entry per row, for prefix reuse)."""
    sample = next(r for r in rows if r is not None)
    kept = [getattr(r, "lily_piece_state", None) if r is not None else None for r in rows]
    if any(k is not None for k in kept):
        c.lily_piece_states = kept
    whole = batched_entries(rows)
    if whole is not None and len(whole) == len(c.cache):
        c.cache = whole
        return
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
