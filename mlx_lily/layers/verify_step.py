"""Speculative verification on the decode kernels: k + 1 positions of one
stream in one pass, each position given the bits a decode step alone gives it.

A speculative round feeds the model the pending token and k drafts. Lily's
prompt (several-token) ops would run that call, and their bits differ from
the one-token decode kernels', so greedy output with drafts could drift from
greedy output without. Here the P = k + 1 positions run on the decode
kernels, as P rows of the server's batched ones (docs/serving.md, "Batch
invariance": a row's result is the same bits alone or in a batch of 1..16):

* every GEMV (projections, router, shared-expert gate) and the MoE chain
  (``moe_decode``) take the P positions as P rows: each weight is read once
  for all positions, each row reduced as a one-row decode step reduces it;
* Gated DeltaNet: the recurrence is sequential, so one launch of its decode
  kernel's body takes the P positions in order (``gated_delta_decode_steps``;
  where that kernel is off, the one-row kernel runs once per position), and
  the state after each position is kept: the rollback of a rejected draft
  puts one of them back (``TrimmableArraysCache.push_stacked``: sliced out only then);
* attention: the P keys and values are written into the stream's KV cache,
  then position i attends to the cache up to itself as the one-row decode
  kernel reads it, over the very view a decode step alone would read: the
  cache's filled rows (the layer's fused step and the compiled segments; P
  launches) or the buffer at the capacity the compiled whole step would hold,
  bounded by ``length`` (``form="whole"``; one launch for the P positions
  where they share that capacity: rows of one view, each at its own length,
  read in place). The batched attention kernel (a ``start`` per row) is not
  used: its key blocks follow each row's span, the one-row kernel's follow
  the view, so at long contexts their bits differ.

``verify_form`` says whether (and in which form) the pass takes a call:
lily's kernels on, every layer on its fused decode path, one stream's
KVCaches and Gated DeltaNet caches. Elsewhere (the reference path, a sharded
model, other caches) the caller runs the model's own call, as before.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from .. import kernels as K
from ..toolchain.registry import kernel_backend
from ..trimmable_cache import LILY_ARRAYS_CACHES
from .batch_step import MAX_BATCH
from .decoder import LilyDecoderLayer, compile_enabled, compiled_step
from .sharded import group_of
from .stock_gate import record


class _Rows:
    """Stands in for a hidden state's shape in the layers' checks."""

    def __init__(self, rows: int, tokens: int):
        self.shape = (rows, tokens)


def verify_form(text_model: Any, cache: List[Any], positions: int) -> Optional[str]:
    """"whole" or "view" (which attention view a decode step alone would
    read: the compiled whole step's, or the filled rows') where the
    verification pass takes ``positions`` positions on these caches, else
    None (the caller runs the model's own call)."""
    if not 1 <= positions <= MAX_BATCH or kernel_backend()[0] is None:
        return None
    layers = getattr(text_model, "layers", None)
    if layers is None or getattr(text_model, "pipeline_size", 1) != 1 or len(cache) != len(layers):
        return None
    kinds = _fused_layers(text_model, layers)
    if kinds is None:
        return None
    # Each cache as the layer's fused decode step takes a one-token call
    # (``LilyDecoderLayer._takes_decode`` without a mask), one stream's.
    for is_linear, c in zip(kinds, cache):
        if is_linear:
            if not (type(c) in LILY_ARRAYS_CACHES and c.left_padding is None and c.lengths is None
                    and c.cache[0] is not None and c.cache[1] is not None):
                return None
        elif not (type(c) is KVCache and c.keys is not None):
            return None
    if compile_enabled() and text_model.__dict__.get("_lily_whole_ok") is not False \
            and text_model._whole_takes(cache, None, None):
        return "whole"
    return "view"


def _fused_layers(text_model: Any, layers: List[Any]) -> Optional[List[bool]]:
    """Per layer whether it is a Gated DeltaNet one, where every layer is on
    its fused decode path (lily's class, its parts fit, it has not failed,
    whole on this rank), else None. Held on the text model while the layers'
    classes and their fused paths' verdicts stay as they were: a round's
    pass asks every time, and the answer is 40 layers' attribute look-ups."""
    def key() -> tuple:
        return tuple(type(layer) for layer in layers), tuple(layer.__dict__.get("_lily_decode_ok") for layer in layers)

    held = text_model.__dict__.get("_lily_verify_layers")
    if held is not None and held[0] == key():
        return held[1]
    kinds: Optional[List[bool]] = []
    for layer in layers:
        if type(layer) is not LilyDecoderLayer or not layer._lily_fits() or layer.mlp.sharding_group is not None:
            kinds = None
            break
        if layer.is_linear:
            if layer.linear_attn.sharding_group is not None:
                kinds = None
                break
        elif group_of(layer.self_attn) is not None:
            kinds = None
            break
        kinds.append(bool(layer.is_linear))
    text_model.__dict__["_lily_verify_layers"] = (key(), kinds)
    return kinds


def verify(text_model: Any, tokens: mx.array, cache: List[Any], form: Optional[str] = None) -> Optional[mx.array]:
    """The final (normed) hidden states [P, 1, D] of ``tokens`` [P] fed after
    ``cache``'s tokens, each row the bits of a decode step alone; the caches
    advance by P (KV caches by their offsets; each Gated DeltaNet cache holds
    the state after the last position and, where it keeps steps, the state
    before each). None, with nothing done, where the pass does not take the
    call (``verify_form``)."""
    P = int(tokens.size)
    form = form or verify_form(text_model, cache, P)
    if form is None:
        return None
    layers = text_model.layers
    attn = [i for i, layer in enumerate(layers) if not layer.is_linear]
    offset = cache[attn[0]].offset if attn else 0
    if any(cache[i].offset != offset for i in attn):
        return None
    shape = _Rows(P, 1)
    if text_model.ssm_idx is not None:
        record("Gated DeltaNet", "lily verify pass", shape, None, cache[text_model.ssm_idx])
    if attn:
        record("full attention", "lily verify pass", shape, None, cache[attn[0]])
    record("MoE", "lily verify pass", shape, None, None)
    spans = _spans(text_model, cache, attn, offset, P, form)
    args = [tokens.reshape(P, 1).astype(mx.uint32)]
    for layer, c in zip(layers, cache):
        args += [c[0], c[1]] if layer.is_linear else [c.keys, c.values]
    args.append(mx.array([offset], dtype=mx.int32))
    step = _step(text_model, P, tuple(spans), form)
    outputs = step(*args)
    del args
    at = 0
    for layer, c in zip(layers, cache):
        if layer.is_linear:
            convs, states = outputs[at], outputs[at + 1]  # [P, ...]: the states after each position
            at += 2
            if hasattr(c, "push_stacked"):
                c.push_stacked(convs, states)
            else:
                c[0], c[1] = convs[P - 1:], states[P - 1:]
                c.advance(P)
        else:
            c.keys, c.values = outputs[at], outputs[at + 1]
            c.offset += P
            at += 2
    return outputs[-1]


def _spans(text_model: Any, cache: List[Any], attn: List[int], offset: int, P: int, form: str) -> List[int]:
    """Per position, the rows of the KV view its attention reads: the filled
    rows ("view"), or the capacity the compiled whole step would hold then
    ("whole"; every buffer is first given room for all P rows)."""
    if form == "view":
        for i in attn:
            _room(cache[i], offset + P)
        return [offset + i + 1 for i in range(P)]
    from .text_model import held_capacity, reserve_rows

    # The whole step sets its buffers' capacity with held_capacity as tokens
    # come; a rejected draft may have grown this buffer past what the
    # stream's kept tokens needed, so the capacity the stream had before its
    # first verified token stands for the history.
    # (Kept on the stream's first KV cache: (offset, capacity) then.)
    first = cache[attn[0]]
    base = getattr(first, "_lily_verify_base", None)
    if base is None or base[0] > offset:
        base = first._lily_verify_base = (offset, first.keys.shape[2])
    for i in attn:
        reserve_rows(cache[i], offset + P)
    spans, capacity = [], base[1]
    for i in range(P):
        capacity = held_capacity(capacity, offset + i + 1)
        spans.append(capacity)
    return spans


def _room(cache: KVCache, rows: int) -> None:
    """Room for ``rows`` rows in a KVCache's buffers, in stock's steps (the
    attention reads the filled rows in place, whatever the capacity)."""
    capacity = cache.keys.shape[2]
    if rows <= capacity:
        return
    grow = -(-(rows - capacity) // cache.step) * cache.step

    def grown(a: mx.array) -> mx.array:
        B, H, _, D = a.shape
        return mx.concatenate([a, mx.zeros((B, H, grow, D), dtype=a.dtype)], axis=2)

    cache.keys, cache.values = grown(cache.keys), grown(cache.values)


def _step(text_model: Any, P: int, spans: tuple, form: str) -> Callable:
    """The pass for P positions and these views: compiled per weights'
    version in the whole step's form where compilation is on (its views are
    fixed until a capacity step); as plain ops otherwise (the filled rows'
    views change every round)."""
    if form != "whole" or not compile_enabled():
        return verify_fn(text_model, P, spans, form)
    version = text_model._weights_version()
    store = text_model.__dict__.setdefault("_lily_verify", {})
    return compiled_step(store, (P, spans, form), version, lambda: verify_fn(text_model, P, spans, form))


def write_rows(buffer: mx.array, rows: mx.array, position: mx.array, at: Optional[mx.array] = None) -> mx.array:
    """``buffer`` [1, H, capacity, D] with ``rows`` [1, H, P, D] at sequence
    indices position .. position + P - 1 (``position`` an int32 array [1];
    ``at``: those indices [P], where the caller has them)."""
    P = rows.shape[2]
    at = position + mx.arange(P, dtype=mx.int32) if at is None else at
    return mx.put_along_axis(buffer, mx.broadcast_to(at.reshape(1, 1, P, 1), rows.shape), rows, axis=2)


def verify_fn(text_model: Any, P: int, spans: tuple, form: str) -> Callable:
    """(tokens [P, 1], each layer's two states or KV buffers, the stream's
    offset [1]) -> (per DeltaNet layer: the conv states and the recurrent
    states after each position, stacked [P, ...]; per attention layer: the
    KV buffers with the P rows written; the final norm's output [P, 1, D])."""
    layers = text_model.layers

    def step(tokens, *rest):
        position = rest[-1]
        rows = position + mx.arange(P, dtype=mx.int32)  # once, not once per attention layer
        h = text_model.embed_tokens(tokens)
        outputs = []
        for i, layer in enumerate(layers):
            if layer.is_linear:
                h, convs, states = _linear_rows(layer, h, rest[2 * i], rest[2 * i + 1])
                outputs += [convs, states]
            else:
                h, keys, values = _attention_rows(layer, h, rest[2 * i], rest[2 * i + 1], position, spans, form,
                                                  rows)
                outputs += [keys, values]
        return (*outputs, text_model.norm(h))

    return step


def _linear_rows(layer: Any, x: mx.array, conv_state: mx.array, state: mx.array):
    """``LilyDecoderLayer._linear_step`` for P positions [P, 1, D] of one
    stream: the GEMVs and the MoE chain on P rows; the DeltaNet decode of the
    P positions in order, in one launch (``gated_delta_decode_steps``: each
    position the bits of a one-row decode step) where its kernel is on, else
    the one-row kernel once per position."""
    la = layer.linear_attn
    qkv, z, b, a = layer._linear_in(x)
    P = x.shape[0]
    weights = (la.conv1d.weight, la.A_log, la.dt_bias)
    rest = (la.norm.weight, la.norm.eps, la.num_k_heads)
    if P > 1 and _steps_on(qkv, z, a, b, conv_state, *weights, state, *rest):
        y, convs, states = K.gated_delta_decode_steps(qkv, z, a, b, conv_state, *weights, state, *rest)
        return layer._linear_out(y, x), convs, states
    ys, convs, states = [], [], []
    for p in range(P):
        y, conv_state, state = K.gated_delta_decode(
            qkv[p:p + 1], z[p:p + 1], a[p:p + 1], b[p:p + 1], conv_state, *weights, state, *rest)
        ys.append(y)
        convs.append(conv_state)
        states.append(state)
    return (layer._linear_out(mx.concatenate(ys, axis=0), x), mx.concatenate(convs, axis=0),
            mx.concatenate(states, axis=0))


def _rows_on() -> bool:
    """Whether the attention's decode kernel takes rows of one view at their
    own lengths here (its self-checks of that form passed)."""
    from ..kernels.attention.sdpa import attention_kernels

    backend = kernel_backend()[0]
    return backend is not None and attention_kernels.rows_on(backend)


def _steps_on(*args) -> bool:
    """Whether ``gated_delta_decode_steps`` runs these positions on its kernel
    (the one-row decode kernel's body, one launch): its reference, stock's
    ops, would not give the decode kernel's bits."""
    from ..kernels.gated_delta.decode import gated_delta_decode_steps_supports

    return (K.gated_delta_decode_steps.planned_path()[0] == "kernel"
            and K.gated_delta_decode.planned_path()[0] == "kernel"
            and gated_delta_decode_steps_supports(*args) is None)


def _attention_rows(layer: Any, x: mx.array, keys_cache: mx.array, values_cache: mx.array, position: mx.array,
                    spans: tuple, form: str, rows: Optional[mx.array] = None):
    """The attention layer for P positions [P, 1, D] of one stream: the
    q/k/v GEMVs, RoPE (each row at its own position), the output projection
    and the MoE chain on P rows; the P keys/values written at the stream's
    offset; position i's attention by the one-row decode kernel over the
    view a decode step alone reads at that position (``spans[i]`` rows).
    ``rows``: the positions, position + [0, P), where the caller has them."""
    P = x.shape[0]
    rows = position + mx.arange(P, dtype=mx.int32) if rows is None else rows
    ends = rows + 1  # each position's attention reads up to itself
    queries, keys, values, gate = layer._attention_in(x, rows)
    # [P, Hkv, 1, D] -> the stream's [1, Hkv, P, D]
    keys_cache = write_rows(keys_cache, keys.transpose(2, 1, 0, 3), position, rows)
    values_cache = write_rows(values_cache, values.transpose(2, 1, 0, 3), position, rows)
    scale = layer.self_attn.scale
    if form == "whole" and P > 1 and len(set(spans)) == 1 and _rows_on():
        # One launch: position i as a one-row call over the same view,
        # bounded at its own length (the decode kernel's rows of one view).
        shape = (P, *keys_cache.shape[1:])
        k = mx.broadcast_to(keys_cache[..., : spans[0], :], shape[:2] + (spans[0], shape[3]))
        v = mx.broadcast_to(values_cache[..., : spans[0], :], shape[:2] + (spans[0], shape[3]))
        out = K.attention(queries, k, v, scale, None, length=ends, gate=gate)
        return layer._attention_out(out, x), keys_cache, values_cache
    outs = []
    for i in range(P):
        k, v = keys_cache[..., : spans[i], :], values_cache[..., : spans[i], :]
        bound = {"length": ends[i:i + 1]} if form == "whole" else {}
        outs.append(K.attention(queries[i:i + 1], k, v, scale, None, gate=gate[i:i + 1], **bound))
    out = mx.concatenate(outs, axis=0)
    return layer._attention_out(out, x), keys_cache, values_cache


# -- the MTP head's positions ------------------------------------------------------


def _head_rows_take(hidden: mx.array, cache: Any, layer: Any) -> bool:
    """Whether the head's rows path takes S = hidden.shape[1] positions of
    one stream: a filled bf16 KVCache, the kernels on, its layer on lily's
    fused attention path, unsharded."""
    S = hidden.shape[1]
    return (hidden.shape[0] == 1 and 1 <= S <= MAX_BATCH and type(cache) is KVCache and cache.keys is not None
            and cache.keys.dtype == mx.bfloat16 and kernel_backend()[0] is not None
            and type(layer) is LilyDecoderLayer and not layer.is_linear and layer._lily_fits()
            and group_of(layer.self_attn) is None and layer.mlp.sharding_group is None)


def head_rows(head: Any, layer: Any, hidden: mx.array, embeddings: mx.array, cache: Any) -> Optional[mx.array]:
    """The MTP head's forward (``mtp.MTPHead``) over S verified positions of
    one stream (hidden, embeddings [1, S, D]) on the decode kernels, its
    layer's S rows as the verification pass takes a round's positions: one
    compiled step per (S, KV capacity) where compilation is on, so a round's
    drafts cost one call's replay rather than a prompt call's ops. The head's
    KV buffers grow to whole capacities as the main model's do in the
    compiled whole step (``text_model.reserve_rows``); each position attends
    up to itself. Returns the head's normed hidden [1, S, D] (its cache
    advanced by S), or None, with nothing done, where this path does not
    take the call (the head then runs its own ops). Drafts only steer which
    tokens are verified, so their bits need not be the prompt ops'."""
    if not _head_rows_take(hidden, cache, layer):
        return None
    from .text_model import reserve_rows

    S = hidden.shape[1]
    offset = cache.offset
    reserve_rows(cache, offset + S)
    capacity = int(cache.keys.shape[2])
    position = mx.array([offset], dtype=mx.int32)
    step = _compiled(head, ("rows", id(layer), S, capacity), lambda: _head_step(head, layer, S, capacity))
    out, cache.keys, cache.values = step(hidden, embeddings, cache.keys, cache.values, position)
    cache.offset += S
    return out


def head_drafts(head: Any, layer: Any, hidden: mx.array, embeddings: mx.array, cache: Any, k: int,
                logits_of: Callable[[mx.array], mx.array], embed: Callable[[mx.array], mx.array],
                head_on_gemv: bool, weights: List[Any]) -> Optional[mx.array]:
    """A round's k greedy drafts [k] (uint32) from S verified positions, as
    ``mtp_decode``'s drafting loop makes them (the head over the S positions,
    then k times: the logits of its last output (``logits_of``), their
    argmax, and but for the last the head over that draft's embedding
    (``embed``) at the next position), as one compiled call per (S, k, KV
    capacity, ``head_on_gemv``: whether ``logits_of`` is lily's head GEMV)
    where compilation is on: a round's drafting is one call's replay, not k
    head calls, k logits and k argmaxes built one by one. The head's cache
    advances by S + k - 1 (the loop's draft positions, which its caller
    trims). ``weights``: the modules ``logits_of`` and ``embed`` read (the
    language model's lm_head and embedding), whose replacement retraces the
    call as the head's own does. None, with nothing done, where
    ``head_rows`` would not take the S positions."""
    if not _head_rows_take(hidden, cache, layer):
        return None
    from .text_model import reserve_rows

    S = hidden.shape[1]
    offset = cache.offset
    reserve_rows(cache, offset + S + k - 1)
    capacity = int(cache.keys.shape[2])
    position = mx.array([offset], dtype=mx.int32)

    def build() -> Callable:
        first, then = _head_step(head, layer, S, capacity), _head_step(head, layer, 1, capacity)

        def chain(hidden, embeddings, keys, values, position):
            g, keys, values = first(hidden, embeddings, keys, values, position)
            g = g[:, -1:]
            drafts = []
            for j in range(k):
                d = mx.argmax(logits_of(g)[0], axis=-1)  # [1]
                drafts.append(d)
                if j + 1 < k:
                    g, keys, values = then(g, embed(d[None]), keys, values, position + (S + j))
            return mx.concatenate(drafts).astype(mx.uint32), keys, values
        return chain

    step = _compiled(head, ("drafts", id(layer), S, k, capacity, head_on_gemv), build, weights)
    drafts, cache.keys, cache.values = step(hidden, embeddings, cache.keys, cache.values, position)
    cache.offset += S + k - 1
    return drafts


def _head_step(head: Any, layer: Any, S: int, capacity: int) -> Callable:
    """The head's forward over S rows at this KV capacity, as plain ops."""
    def step(hidden, embeddings, keys, values, position):
        e = head.pre_fc_norm_embedding(embeddings)
        g = head.pre_fc_norm_hidden(hidden)
        u = head.fc(mx.concatenate([e, g], axis=-1)).reshape(S, 1, -1)
        h, keys, values = _attention_rows(layer, u, keys, values, position, (capacity,) * S, "whole")
        return head.norm(h).reshape(1, S, -1), keys, values
    return step


def _compiled(head: Any, key: tuple, build: Callable[[], Callable], weights: Optional[List[Any]] = None) -> Callable:
    """``build()``'s function compiled per version of the head's weights (and
    ``weights``' modules) under ``key`` where compilation is on, else as
    plain ops (the emulator's, which runs each kernel when it is called)."""
    if not compile_enabled():
        return build()
    from .decoder import weights_version

    # One version record per set of roots (a record kept for other roots
    # would count every call as a change).
    owner = head.__dict__ if not weights else head.__dict__.setdefault("_lily_drafts_weights", {})
    version, _ = weights_version(owner, [head, *(weights or [])])
    store = head.__dict__.setdefault("_lily_rows", {})
    return compiled_step(store, key, version, build)


class VerifyingModel:
    """Lily's model as mlx-lm's speculative loop (``--draft-model``) sees it:
    its calls after the prompt's first ``prefill`` tokens (the loop's
    prefill, all but the prompt's last token) run the verification pass
    where it takes them, their logits each position's as a decode step's;
    everything else is the model's own."""

    def __init__(self, model: Any, prefill: int):
        self.__dict__.update(_model=model, _prefill_left=int(prefill))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._model, name)

    def __call__(self, inputs: mx.array, cache: Optional[Any] = None, **kwargs: Any) -> mx.array:
        model = self._model
        if self._prefill_left > 0 or kwargs or cache is None or inputs.ndim != 2 or inputs.shape[0] != 1:
            self.__dict__["_prefill_left"] -= inputs.shape[-1]
            return model(inputs, cache=cache, **kwargs)
        hidden = verify(model.language_model.model, inputs[0], cache)
        if hidden is None:
            return model(inputs, cache=cache)
        return model.language_model.head(hidden, cache).reshape(1, inputs.shape[1], -1)
