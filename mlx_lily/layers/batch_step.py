"""The server's decode step: the whole layer stack for B = 1..16 rows in one
compiled call, on mlx-lm's batch caches.

``mlx_lm.server`` decodes through ``BatchGenerator``: every attention layer
holds a ``BatchKVCache`` (rows left-padded, each with its own position) and
every Gated DeltaNet layer an ``ArraysCache`` of B rows. One decode token of
the batch is then, as for ``mlx_lm.generate`` (``text_model.py``), one
``mx.compile``-d call from the embedding to the final norm:

* the KV buffers are held at a whole number of ``CAPACITY_STEP`` rows, the
  new rows written at the batch's write index (an input, so one trace serves
  every token up to the capacity);
* RoPE takes each row's own position (``BatchKVCache.offset``);
* the attention reads each row's keys from its left padding to the write
  index in place (``start``), with no array mask;
* the DeltaNet steps take the batch's padding mask where the caches give one.

With compilation off (``MLX_LILY_COMPILE_DECODE=0``, the CPU emulator, a
graph traced for counting) the same step runs as plain ops. MLX traces the
compiled step once per batch size and KV capacity: a batch size met
for the first time, or a capacity step crossed, costs a trace (seconds at
the real shapes), after which every token of that shape replays it.

Every kernel the step runs reduces each row in the same order whatever the
batch holds, so a row's logits (and its greedy tokens) are the same bits
alone or in any batch of up to ``MAX_BATCH`` rows: docs/serving.md.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache

from .._notice import notice_once
from ..kernels.attention import decode as attention_decode
from ..kernels.attention.sdpa import attention_kernels
from ..kernels.dtypes import embedding_dtype
from ..kernels.gated_delta import decode as gated_delta_decode
from ..kernels.linear import gemv
from ..kernels.moe import decode as moe_decode
from ..toolchain.registry import kernel_backend
from .stock_gate import record

# Rows every batched decode kernel takes; a larger batch decodes through
# lily's unfused layers (stock's op flow), correct but slower, with one notice.
MAX_BATCH = min(attention_decode.MAX_BATCH, gated_delta_decode.MAX_BATCH, gemv.MAX_BATCH, moe_decode.MAX_BATCH)


def batch_rows(cache: Any) -> Optional[int]:
    """B when ``cache`` is the server's (its attention layers' caches are
    BatchKVCaches), else None."""
    for c in cache:
        if type(c) is BatchKVCache:
            return int(c.offset.size) if isinstance(c.offset, mx.array) else None
    return None


def layer_kinds(model: Any) -> tuple:
    """(attention layers' indices, DeltaNet layers' indices), worked out once
    per list of layer objects (a new list, or a layer replaced or added in
    place, works them out again): the server asks at every token, and walking
    40 modules' attributes each time is host time the step waits for."""
    members = tuple(map(id, model.layers))  # a layer replaced or added in place counts too
    held = model.__dict__.get("_lily_layer_kinds")
    if held is None or held[0] != members:
        kinds = [bool(layer.is_linear) for layer in model.layers]
        held = (members, (tuple(i for i, k in enumerate(kinds) if not k),
                          tuple(i for i, k in enumerate(kinds) if k)))
        model.__dict__["_lily_layer_kinds"] = held
    return held[1]


def batch_step_takes(model: Any, cache: Any, ssm_mask: Any, rows: int) -> bool:
    """Whether the batched whole step takes this decode token: every
    attention layer's cache a filled bf16 BatchKVCache at one write index,
    every DeltaNet layer's an ArraysCache of ``rows`` rows holding both
    states with no length limit, a padding mask of one step or none, at most
    MAX_BATCH rows, and the attention's decode kernels on."""
    if model.fa_idx is None:
        return False
    if embedding_dtype(model.embed_tokens) != mx.bfloat16:
        return False
    attention, linear = layer_kinds(model)
    kv = [cache[i] for i in attention]
    if not all(type(c) is BatchKVCache and (c.keys is None or c.keys.dtype == mx.bfloat16)
               and isinstance(c.offset, mx.array) and c.offset.size == rows for c in kv):
        return False
    if len({c._idx for c in kv}) != 1 or len({c.keys is None for c in kv}) != 1:
        return False
    for i in linear:
        c = cache[i]
        if type(c) is not ArraysCache or c.lengths is not None:
            return False
        # Both states, or neither (a request whose prompt was one token).
        conv, state = c.cache[0], c.cache[1]
        if not ((conv is None and state is None) or (conv is not None and state is not None and conv.shape[0] == rows)):
            return False
    if ssm_mask is not None and not (isinstance(ssm_mask, mx.array) and ssm_mask.dtype == mx.bool_
                                     and tuple(ssm_mask.shape) == (rows, 1)):
        return False
    backend = kernel_backend()[0]
    if backend is None or not attention_kernels.decode_on(backend):
        return False
    if rows > MAX_BATCH:
        notice_once(
            "batch-over-max",
            f"lily: a decode batch of {rows} rows; lily's batched decode step takes 1 to {MAX_BATCH} rows, "
            "so larger batches decode through lily's unfused layers (the same results, slower)",
        )
        return False
    return True


def reserve_batch_rows(cache: BatchKVCache, rows: int, attention: Any, dtype: mx.Dtype) -> None:
    """Give a BatchKVCache room for ``rows`` buffer rows, its capacity a
    whole number of CAPACITY_STEP rows; the rows up to its write index are
    kept, the rest zeros (never read: each row's attention ends at the write
    index). It stays a valid BatchKVCache for mlx-lm's code (extend, filter,
    extract, update_and_fetch). An empty one (no prompt yet) gets buffers
    shaped by ``attention``'s heads."""
    from .text_model import reserve_rows

    if cache.keys is None:
        shape = (cache.offset.size, attention.num_key_value_heads, 0, attention.head_dim)
        cache.keys, cache.values = mx.zeros(shape, dtype=dtype), mx.zeros(shape, dtype=dtype)
    reserve_rows(cache, rows, filled=cache._idx)


def decode_batch(model: Any, inputs: mx.array, cache: Any, ssm_mask: Optional[mx.array], version: int) -> mx.array:
    """One decode token of B rows through the compiled batched step; the
    caches advance as stock's layers would advance them."""
    from .decoder import compile_enabled, compiled_step
    from .text_model import _one_token, one_token_dtype

    rows = inputs.shape[0]
    one = _one_token(rows)
    if ssm_mask is None and model.ssm_idx is not None:
        # mlx-lm's batch caches merged from empty ones carry an all-True
        # padding mask, merged from a saved cache (a reused prompt) none. The
        # mask changes no bit, so one form serves both: one trace per KV
        # capacity, not one each (a reused prompt's first token paid a trace).
        ssm_mask = mx.ones((rows, 1), dtype=mx.bool_)
    if model.ssm_idx is not None:
        record("Gated DeltaNet", "lily batched decode step", one, ssm_mask, cache[model.ssm_idx])
    record("full attention", "lily batched decode step", one, None, cache[model.fa_idx])
    record("MoE", "lily batched decode step", one, None, None)
    first = cache[model.fa_idx]
    index = first._idx
    dtype = embedding_dtype(model.embed_tokens)
    layers = model.layers
    attention, linear = layer_kinds(model)
    for i in attention:
        reserve_batch_rows(cache[i], index + 1, layers[i].self_attn, dtype)
    is_linear = [False] * len(layers)
    for i in linear:
        is_linear[i] = True
    args = [one_token_dtype(inputs)]
    for layer, linear_layer, c in zip(layers, is_linear, cache):
        args += (_states(layer.linear_attn, c, rows, dtype) if linear_layer else [c.keys, c.values])
    args += [mx.array([index], dtype=mx.int32), first.offset.astype(mx.int32), first.left_padding.astype(mx.int32)]
    masked = ssm_mask is not None
    if masked:
        args.append(ssm_mask)
    if compile_enabled():
        store = model.__dict__.setdefault("_lily_segments", {})
        step = compiled_step(store, ("batch", masked), version, lambda: batch_step_fn(model, masked))
    else:  # MLX_LILY_COMPILE_DECODE=0, the emulator, a trace for counting: the same ops, one by one
        step = batch_step_fn(model, masked)
    outputs = step(*args)
    del args  # the old buffers: only the new graph holds them, so MLX writes the new rows in place
    for linear_layer, c, (a, b) in zip(is_linear, cache, zip(outputs[0::2], outputs[1::2])):
        if linear_layer:
            c[0], c[1] = a, b
        else:
            c.keys, c.values = a, b
            c._idx += 1
    held = model.__dict__.setdefault("_lily_batch_counters", {})
    advance_together(held, "offset", [cache[i] for i in attention], "offset", 1)
    states = [cache[i] for i in linear]
    if states and states[0].left_padding is not None:
        advance_together(held, "left_padding", states, "left_padding", -1)
    return outputs[-1]


def advance_together(held: dict, key: str, caches: list, attr: str, delta: int) -> None:
    """``c.<attr> += delta`` for every cache, as stock's layers advance them
    (each BatchKVCache's offset; each ArraysCache's left padding, which only
    the first one's mask reads), with one op instead of one a layer.

    Every layer's counter holds the same values: mlx-lm applies each filter,
    extend, prefill and stock layer pass to all of them alike. Where every
    cache still holds the array this function gave it the step before, one
    sum serves all; a counter replaced since (the batch's first step, rows
    joined or left) has them compared first, one read, right after the reads
    mlx-lm's filter and prefill already make; counters that differ advance
    one by one. Each cache gets its own array object sharing the one result,
    so an in-place update of one (``offset += n``) reaches no other. Without
    this, every counter but the one the step reads grows a chain of one lazy
    op per token for the batch's lifetime."""
    values = [getattr(c, attr) for c in caches]
    last = held.get(key)
    shared = last is not None and len(last) == len(values) and all(v is w for v, w in zip(values, last))
    if not shared and len(values) > 1:
        shared = all(v is not None and v.shape == values[0].shape for v in values) and bool(
            mx.all(mx.stack(values) == values[0]).item())
    if not shared:
        held.pop(key, None)
        for c, v in zip(caches, values):
            if v is not None:
                setattr(c, attr, v + delta)
        return
    new = values[0] + delta
    views = tuple(new.astype(new.dtype) for _ in caches)  # distinct objects, one array
    for c, v in zip(caches, views):
        setattr(c, attr, v)
    held[key] = views


def _states(la: Any, cache: ArraysCache, rows: int, dtype: mx.Dtype) -> list:
    """A DeltaNet layer's (conv state, recurrent state); zeros, as stock
    starts them, for a request that had no prompt step (its prompt was one
    token), so that its first token takes this step as well."""
    conv, state = cache.cache[0], cache.cache[1]
    if conv is not None:
        return [conv, state]
    conv = mx.zeros((rows, la.conv_kernel_size - 1, la.conv_dim), dtype=dtype)
    state = mx.zeros((rows, la.num_v_heads, la.head_v_dim, la.head_k_dim), dtype=mx.float32)
    return [conv, state]


def batch_step_fn(model: Any, masked: bool) -> Callable:
    """The stack for B rows: (tokens [B, 1], each layer's two states or
    buffers, write index [1], positions [B], left paddings [B], [mask [B, 1]])
    -> (each layer's new states or buffers, the final norm's output)."""
    layers = model.layers
    n = 2 * len(layers)

    def step(tokens, *rest):
        position, offsets, starts = rest[n:n + 3]
        mask = rest[n + 3] if masked else None
        length = position + 1  # once, not once per attention layer (a launch each)
        h = model.embed_tokens(tokens)
        outputs = []
        for i, layer in enumerate(layers):
            if layer.is_linear:
                h, a, b = layer._linear_step(h, rest[2 * i], rest[2 * i + 1], mask)
            else:
                h, a, b = layer._attention_step(h, rest[2 * i], rest[2 * i + 1], position, offsets, starts,
                                                length)
            outputs += [a, b]
        return (*outputs, model.norm(h))

    return step
