"""The decoder layer, and its fused path for one decode token.

Stock's layer is ``h = x + mixer(norm(x)); out = h + moe(norm(h))``, a
hundred-odd small launches per decode token. For one token of one sequence
lily runs the same math as a few fused kernels, each reading its weights
once, as ``mx.compile``-d steps (``MLX_LILY_COMPILE_DECODE=0`` turns
compilation off); other calls run stock's layer flow with lily's classes.
Prefill paces its layers (``pace_prefill``).

The fused launches per layer type, which calls take the fused path, the
compiled steps, and prefill's pacing: docs/layer-notes.md#decoder.
"""

from __future__ import annotations

import contextlib
import operator
import os
from typing import Any, Callable, Iterator, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import BatchKVCache, KVCache
from mlx_lm.models.qwen3_5 import DecoderLayer

from .. import kernels as K
from ..kernels.linear.gemv_tiles import takes_tiles
from ..kernels.moe import decode_router
from .._notice import notice_once
from ..toolchain.tracing import first_uses_in_traces, first_uses_met_since, tracing
from ..toolchain.registry import kernel_backend
from ..trimmable_cache import LILY_ARRAYS_CACHES
from .attention import attention_heads
from .decode_tiers import LAYER_TIERS, Declined, DecodeCall, decode, kv_position
from .sharded import QUANTIZED_LINEARS, SHARDED_MOE_DECODE, all_sum, group_of
from .stock_gate import record, why_stock

COMPILE_ENV = "MLX_LILY_COMPILE_DECODE"
PACE_ENV = "MLX_LILY_PACE_PREFILL"


def _env_off(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() in ("0", "false", "no", "off")


def router_launch_fits(h: mx.array, gates: tuple, norm_weight: mx.array, eps: float) -> bool:
    """Whether a MoE decode step takes the router's launch
    (``moe_decode_router``): rows enough (``decode_router.MIN_ROWS``), and
    the router GEMV it stands for is the row GEMV's (its logits are that
    kernel's bits, not the tile form's)."""
    return h.shape[0] >= decode_router.MIN_ROWS and not takes_tiles(h, gates, norm_weight, eps)


def _triple(linear) -> tuple:
    return (linear.weight, linear.scales, linear.biases)


def _projected_onto(y: mx.array, linear: Any, x: mx.array, group: Any) -> mx.array:
    """x + linear(y) on the GEMV. A rank's slice of a sharded layer
    (``group``) gives a partial sum, summed across the group before the
    residual, in stock's order."""
    if group is None:
        (h,) = K.decode_matvec(y, (_triple(linear),), residual=x)
        return h
    (partial,) = K.decode_matvec(y, (_triple(linear),))
    return x + all_sum(partial, group)


def _plain_quantized(*linears) -> bool:
    """Quantized linears without bias (what the fused GEMV reads), whole or
    a rank's slice (sharded.py)."""
    return all(
        isinstance(m, QUANTIZED_LINEARS) and "bias" not in m and getattr(m, "mode", "affine") == "affine"
        for m in linears
    )


def next_position(cache: Any) -> mx.array:
    """The next token's position in a KV cache, as an array [1] (so a compiled
    step serves every position); a BatchKVCache's offset already is one (its
    row's position, left padding counted negative)."""
    return cache.offset if type(cache) is BatchKVCache else mx.array([cache.offset], dtype=mx.int32)


def write_row(buffer: mx.array, row: mx.array, position: mx.array) -> mx.array:
    """``buffer`` [B, H, capacity, D] with ``row`` [B, H, 1, D] at sequence
    index ``position`` (an int32 array [1]): one scatter, in place where MLX
    may reuse the buffer, at a position a compiled graph takes as input."""
    index = mx.broadcast_to(position.reshape(1, 1, 1, 1), row.shape)
    return mx.put_along_axis(buffer, index, row, axis=2)


def _one_step_mask(mask: Any) -> bool:
    """A DeltaNet padding mask for one step of one row: [1, 1] bool."""
    return isinstance(mask, mx.array) and mask.dtype == mx.bool_ and tuple(mask.shape) == (1, 1)


def _places(*modules: nn.Module) -> tuple:
    """(holders, keys, modules): where every array and submodule of the
    modules sits, ``holders[i][keys[i]]``, flat, so that reading them all back
    is one C-level pass and no Python per module; and every module visited,
    whose entry counts show a key added or removed."""
    holders, keys, visited = [], [], []
    for root in modules:
        for _, module in root.named_modules():
            visited.append(module)
            for key, value in module.items():
                if isinstance(value, (mx.array, nn.Module)):
                    holders.append(module)
                    keys.append(key)
    return holders, keys, visited


def _held(places: tuple) -> tuple:
    """(what sits at each place now, each module's entry count)."""
    holders, keys, modules = places
    return list(map(operator.getitem, holders, keys)), list(map(len, modules))


def _same(places: tuple, held: tuple) -> bool:
    """Whether every place still holds the object ``held`` lists and no
    module gained or lost an entry: one C-level pass of identity tests (no id
    numbers made), then the counts."""
    holders, keys, modules = places
    objects, sizes = held
    try:
        return all(map(operator.is_, map(operator.getitem, holders, keys), objects)) \
            and list(map(len, modules)) == sizes
    except LookupError:  # a key was deleted
        return False


# Entries of nn.Modules (arrays, submodules) set, replaced or removed in this
# process, counted by nn.Module's dict mutators once ``count_module_changes``
# has wrapped them (each counts after its write). While the count stands
# still no weight can have changed, and ``weights_version`` is one comparison
# instead of a pass over every entry (about 0.5 ms a token at the real shapes
# on the H200). A write that bypasses nn.Module's methods (``dict.__setitem__
# (module, ...)``, an array changed in place) is no more seen than before.
_MODULE_CHANGES = [0]


def count_module_changes() -> None:
    """Wrap nn.Module's dict mutators so that they count their writes into
    ``_MODULE_CHANGES`` (once per process; a no-op after)."""
    if nn.Module.__dict__.get("_lily_counts_changes"):
        return
    changes = _MODULE_CHANGES

    def counting(name: str, counts: Callable[..., bool] = lambda *a: True) -> Callable:
        base = getattr(nn.Module, name)

        def method(self, *args, **kwargs):
            counted = counts(self, *args)
            result = base(self, *args, **kwargs)
            if counted:
                changes[0] += 1
            return result

        method.__name__ = name
        return method

    present = lambda self, key=None, *rest: key in self  # noqa: E731
    for name in ("__setitem__", "__delitem__", "popitem", "clear"):
        setattr(nn.Module, name, counting(name))
    # pop(key) counts only a removal: mlx's __setattr__ pops every plain
    # attribute's name, which is no change of an entry.
    nn.Module.pop = counting("pop", present)
    nn.Module.setdefault = counting("setdefault", lambda self, key=None, *rest: key not in self)
    nn.Module._lily_counts_changes = True


def weights_version(store: dict, roots: list) -> tuple[int, bool]:
    """(version, changed): a number that changes whenever a root, or any
    array or submodule under the roots, is replaced, added or deleted
    (load_weights, update, a new scale, a swapped module or layer), and
    whether it changed on this call. Kept in ``store`` (an owner's
    ``__dict__``: nn.Module would keep a list attribute as a child), with the
    objects it was built on and the module-change count it was checked at;
    the entries are compared again only when that count moved, and listed
    again only when something changed."""
    count_module_changes()
    count = _MODULE_CHANGES[0]
    held = store.get("_lily_weights")
    if held is not None and len(held[0]) == len(roots) and all(map(operator.is_, held[0], roots)):
        if held[4] == count:
            return held[3], False
        if _same(held[1], held[2]):
            store["_lily_weights"] = (*held[:4], count)
            return held[3], False
    places = _places(*roots)
    version = held[3] + 1 if held is not None else 0
    store["_lily_weights"] = (list(roots), places, _held(places), version, count)
    return version, True


def compiled_step(store: dict, name: Any, key: Any, build: Callable[[], Callable]) -> Callable:
    """``mx.compile(build())``, held in ``store[name]`` while ``key`` (the
    ``weights_version`` of the weights it captures) stays the same.

    A new compiled step first runs the function eagerly, once, and evaluates
    it: its kernels' first-use checks evaluate arrays, which a trace may not.
    That result is dropped and the compiled step answers this call too, so
    every token (the first included) comes from the same computation.

    A kernel can still meet its first use inside a trace: a trace for new
    input shapes (a KV capacity, a batch size the server meets for the first
    time), or a check the eager run left for later (its reference was not
    finite). There the reference answers, and MLX would replay it for good.
    So the step runs eagerly once more (the checks) and that same call is
    answered by a fresh trace, with the kernels: the bits every other call
    gets, which batch invariance needs (an eager answer could differ from a
    compiled one where MLX fuses elementwise ops). A trace that keeps meeting
    first uses is traced afresh at most MAX_RETRACES times in a row; a call
    that meets none renews that allowance, so a server meeting new batch
    sizes all its life keeps its kernels in every trace."""
    held = store.get(name)
    if held is not None and held[0] == key:
        return held[1]
    fn = build()
    state = {"compiled": mx.compile(fn), "retraces": 0}

    def step(*args):
        while True:
            before = first_uses_in_traces()
            out = state["compiled"](*args)
            if first_uses_in_traces() == before:
                state["retraces"] = 0
                return out
            if state["retraces"] >= MAX_RETRACES:
                return out
            state["retraces"] += 1
            for what in set(first_uses_met_since(before)) if not _PRIMING["on"] else ():
                # Each instance once: a build in the middle of decoding stalls every row of it.
                notice_once(f"first-use-in-trace:{what}", f"kernel {what} first met inside a compiled "
                                                          f"step ({_step_label(name)}): checked, traced again")
            mx.eval(fn(*args))  # the checks
            # A new function object: MLX keys its traces by the function.
            state["compiled"] = mx.compile(lambda *a: fn(*a))

    store[name] = (key, step)

    def first_call(*args):
        mx.eval(fn(*args))
        return step(*args)

    return first_call


# While warmup.prime runs, kernels are met inside traces on purpose: no notice.
_PRIMING = {"on": False}


@contextlib.contextmanager
def priming() -> Iterator[None]:
    """Within: a kernel first met inside a compiled step is checked and the
    step traced again, as always, without the notice (priming is where such
    builds belong)."""
    was, _PRIMING["on"] = _PRIMING["on"], True
    try:
        yield
    finally:
        _PRIMING["on"] = was


def _step_label(name: Any) -> str:
    return " ".join(str(part) for part in name) if isinstance(name, tuple) else str(name)


# Fresh traces a compiled step makes in a row after kernels' first uses
# inside its trace; past it, those kernels stay on their references in that
# trace (until a later call's first uses trace the step afresh).
MAX_RETRACES = 3


# Rows (batch x tokens) of a prompt call from which each layer bounds the work
# queued behind it; below this a layer's intermediates are small. Decode
# steps (one token per sequence, however many sequences) are not paced.
PACE_MIN_ROWS = 256


def _queues_on_device() -> bool:
    return mx.default_device().type == mx.DeviceType.gpu


def pacing_enabled() -> bool:
    """Prefill pacing applies here: on a GPU, unless MLX_LILY_PACE_PREFILL=0."""
    return _queues_on_device() and not _env_off(PACE_ENV)


def pace_prefill(x: mx.array, out: mx.array) -> None:
    """Keep at most two layers of a prefill call queued on the device.

    Queues this layer's output, then waits for its input, which the layer
    before queued. Why: built as one graph, a whole chunk is queued at once,
    and the device keeps every queued kernel's buffers until it has run it.
    Lily's prefill kernels are fast to enqueue, so on the H200 a 2048-token
    chunk peaked ~3 GiB above stock's that way; layer by layer it peaks below
    stock's. The values are the same either way. Inside a graph
    transformation (compile, vmap, grad, export), where arrays cannot be
    evaluated, nothing is paced. On the CPU the host runs the graph itself and
    nothing piles up (measured: pacing only cost time there), so it is not
    paced either. ``MLX_LILY_PACE_PREFILL=0`` turns it off."""
    if tracing() or not pacing_enabled():
        return
    try:
        mx.async_eval(out)
        mx.eval(x)
    except ValueError as exc:
        if "transformation" not in str(exc):
            raise


def compile_enabled() -> bool:
    """Off by MLX_LILY_COMPILE_DECODE=0, in the CPU emulator (it runs a kernel
    when it is called, which a trace does not allow), and while a graph is
    traced for counting (``traced_not_run``: the compiled steps hold kernels
    built for running)."""
    if _env_off(COMPILE_ENV) or tracing():
        return False
    return kernel_backend()[0] != "emulator"


class LilyDecoderLayer(DecoderLayer):
    def __call__(self, x: mx.array, mask: Optional[mx.array] = None, cache: Any = None) -> mx.array:
        return decode(self, LAYER_TIERS, DecodeCall(x=x, mask=mask, cache=cache))

    def _stock_flow(self, call: DecodeCall) -> mx.array:
        """Stock's layer flow (with lily's mixer and MoE), prefill paced."""
        x = call.x
        out = super().__call__(x, call.mask, call.cache)
        if x.shape[1] > 1 and x.shape[0] * x.shape[1] >= PACE_MIN_ROWS:
            pace_prefill(x, out)
        return out

    # -- which calls the fused path takes --------------------------------------

    def _takes_decode(self, x: mx.array, mask: Any, cache: Any) -> bool:
        if cache is None or x.shape[0] != 1 or x.shape[1] != 1:
            return False
        if not self._lily_fits():
            return False
        if self.is_linear:
            # A left-padded cache (the server's, one row) passes its padding
            # mask, one bool per step; length-limited caches pick their conv
            # rows per row and stay on the unfused path.
            return type(cache) in LILY_ARRAYS_CACHES and cache.lengths is None and cache[1] is not None \
                and (mask is None or _one_step_mask(mask))
        if type(cache) is KVCache:
            return mask is None
        return (type(cache) is BatchKVCache and isinstance(cache.offset, mx.array) and cache.offset.size == 1
                and (mask is None or isinstance(mask, mx.array)))

    def _lily_fits(self) -> bool:
        """Whether the fused steps may run this layer: its parts fit (checked
        once, again when its weights change) and its fused step has not
        failed."""
        ok = self.__dict__.get("_lily_decode_ok")
        if ok is None:
            ok = self._lily_decode_ok = self._layer_fits()
        return ok

    def _layer_fits(self) -> bool:
        """Once per layer: the parts the fused path reads are there."""
        mixer = self.linear_attn if self.is_linear else self.self_attn
        if why_stock(mixer) is not None or why_stock(self.mlp) is not None:
            return False
        mlp = self.mlp
        # The fused step ends in the MoE chain; a dense MLP layer (no
        # num_experts) takes the per-layer path, its MLP on its own GEMVs.
        if not all(hasattr(mlp, n) for n in ("gate", "switch_mlp", "shared_expert", "shared_expert_gate")):
            return False
        if self.is_linear:
            projections = (mixer.in_proj_qkv, mixer.in_proj_z, mixer.in_proj_b, mixer.in_proj_a, mixer.out_proj)
        else:
            projections = (mixer.q_proj, mixer.k_proj, mixer.v_proj, mixer.o_proj)
        return _plain_quantized(*projections, mlp.gate, mlp.shared_expert_gate)

    # -- the fused step ----------------------------------------------------------

    def _decode(self, x: mx.array, mask: Any, cache: Any, touched: list) -> mx.array:
        """The fused step (the recurrent states assigned only at its end; the
        KV cache's write listed in ``touched``, undone if the step fails)."""
        record("Gated DeltaNet" if self.is_linear else "full attention", "lily fused decode", x, mask, cache)
        record("MoE", "lily fused decode", x)
        key, changed = weights_version(self.__dict__, [self])
        if changed:  # a part added, removed or swapped can change whether the fused path fits
            self._lily_decode_ok = self._layer_fits()
        if not self._lily_decode_ok:  # its parts changed: stock's flow from now on
            raise Declined
        key = key if compile_enabled() else None
        if self.is_linear:
            if mask is None:
                step = self._compiled("_lily_linear_step", self._linear_step, key)
                out, cache[0], cache[1] = step(x, cache[0], cache[1])
            else:
                step = self._compiled("_lily_linear_step_masked", self._linear_step, key)
                out, cache[0], cache[1] = step(x, cache[0], cache[1], mask)
            cache.advance(1)
            return out
        # The KV cache's write and the attention read the cache at a length
        # that changes every token, so they run as they are; what comes before
        # and after them has fixed shapes and is compiled.
        sa = self.self_attn
        position = next_position(cache)
        queries, keys, values, gate = self._compiled("_lily_attention_in", self._attention_in, key)(x, position)
        touched.append(kv_position(cache))
        keys, values = cache.update_and_fetch(keys, values)
        out = K.attention(queries, keys, values, sa.scale, mask, gate=gate)
        return self._compiled("_lily_attention_out", self._attention_out, key)(out, x)

    def _compiled(self, name: str, fn: Callable, key: Optional[int]) -> Callable:
        """``mx.compile(fn)`` held per layer and weights' version (``key``,
        see ``compiled_step``); ``fn`` itself where ``key`` is None
        (compilation off)."""
        if key is None:
            return fn
        return compiled_step(self.__dict__, name, key, lambda: fn)

    def _linear_step(self, x: mx.array, conv_state: mx.array, state: mx.array, mask: Optional[mx.array] = None):
        la = self.linear_attn
        qkv, z, b, a = self._linear_in(x)
        B = x.shape[0]
        if conv_state is None:
            conv_state = mx.zeros((B, la.conv_kernel_size - 1, la.conv_dim), dtype=x.dtype)
        # A padding step (mask False) enters the convolution as zeros, shifts
        # a zero row into the conv state and keeps the recurrent state, as
        # stock's layer does on a cache without lengths: in the kernel, not
        # as two selects a layer (60 launches a step, the states read twice).
        y, conv_state, state = K.gated_delta_decode(
            qkv, z, a, b, conv_state, la.conv1d.weight, la.A_log, la.dt_bias, state,
            la.norm.weight, la.norm.eps, la.num_k_heads, mask=mask, padding_shifts_conv=True,
        )
        return self._linear_out(y, x), conv_state, state

    def _linear_in(self, x: mx.array):
        """Norm + the DeltaNet's four input projections in one GEMV -> qkv,
        z [B, 1, Hv * Dv] (flat: ``gated_delta_decode`` takes it so and
        gives y so, with no view node on either side), b, a."""
        la, norm = self.linear_attn, self.input_layernorm
        return K.decode_matvec(
            x, (_triple(la.in_proj_qkv), _triple(la.in_proj_z), _triple(la.in_proj_b), _triple(la.in_proj_a)),
            norm.weight, norm.eps,
        )

    def _linear_out(self, y: mx.array, x: mx.array) -> mx.array:
        """The DeltaNet's output projection + residual, then the MoE chain."""
        la = self.linear_attn
        if y.ndim != 3:
            y = y.reshape(x.shape[0], 1, -1)
        return self._moe_step(_projected_onto(y, la.out_proj, x, la.sharding_group))

    def _sharded_moe_step(self, h: mx.array, logits: mx.array, shared_logit: mx.array) -> mx.array:
        """The MoE chain of a rank's slice (sharded.py): ``moe_decode``
        without the residual gives the rank's partial sum; summed across the
        group, then the residual, as stock."""
        mlp, norm = self.mlp, self.post_attention_layernorm
        record("MoE", SHARDED_MOE_DECODE, h)
        partial = K.moe_decode(h, logits, shared_logit, norm.weight, norm.eps, mlp.top_k, mlp.norm_topk_prob,
                               mlp.switch_mlp, mlp.shared_expert, residual=False)
        return h + all_sum(partial, mlp.sharding_group)

    def _attention_in(self, x: mx.array, position: mx.array):
        """Norm + q/k/v GEMV, q/k norm + RoPE at ``position`` (an array, so a
        compiled step serves every position) -> queries, keys, values, gate."""
        sa, norm = self.self_attn, self.input_layernorm
        q, k, v = K.decode_matvec(
            x, (_triple(sa.q_proj), _triple(sa.k_proj), _triple(sa.v_proj)), norm.weight, norm.eps
        )
        return attention_heads(sa, q, k, v, position)

    def _attention_step(self, x: mx.array, keys_cache: mx.array, values_cache: mx.array, position: mx.array,
                        offsets: Optional[mx.array] = None, starts: Optional[mx.array] = None,
                        length: Optional[mx.array] = None):
        """The whole attention layer on a KV cache of fixed capacity (the
        whole-stack steps in ``text_model.py`` and ``batch_step.py``): the
        new rows written at buffer index ``position`` (an array [1]), the
        attention over indices [0, position], or per row [starts[b], position]
        with a BatchKVCache's left padding; RoPE at ``offsets`` (each row's
        own position, [B]) where given, else at ``position``. ``length``:
        position + 1, where the caller computes it once for every layer
        -> (output, keys_cache, values_cache)."""
        queries, keys, values, gate = self._attention_in(x, position if offsets is None else offsets)
        keys_cache = write_row(keys_cache, keys, position)
        values_cache = write_row(values_cache, values, position)
        span = {} if starts is None else {"start": starts}
        length = position + 1 if length is None else length
        out = K.attention(queries, keys_cache, values_cache, self.self_attn.scale, None, length=length, gate=gate,
                          **span)
        return self._attention_out(out, x), keys_cache, values_cache

    def _attention_out(self, out: mx.array, x: mx.array) -> mx.array:
        """The output projection of the gated attention output (the attention
        op applies the gate where it writes its output, once an element) +
        residual, then the MoE chain."""
        if out.shape[2] != 1:  # with one position [B, H, 1, D] is already [B, 1, H, D]'s order
            out = out.transpose(0, 2, 1, 3)
        out = out.reshape(x.shape[0], 1, -1)
        return self._moe_step(_projected_onto(out, self.self_attn.o_proj, x, group_of(self.self_attn)))

    def _moe_step(self, h: mx.array) -> mx.array:
        mlp, norm = self.mlp, self.post_attention_layernorm
        gates = (_triple(mlp.gate), _triple(mlp.shared_expert_gate))
        routed = None
        if mlp.sharding_group is None and router_launch_fits(h, gates, norm.weight, norm.eps):
            # The router's launch (the router GEMV's bits, route's picks and
            # norm): moe_decode then starts at gate/up.
            logits, shared_logit, xn, inds, scores = K.moe_decode_router(
                h, norm.weight, norm.eps, *gates, mlp.top_k, mlp.norm_topk_prob)
            if K.moe_decode_router.last_path == "kernel":
                routed = (xn, inds, scores)
        else:
            logits, shared_logit = K.decode_matvec(h, gates, norm.weight, norm.eps)
            if mlp.sharding_group is not None:
                return self._sharded_moe_step(h, logits, shared_logit)
        return K.moe_decode(
            h, logits, shared_logit, norm.weight, norm.eps, mlp.top_k, mlp.norm_topk_prob,
            mlp.switch_mlp, mlp.shared_expert, routed=routed,
        )
