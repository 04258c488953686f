"""Kernels and bytes of one batched decode step (the server's: B rows on
mlx-lm's batch caches), and the bytes those rows must read.

The graph is read as ``bench/counts.py`` reads one token's (``mx.export_function``
with a callback), with two things a batch changes:

* **Must read** is the union of what the B rows touch: every non-expert
  weight once, in each MoE layer the experts any row picked (the union of
  the rows' top-k, found by running the same step once with a hook on each
  layer's router), B rows of the embedding table, and the cache state: each
  row's own keys and values (from its left padding to the context) and its
  recurrent and conv states.
* **Bytes**: lily's batched MoE kernels read each picked expert once for
  all rows (``moe_decode_gate_up`` / ``moe_decode_down`` walk the union), so
  their expert reads are counted at the union's size for that layer; and the
  decode attention reads each row's span of the KV buffer, not the whole
  buffer (whose capacity runs ahead in whole steps), so its key and value
  reads are counted at the rows' spans.

Everything else (kernels, the other bytes) is ``counts.count_nodes``.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Sequence

import mlx.core as mx
import numpy as np

from bench.counts import _tree_bytes, count_nodes, kernel_in, trace, weights_touched

# Lily's batched decode kernels whose weight or KV reads follow the rows' picks
# or spans: name -> positions of those inputs.
UNION_KERNELS = {"moe_decode_gate_up": range(2, 8), "moe_decode_route_gate_up": range(4, 10),
                 "moe_decode_down": range(4, 7), "moe_decode_down_combine": range(5, 8)}
SPAN_KERNELS = {"attention_decode": (1, 2)}


def expert_unions(model: Any, cache: Sequence[Any], inputs: mx.array) -> List[int]:
    """Per MoE layer, how many distinct experts the B rows pick in one step
    (the step run once, uncompiled, a hook on each layer's router). The
    caches advance: pass a copy's state back afterwards."""
    layers = [layer for layer in model.layers if hasattr(layer.mlp, "switch_mlp")]
    unions: List[int] = []

    def hook(layer):
        real = type(layer)._moe_step

        def spy(h):
            mlp, norm = layer.mlp, layer.post_attention_layernorm
            logits = mlp.gate(mx.fast.rms_norm(h, norm.weight, norm.eps))
            picks = mx.argpartition(-logits.astype(mx.float32), mlp.top_k - 1, axis=-1)[..., : mlp.top_k]
            unions.append(int(np.unique(np.array(picks)).size))
            return real(layer, h)

        return spy

    saved = os.environ.get("MLX_LILY_COMPILE_DECODE")
    os.environ["MLX_LILY_COMPILE_DECODE"] = "0"  # the step as plain ops, so the hook can read its arrays
    try:
        for layer in layers:
            object.__setattr__(layer, "_moe_step", hook(layer))
        mx.eval(model(inputs, cache=cache))
    finally:
        for layer in layers:
            layer.__dict__.pop("_moe_step", None)
        if saved is None:
            os.environ.pop("MLX_LILY_COMPILE_DECODE", None)
        else:
            os.environ["MLX_LILY_COMPILE_DECODE"] = saved
    return unions


def _span_rows(cache: Sequence[Any]) -> Dict[str, Any]:
    """(rows of keys the B rows attend to after this step, the KV buffer's rows)."""
    from mlx_lm.models.cache import BatchKVCache

    kv = [c for c in cache if type(c) is BatchKVCache]
    c = kv[0]
    spans = int(sum(c._idx + 1 - p for p in c.left_padding.tolist()))
    return {"span_rows": spans, "buffer_rows": int(c.keys.shape[0] * c.keys.shape[2])}


def must_read(model: Any, cache: Sequence[Any], unions: List[int], rows: int) -> Dict[str, int]:
    """Bytes the B rows' step must read (module docstring)."""
    from mlx_lm.models.cache import ArraysCache, BatchKVCache

    parts = weights_touched(model)
    parts["embedding"] *= rows
    moe = [layer.mlp.switch_mlp for layer in model.layers if hasattr(layer.mlp, "switch_mlp")]
    parts["experts"] = sum(
        _tree_bytes(getattr(switch, proj).parameters()) * union // getattr(switch, proj).weight.shape[0]
        for switch, union in zip(moe, unions) for proj in ("gate_proj", "up_proj", "down_proj")
    )
    state = 0
    for c in cache:
        if type(c) is BatchKVCache:
            _, H, _, D = c.keys.shape
            per_row = H * (D + c.values.shape[-1]) * c.keys.dtype.size
            state += per_row * sum(c._idx + 1 - p for p in c.left_padding.tolist())
        elif type(c) is ArraysCache:
            state += sum(a.nbytes for a in c.cache if a is not None)
    parts["cache"] = state
    return parts


def batch_decode_step_counts(model: Any, cache: Sequence[Any], tokens: Sequence[int]) -> Dict[str, Any]:
    """Kernels and bytes of one decode step of ``len(tokens)`` rows on the
    server's batch caches (``cache``: BatchKVCache and ArraysCache of that
    many rows), and the bytes those rows must read. The caches are left as
    they were, apart from their KV buffers' room for the step."""
    from mlx_lm.models.cache import BatchKVCache

    from mlx_lily.kernels.dtypes import embedding_dtype
    from mlx_lily.layers.batch_step import reserve_batch_rows

    from mlx_lily.toolchain.registry import kernel_backend

    if kernel_backend()[0] is None:
        raise RuntimeError("the batched decode step runs on lily's kernels only (none here: "
                           f"{kernel_backend()[1]}); stock's layer code cannot be traced for export")
    rows = len(tokens)
    inputs = mx.array(list(tokens), dtype=mx.uint32)[:, None]
    text = model.language_model.model
    for layer, c in zip(text.layers, cache):
        if type(c) is BatchKVCache:
            reserve_batch_rows(c, c._idx + 1, layer.self_attn, embedding_dtype(text.embed_tokens))
    mx.eval([c.state for c in cache])
    saved = [c.state for c in cache]
    unions = expert_unions(text, cache, inputs)
    for c, s in zip(cache, saved):
        c.state = s
    spans = _span_rows(cache)
    must = must_read(model, cache, unions, rows)
    nodes = trace(lambda tok: model(tok, cache=cache), inputs)
    for c, s in zip(cache, saved):
        c.state = s
    # The batched kernels' reads, as they make them (module docstring).
    moe_layer = {name: 0 for name in UNION_KERNELS}
    for node in nodes:
        if node["name"] != "CustomKernel":
            continue
        name = kernel_in(node, UNION_KERNELS)
        if name:
            union = unions[moe_layer[name]]
            moe_layer[name] += 1
            node["inputs"] = [
                _scaled(a, union) if i in UNION_KERNELS[name] and len(a[1]) >= 3 else a
                for i, a in enumerate(node["inputs"])
            ]
        elif kernel_in(node, SPAN_KERNELS):
            node["inputs"] = [
                _rows(a, spans["span_rows"], spans["buffer_rows"]) if i in SPAN_KERNELS["attention_decode"] else a
                for i, a in enumerate(node["inputs"])
            ]
    counts = _count_as_read(nodes)
    must_total = sum(must.values())
    return {
        "method": "mx.export_function graph trace (see bench/batch_counts.py)",
        "device": str(mx.default_device()),
        "rows": rows,
        "context": int(next(c for c in cache if type(c) is BatchKVCache)._idx),
        "kernels_per_decode_step": counts["kernels"],
        "bytes_per_decode_step": counts["bytes"],
        "bytes_read": counts["bytes_read"],
        "bytes_written": counts["bytes_written"],
        "by_primitive": counts["by_primitive"],
        "experts_union_per_layer": unions,
        "bytes_rows_must_read": must_total,
        "must_read_parts": must,
        "ratio_to_must_read": counts["bytes"] / must_total if must_total else None,
    }


def _scaled(arr, union: int):
    """An expert-indexed weight input as ``union`` of its experts."""
    name, shape, dtype = arr
    return (name, (union,) + tuple(shape[1:]), dtype)


def _rows(arr, span_rows: int, buffer_rows: int):
    """A KV buffer input [B, H, S, D] as the rows' spans of it."""
    name, shape, dtype = arr
    B, H, S, D = shape
    return (name, (1, H, span_rows, D), dtype) if span_rows <= B * S else arr


def _count_as_read(nodes):
    """count_nodes, without its one-row table for lily's MoE decode kernels:
    their inputs here are already the union's."""
    from bench import counts

    held = dict(counts.GATHERED_KERNEL_INPUTS)
    for name in UNION_KERNELS:
        counts.GATHERED_KERNEL_INPUTS.pop(name, None)
    try:
        return count_nodes(nodes)
    finally:
        counts.GATHERED_KERNEL_INPUTS.clear()
        counts.GATHERED_KERNEL_INPUTS.update(held)
