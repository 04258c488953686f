"""The layer stack for one decode token: one compiled step, or compiled segments.

Per layer (``decoder.py``) a decode token costs the host a compiled call or
two, plus the layer's Python. Here the whole stack is compiled, either as
**the whole step** (``mlx_lm.generate``'s caches: embedding to final norm in
one ``mx.compile``-d call) or in **segments** cut at each full-attention
layer's KV-cache write and attention (the server's batch caches of one row,
and the reference path). Which of these runs a call, and what a failing one
does, is ``decode_tiers.py``'s table and policy.

Each form's conditions, failures and results: docs/layer-notes.md#text-model.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple, Union

import mlx.core as mx
from mlx_lm.models.base import create_attention_mask, create_ssm_mask
from mlx_lm.models.cache import KVCache
from mlx_lm.models.qwen3_5 import Qwen3_5TextModel

from .. import kernels as K
from ..kernels.attention.sdpa import attention_kernels
from ..kernels.dtypes import embedding_dtype, reference_notice
from ..toolchain.registry import kernel_backend
from .decode_tiers import MODEL_TIERS, DecodeCall, decode, kv_position
from .batch_step import batch_rows, batch_step_takes, decode_batch, layer_kinds
from .decoder import LilyDecoderLayer, compile_enabled, compiled_step, next_position, weights_version
from .prompt_rows import prompt_rows
from .stock_gate import record


class LilyTextModel(Qwen3_5TextModel):
    def __call__(self, inputs: mx.array, cache: Optional[Any] = None, input_embeddings: Optional[mx.array] = None):
        if "_lily_dtype_seen" not in self.__dict__:  # once per model: the activations' dtype notice
            self._dtype_notice(input_embeddings)
        masks = self._segment_masks(inputs, cache) if input_embeddings is None else None
        call = DecodeCall(inputs=inputs, cache=cache, input_embeddings=input_embeddings, masks=masks)
        if masks is None and input_embeddings is None and inputs.ndim == 2 and inputs.shape[0] > 1:
            rows = prompt_rows(self, inputs, cache)  # a batch's prompt, each row as if alone
            if rows is not None:
                return rows
        return decode(self, MODEL_TIERS, call)

    def _stock_stack(self, call: DecodeCall) -> mx.array:
        """Stock's stack of lily's layers (each layer picks its own tier)."""
        return super().__call__(call.inputs, call.cache, call.input_embeddings)

    def _dtype_notice(self, input_embeddings) -> None:
        """Say once which ops run their references at this model's activation
        dtype (where kernels run at all)."""
        self.__dict__["_lily_dtype_seen"] = True
        if kernel_backend()[0] is None:
            return
        dtype = input_embeddings.dtype if input_embeddings is not None else embedding_dtype(self.embed_tokens)
        reference_notice(dtype)

    # -- which calls ----------------------------------------------------------------

    def _segment_masks(self, inputs: mx.array, cache: Any) -> Optional[DecodeMasks]:
        """The masks as stock builds them from the caches, the weights'
        version, and which compiled forms may take this decode token (one
        token per row: the whole step or segments for one row, the batched
        step for the server's batch caches); None when none can. The weights
        are checked first: a change there also has each layer check again
        whether its fused path fits."""
        if cache is None or inputs.ndim != 2 or inputs.shape[1] != 1:
            return None
        if getattr(self, "pipeline_size", 1) != 1 or len(cache) != len(self.layers):
            return None
        if not all(type(layer) is LilyDecoderLayer for layer in self.layers):
            return None
        rows = batch_rows(cache)
        if inputs.shape[0] != 1 and rows != inputs.shape[0]:
            return None
        # The one-row forms exist compiled only; the batched step also runs
        # as plain ops (compilation off, the emulator, a trace for counting).
        compiled = compile_enabled()
        if not compiled and rows is None:
            return None
        version = self._weights_version()
        # None for one token without padding; the server's batch caches give
        # arrays, which the layers' fused steps and the batched step take.
        one = _one_token(inputs.shape[0])
        ssm_mask = create_ssm_mask(one, cache[self.ssm_idx]) if self.ssm_idx is not None else None

        def fa_mask() -> Any:
            return create_attention_mask(one, cache[self.fa_idx]) if self.fa_idx is not None else None

        def one_row(masks: DecodeMasks) -> bool:
            return compiled and inputs.shape[0] == 1 and all(
                layer._takes_decode(one, ssm_mask if layer.is_linear else masks.fa_mask, c)
                for layer, c in zip(self.layers, cache)
            )

        if rows is None:
            masks = DecodeMasks(fa_mask(), ssm_mask, version, None, one_row)
            return masks if masks.one_row else None
        batch = all(layer._lily_fits() for layer in self.layers)
        # The server's caches: the batched step takes the token unless it
        # declines (it reads the left padding in place, no attention mask),
        # so the attention mask and the one-row forms' 40 checks wait until
        # a later tier asks.
        return DecodeMasks(fa_mask, ssm_mask, version, rows if batch else None, one_row)

    # -- the segments ---------------------------------------------------------------

    def _cuts(self) -> List[int]:
        # The attention layers' indices, worked out once per list of layers.
        return list(layer_kinds(self)[0])

    def _decode_segments(self, inputs: mx.array, cache: Any, touched: list, fa_mask: Any, ssm_mask: Any,
                         version: int) -> mx.array:
        if self.ssm_idx is not None:
            record("Gated DeltaNet", "lily decode segments", _ONE_TOKEN, ssm_mask, cache[self.ssm_idx])
        if self.fa_idx is not None:
            record("full attention", "lily decode segments", _ONE_TOKEN, fa_mask, cache[self.fa_idx])
        record("MoE", "lily decode segments", _ONE_TOKEN, None, None)
        cuts = self._cuts()
        bounds = [-1] + cuts + [len(self.layers)]
        carry = [one_token_dtype(inputs)]
        new_states = []
        for s in range(len(bounds) - 1):
            first, last = bounds[s], bounds[s + 1]
            linear = list(range(first + 1, last))
            closes = last < len(self.layers)
            args = list(carry)
            for i in linear:
                args += [cache[i][0], cache[i][1]]
            masked = bool(linear) and ssm_mask is not None
            if masked:
                args.append(ssm_mask)
            if closes:
                args.append(next_position(cache[last]))
            outputs = self._segment(s, first, last, version, masked)(*args)
            n = 2 * len(linear)
            new_states += list(zip(linear, outputs[:n:2], outputs[1:n:2]))
            if not closes:
                hidden = outputs[n]
                break
            queries, keys, values, gate, x = outputs[n:]
            c = cache[last]
            touched.append(kv_position(c))
            keys, values = c.update_and_fetch(keys, values)
            out = K.attention(queries, keys, values, self.layers[last].self_attn.scale, fa_mask, gate=gate)
            carry = [out, x]
        for i, conv, state in new_states:
            cache[i][0], cache[i][1] = conv, state
            cache[i].advance(1)
        return hidden

    def _segment(self, s: int, first: int, last: int, version: int, masked: bool) -> Callable:
        """Segment s (after attention layer ``first``, up to attention layer
        ``last``), compiled per weights ``version`` and whether its DeltaNet
        steps take a padding mask; a new one runs eagerly once first (its
        kernels' first-use checks)."""
        store = self.__dict__.setdefault("_lily_segments", {})
        return compiled_step(store, (s, masked), version, lambda: self._segment_fn(first, last, masked))

    def _weights_version(self) -> int:
        """The stack's ``weights_version`` (the layers, the embedding and the
        final norm, and everything they hold); a change has each layer check
        again whether its fused path fits."""
        version, changed = weights_version(self.__dict__, [*self.layers, self.embed_tokens, self.norm])
        if changed:
            for layer in self.layers:
                layer.__dict__.pop("_lily_decode_ok", None)
        return version

    def _segment_fn(self, first: int, last: int, masked: bool = False) -> Callable:
        layers = self.layers
        linear = list(range(first + 1, last))
        closes = last < len(layers)

        def segment(*args):
            if first < 0:
                h, rest = self.embed_tokens(args[0]), args[1:]
            else:
                out, x = args[:2]
                h, rest = layers[first]._attention_out(out, x), args[2:]
            mask = rest[2 * len(linear)] if masked else None
            states = []
            for j, i in enumerate(linear):
                h, conv, state = layers[i]._linear_step(h, rest[2 * j], rest[2 * j + 1], mask)
                states += [conv, state]
            if not closes:
                return (*states, self.norm(h))
            queries, keys, values, gate = layers[last]._attention_in(h, rest[-1])
            return (*states, queries, keys, values, gate, h)

        return segment

    # -- the server's batched step (batch_step.py) ----------------------------------

    def _batch_takes(self, cache: Any, ssm_mask: Any, rows: int) -> bool:
        return batch_step_takes(self, cache, ssm_mask, rows)

    def _decode_batch(self, inputs: mx.array, cache: Any, ssm_mask: Any, version: int) -> mx.array:
        return decode_batch(self, inputs, cache, ssm_mask, version)

    # -- the whole step -------------------------------------------------------------

    def _whole_takes(self, cache: Any, fa_mask: Any, ssm_mask: Any) -> bool:
        """Whether the whole stack is one compiled step for this token: no
        masks (``mlx_lm.generate``'s caches), every attention layer's cache a
        KVCache filled to one offset, in bf16, and the attention's decode
        kernels on (the reference path stays stock's op sequence: segments)."""
        if fa_mask is not None or ssm_mask is not None or self.fa_idx is None:
            return False
        kv = [cache[i] for i in self._cuts()]
        if not all(type(c) is KVCache and c.keys is not None and c.keys.dtype == mx.bfloat16 for c in kv):
            return False
        if len({c.offset for c in kv}) != 1:
            return False
        backend = kernel_backend()[0]
        return backend is not None and attention_kernels.decode_on(backend)

    def _decode_whole(self, inputs: mx.array, cache: Any, version: int) -> mx.array:
        if self.ssm_idx is not None:
            record("Gated DeltaNet", "lily whole decode step", _ONE_TOKEN, None, cache[self.ssm_idx])
        record("full attention", "lily whole decode step", _ONE_TOKEN, None, cache[self.fa_idx])
        record("MoE", "lily whole decode step", _ONE_TOKEN, None, None)
        offset = cache[self.fa_idx].offset
        for i in self._cuts():
            reserve_rows(cache[i], offset + 1)
        args = [one_token_dtype(inputs)]
        for layer, c in zip(self.layers, cache):
            args += [c[0], c[1]] if layer.is_linear else [c.keys, c.values]
        args.append(mx.array([offset], dtype=mx.int32))
        outputs = self._whole(version)(*args)
        # The step's caches replace the old ones, which only the new graph
        # then holds: MLX writes each new KV row in place.
        del args
        for layer, c, (a, b) in zip(self.layers, cache, zip(outputs[0::2], outputs[1::2])):
            if layer.is_linear:
                c[0], c[1] = a, b
                c.advance(1)
            else:
                c.keys, c.values = a, b
                c.offset += 1
        return outputs[-1]

    def _whole(self, version: int) -> Callable:
        """The whole stack's step, compiled per weights ``version`` (and
        traced by MLX once per KV capacity); a new one runs eagerly once first.
        A kernel first met inside a later capacity's trace runs its reference
        there, and the step runs eagerly again and is traced afresh (see
        ``compiled_step``)."""
        store = self.__dict__.setdefault("_lily_segments", {})
        return compiled_step(store, "whole", version, self._whole_fn)

    def _whole_fn(self) -> Callable:
        layers = self.layers

        def step(tokens, *rest):
            position = rest[-1]
            length = position + 1  # once, not once per attention layer (a launch each)
            h = self.embed_tokens(tokens)
            outputs = []
            for i, layer in enumerate(layers):
                if layer.is_linear:
                    h, a, b = layer._linear_step(h, rest[2 * i], rest[2 * i + 1])
                else:
                    h, a, b = layer._attention_step(h, rest[2 * i], rest[2 * i + 1], position, length=length)
                outputs += [a, b]
            return (*outputs, self.norm(h))

        return step


# KV caches on the whole-step path hold a multiple of this many rows: each
# capacity is one trace of the compiled step (a new one each CAPACITY_STEP
# tokens, several seconds of decode), and the decode attention's grid follows
# the capacity, not the filled length.
CAPACITY_STEP = 1024


def whole_capacity(rows: int) -> int:
    """The smallest whole number of CAPACITY_STEP rows that holds ``rows``."""
    return -(-rows // CAPACITY_STEP) * CAPACITY_STEP


def held_capacity(capacity: int, rows: int) -> int:
    """The capacity ``reserve_rows`` gives a buffer of ``capacity`` rows that
    must hold ``rows``: kept if it is already a whole number of steps with
    room, else the smallest whole one for the rows. A buffer grown in stock's
    256-row steps from a reused prefix (a checkpoint's position plus the rest
    of the prompt) is cut back to the cold prompt's capacity, not rounded up
    past it: the same trace of the compiled step, and the same decode bits."""
    if capacity % CAPACITY_STEP == 0 and capacity >= rows:
        return capacity
    return whole_capacity(rows)


def reserve_rows(cache: KVCache, rows: int, filled: Optional[int] = None) -> None:
    """Give a KVCache room for ``rows`` rows, its capacity a multiple of
    CAPACITY_STEP (stock's KVCache grows 256 rows at a time;
    ``held_capacity``). It keeps the rows up to ``filled`` (default: its
    offset; a BatchKVCache's write index) and the rest are zeros; rows past
    it are never read (the attention is bounded by the position). The cache
    stays a valid cache for stock's code."""
    filled = cache.offset if filled is None else filled
    capacity = cache.keys.shape[2]
    wanted = held_capacity(capacity, max(rows, filled))
    if wanted == capacity:
        return

    def grown(a: mx.array) -> mx.array:
        B, H, _, D = a.shape
        return mx.concatenate([a[..., :filled, :], mx.zeros((B, H, wanted - filled, D), dtype=a.dtype)], axis=2)

    cache.keys, cache.values = grown(cache.keys), grown(cache.values)


def one_token_dtype(tokens: mx.array) -> mx.array:
    """The token as uint32, the dtype mlx-lm's samplers give: the prompt's
    last token comes as int32, and a compiled step traces each input dtype
    anew (the whole 40-layer stack, once more per generation)."""
    return tokens if tokens.dtype == mx.uint32 else tokens.astype(mx.uint32)


class _OneToken:
    """Stands in for the hidden state's shape (B rows of one token) in the
    layers' eligibility checks and the masks stock builds."""

    def __init__(self, rows: int):
        self.shape = (rows, 1)


_ONE_TOKENS = {}


def _one_token(rows: int = 1) -> _OneToken:
    held = _ONE_TOKENS.get(rows)
    if held is None:
        held = _ONE_TOKENS[rows] = _OneToken(rows)
    return held


_ONE_TOKEN = _one_token(1)


class DecodeMasks:
    """What ``_segment_masks`` found for a decode token: the attention and
    DeltaNet masks stock builds, the weights' version, the batch's rows where
    the batched step may take it (else None), and whether the one-row forms
    (whole step, segments) may. The attention mask may be given as a function
    that builds it, and the one-row answer as a function of these masks; each
    is called once, when a tier first asks (``fa_mask``, ``one_row``)."""

    def __init__(self, fa_mask: Any, ssm_mask: Any, version: int, rows: Optional[int],
                 one_row: Union[bool, Callable[["DecodeMasks"], bool]]):
        self._fa_mask, self.ssm_mask, self.version, self.rows = fa_mask, ssm_mask, version, rows
        self._one_row = one_row

    @property
    def fa_mask(self) -> Any:
        if callable(self._fa_mask):
            self._fa_mask = self._fa_mask()
        return self._fa_mask

    @property
    def one_row(self) -> bool:
        if callable(self._one_row):
            self._one_row = bool(self._one_row(self))
        return self._one_row
