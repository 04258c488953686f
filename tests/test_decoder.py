"""The decoder layer's fused decode path (mlx_lily/layers/decoder.py).

On the reference backend every op of the fused path computes stock's op
sequence, so lily's decode must equal stock's to the bit, eager and compiled.
The kernels themselves are held to their references in their own tests (the
CPU emulator) and the model with them to stock's greedy tokens in
test_model.py.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import ArraysCache, BatchKVCache, make_prompt_cache

import mlx_lily
from mlx_lily import kernels as K
from mlx_lily import call_trace
from mlx_lily.layers import LilyDecoderLayer
from mlx_lily.layers import decoder as D
from mlx_lily.toolchain.registry import BACKEND_ENV

def _compiled_per_token(model) -> int:
    """Compiled steps per layer: a DeltaNet layer's step; an attention layer's
    parts before and after its KV-cache write and attention."""
    return sum(1 if layer.is_linear else 2 for layer in model.layers)


TOKENS = mx.array([[17, 301, 45, 499, 2, 77, 212, 8, 64, 123, 400, 5, 6, 7, 300, 31]])
PROMPT = 10


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "reference")


@pytest.fixture
def engines(demo_checkpoint):
    stock, _ = mlx_lily.load(str(demo_checkpoint), backend="mlx")
    lily, _ = mlx_lily.load(str(demo_checkpoint), backend="lily")
    return stock, lily


def _decode(model, steps=range(PROMPT, 16)):
    cache = make_prompt_cache(model)
    out = [model(TOKENS[:, :PROMPT], cache=cache)]
    out += [model(TOKENS[:, t : t + 1], cache=cache) for t in steps]
    return mx.concatenate(out, axis=1)


def _fused_kinds(path="lily fused decode"):
    return {r["layer"] for r in call_trace.seen() if r["path"] == path}


def _segments(model) -> int:
    return 1 + sum(not layer.is_linear for layer in model.layers)


def test_every_layer_is_a_lily_decoder_layer(engines):
    stock, lily = engines
    assert all(type(layer) is LilyDecoderLayer for layer in lily.layers)
    assert not any(isinstance(layer, LilyDecoderLayer) for layer in stock.layers)


@pytest.mark.parametrize("mode", ["segments", "layers", "eager"])
def test_fused_decode_equals_stock_to_the_bit(engines, mode, monkeypatch):
    monkeypatch.setenv(D.COMPILE_ENV, "0" if mode == "eager" else "1")
    compiles = []
    real_compile = mx.compile
    monkeypatch.setattr(mx, "compile", lambda fn: compiles.append(fn) or real_compile(fn))
    stock, lily = engines
    if mode == "layers":  # as after a failed segmented step
        lily.language_model.model.__dict__["_lily_segments_ok"] = False
    call_trace.start()
    try:
        got = _decode(lily)
        kinds = _fused_kinds("lily decode segments" if mode == "segments" else "lily fused decode")
    finally:
        call_trace.stop()
    assert mx.array_equal(got, _decode(stock)).item()
    assert kinds == {"Gated DeltaNet", "full attention", "MoE"}
    # The first decode token compiles the steps (after one eager run for the
    # kernels' first-use checks), once for all tokens and positions: one per
    # segment between attention steps, or per layer.
    want = {"segments": _segments(lily), "layers": _compiled_per_token(lily), "eager": 0}[mode]
    assert len(compiles) == want


def test_a_failing_segmented_step_falls_back_to_layers_once(engines, monkeypatch, capsys):
    stock, lily = engines
    text = lily.language_model.model
    real = type(text)._segment_fn

    def broken(self, first, last, masked=False):
        fn = real(self, first, last, masked)
        if last == len(self.layers):  # the last segment, after every KV write
            def fail(*args):
                raise RuntimeError("segment broke")
            return fail
        return fn

    monkeypatch.setattr(type(text), "_segment_fn", broken)
    got = _decode(lily)
    assert mx.array_equal(got, _decode(stock)).item()  # KV offsets restored, states untouched
    err = capsys.readouterr().err
    assert err.count("compiled decode segments failed") == 1 and "segment broke" in err
    assert text._lily_segments_ok is False


def test_prompts_and_batches_take_the_stock_flow(engines):
    _, lily = engines
    call_trace.start()
    try:
        cache = make_prompt_cache(lily)
        lily(TOKENS[:, :PROMPT], cache=cache)
        assert not _fused_kinds()
        two = mx.concatenate([TOKENS[:, :PROMPT]] * 2)
        cache = make_prompt_cache(lily)
        lily(two, cache=cache)
        lily(two[:, :1], cache=cache)  # a decode step of a batch of two
        assert not _fused_kinds()
    finally:
        call_trace.stop()


def _server_cache(model, ssm_padding: int, kv_padding: int) -> list:
    """The batch caches the server's generator holds for one row: a
    left-padded ArraysCache per DeltaNet layer, a BatchKVCache per attention
    layer (the model builds each call's masks from them)."""
    return [ArraysCache(size=2, left_padding=[ssm_padding]) if layer.is_linear else BatchKVCache([kv_padding])
            for layer in model.layers]


def _decode_from_server_cache(model, ssm_padding, kv_padding):
    cache = _server_cache(model, ssm_padding, kv_padding)
    pad = mx.zeros((1, kv_padding), dtype=TOKENS.dtype)
    out = [model(mx.concatenate([pad, TOKENS[:, :PROMPT]], axis=1), cache=cache)[:, kv_padding:]]
    out += [model(TOKENS[:, t : t + 1], cache=cache) for t in range(PROMPT, 16)]
    return mx.concatenate(out, axis=1), cache


@pytest.mark.parametrize("mode", ["segments", "layers", "eager"])
@pytest.mark.parametrize("padding", [0, 3])
def test_a_server_cache_of_one_row_decodes_fused_and_equals_stock(engines, mode, padding, monkeypatch):
    # mlx_lm.server decodes a single request from batch caches, with masks.
    monkeypatch.setenv(D.COMPILE_ENV, "0" if mode == "eager" else "1")
    stock, lily = engines
    if mode == "layers":  # as after a failed segmented step
        lily.language_model.model.__dict__["_lily_segments_ok"] = False
    path = "lily decode segments" if mode == "segments" else "lily fused decode"
    call_trace.start()
    try:
        got, _ = _decode_from_server_cache(lily, padding, padding)
        kinds = _fused_kinds(path)
        seen = {(r["mask"], r["cache"]) for r in call_trace.seen() if r["path"] == path and r["layer"] != "MoE"}
    finally:
        call_trace.stop()
    assert kinds == {"Gated DeltaNet", "full attention", "MoE"}
    assert {mask for mask, _ in seen} == {"array"}
    assert {cache.split("+")[0] for _, cache in seen} == {"ArraysCache", "BatchKVCache"}
    want, _ = _decode_from_server_cache(stock, padding, padding)
    assert mx.array_equal(got, want).item()


@pytest.mark.parametrize("mode", ["segments", "layers"])
def test_a_masked_decode_step_keeps_the_state_as_stock_does(engines, mode):
    # After the prompt, two decode steps are padding for the DeltaNet layers
    # (their ArraysCaches left-padded by 2 more: mask False). Their recurrent
    # states stay, their conv rows are zeros: every output and cache equals stock's.
    stock, lily = engines
    if mode == "layers":
        lily.language_model.model.__dict__["_lily_segments_ok"] = False
    path = "lily decode segments" if mode == "segments" else "lily fused decode"

    def run(model):
        cache = _server_cache(model, 0, 0)
        out = [model(TOKENS[:, :PROMPT], cache=cache)]
        for c in cache:
            if isinstance(c, ArraysCache):
                c.left_padding = mx.array([2])
        states = [mx.array(c[1]) for c in cache if isinstance(c, ArraysCache)]
        out += [model(TOKENS[:, t : t + 1], cache=cache) for t in range(PROMPT, PROMPT + 2)]
        kept = [c[1] for c in cache if isinstance(c, ArraysCache)]
        out += [model(TOKENS[:, t : t + 1], cache=cache) for t in range(PROMPT + 2, 16)]
        return mx.concatenate(out, axis=1), cache, states, kept

    call_trace.start()
    try:
        got, got_cache, before, kept = run(lily)
        assert "Gated DeltaNet" in _fused_kinds(path)
    finally:
        call_trace.stop()
    assert all(mx.array_equal(b, k).item() for b, k in zip(before, kept))
    assert any(mx.abs(b).max().item() > 0 for b in before)  # a state worth keeping
    want, want_cache, _, _ = run(stock)
    assert mx.array_equal(got, want).item()
    for g, w in zip(got_cache, want_cache):
        if isinstance(g, ArraysCache):
            assert mx.array_equal(g[0], w[0]).item() and mx.array_equal(g[1], w[1]).item()


def test_a_failing_fused_step_falls_back_once(engines, monkeypatch, capsys):
    stock, lily = engines

    def broken(*args, **kwargs):
        raise RuntimeError("no such kernel")

    monkeypatch.setattr(K, "moe_decode", broken)
    got = _decode(lily)
    assert mx.array_equal(got, _decode(stock)).item()
    err = capsys.readouterr().err
    assert err.count("fused decode step failed") == 1 and "no such kernel" in err
    assert all(layer._lily_decode_ok is False for layer in lily.layers)


def test_replaced_weights_are_not_served_from_a_stale_compiled_step(engines):
    stock, lily = engines
    _decode(lily)  # compiles every layer's step
    for model in (stock, lily):
        gate = model.layers[0].mlp.shared_expert_gate
        gate.scales = gate.scales * 3  # a new array: the compiled step must notice
        norm = model.language_model.model.norm  # the last segment's final norm
        norm.weight = norm.weight * 2
    assert mx.array_equal(_decode(lily), _decode(stock)).item()
    for model in (stock, lily):  # a whole module swapped, in a later layer
        layer = model.layers[-2]
        old = layer.input_layernorm
        layer.input_layernorm = nn.RMSNorm(old.weight.shape[0], eps=old.eps)
        layer.input_layernorm.weight = old.weight * 3
    assert mx.array_equal(_decode(lily), _decode(stock)).item()
    for model in (stock, lily):  # the final norm swapped on the text model itself
        text = model.language_model.model
        old = text.norm
        text.norm = nn.RMSNorm(old.weight.shape[0], eps=old.eps)
        text.norm.weight = old.weight * 0.5
    assert mx.array_equal(_decode(lily), _decode(stock)).item()


def test_unquantized_layers_take_the_stock_flow(engines):
    _, lily = engines
    layer = lily.layers[0]
    assert layer._layer_fits()
    gate = layer.mlp.gate
    layer.mlp.gate = mx_nn_linear(gate)
    assert not layer._layer_fits()


def mx_nn_linear(quantized):
    import mlx.nn as nn

    out_dims, in_dims = quantized.scales.shape[0], quantized.scales.shape[1] * quantized.group_size
    return nn.Linear(in_dims, out_dims, bias=False)


def test_counting_a_decode_step_traces_the_ops_not_the_compiled_segments(engines):
    # The compiled steps hold kernels built for running, whose implicit copies
    # mx.export_function cannot serialize: bench/counts.py must trace the ops.
    from bench.counts import decode_step_counts

    _, lily = engines
    cache = make_prompt_cache(lily)
    lily(TOKENS[:, :PROMPT], cache=cache)
    for t in range(PROMPT, PROMPT + 3):  # compiles every step
        lily(TOKENS[:, t : t + 1], cache=cache)
    held = lily.language_model.model.__dict__.get("_lily_segments", {})
    assert len(held) == _segments(lily)

    def refuse(*args):
        raise AssertionError("a compiled step ran inside the trace")

    for s, (key, _) in list(held.items()):
        held[s] = (key, refuse)
    counts = decode_step_counts(lily, cache, token=3)
    assert counts["kernels_per_decode_token"] > 0


def test_paced_prefill_computes_what_the_whole_graph_does(engines, monkeypatch):
    """Pacing (each layer queues its output and waits for its input) changes
    when work runs, never what it computes; inside mx.compile it stands aside."""
    stock, lily = engines
    tokens = mx.tile(TOKENS, (1, 20))  # 320 rows: above PACE_MIN_ROWS
    assert tokens.size >= D.PACE_MIN_ROWS

    def prefill(model):
        out = model(tokens, cache=make_prompt_cache(model))
        mx.eval(out)
        return out

    whole = prefill(lily)
    queued = []
    real_async_eval = mx.async_eval
    monkeypatch.setattr(D, "_queues_on_device", lambda: True)

    def async_eval(*arrays):
        real_async_eval(*arrays)  # raises inside a graph transformation
        queued.append(1)

    monkeypatch.setattr(mx, "async_eval", async_eval)
    paced = prefill(lily)
    assert len(queued) == len(lily.layers)
    assert mx.array_equal(paced, whole)
    assert mx.array_equal(paced, prefill(stock))
    queued.clear()
    compiled = mx.compile(lambda t: lily(t, cache=None))(tokens)
    assert not queued
    assert mx.array_equal(compiled, whole)
    monkeypatch.setenv(D.PACE_ENV, "0")
    assert mx.array_equal(prefill(lily), whole)
    assert not queued


def test_an_added_or_removed_part_changes_what_takes_the_fused_path(engines):
    """A bias added to a projection the fused GEMV reads (which it does not
    take) sends that layer through stock's flow, and removing it again brings
    the fused path back; each time the output is stock's."""
    stock, lily = engines
    _decode(lily)  # compiles the segments, every layer fits
    bias = mx.ones((lily.layers[0].mlp.shared_expert_gate.scales.shape[0],), dtype=mx.bfloat16)
    for model in (stock, lily):
        model.layers[0].mlp.shared_expert_gate["bias"] = bias
    assert mx.array_equal(_decode(lily), _decode(stock)).item()
    assert lily.layers[0]._lily_decode_ok is False and lily.layers[1]._lily_decode_ok is True
    for model in (stock, lily):
        del model.layers[0].mlp.shared_expert_gate["bias"]
    call_trace.start()
    try:
        assert mx.array_equal(_decode(lily), _decode(stock)).item()
        assert "lily decode segments" in {r["path"] for r in call_trace.seen()}
    finally:
        call_trace.stop()
    assert lily.layers[0]._lily_decode_ok is True


def test_the_weights_check_says_changed_when_a_place_is_gone():
    from mlx_lily.layers.decoder import _held, _places, _same, weights_version

    root = nn.Sequential(nn.Linear(4, 4), nn.RMSNorm(4))
    places = _places(root)
    held = _held(places)
    store = {}
    assert weights_version(store, [root]) == (0, True)
    assert _same(places, held) and weights_version(store, [root]) == (0, False)
    del root.layers[1]["weight"]
    assert not _same(places, held) and weights_version(store, [root]) == (1, True)
    root.layers[0]["extra"] = mx.zeros((1,))  # an added entry changes the counts
    assert not _same(_places(root), held)


@pytest.mark.parametrize("traces_with_first_uses, traces", [(1, 2), (10, 1 + D.MAX_RETRACES)])
def test_a_compiled_step_traces_again_after_a_first_use_inside_its_trace(monkeypatch, traces_with_first_uses, traces):
    """A kernel first met inside a trace runs its reference there (see
    toolchain/kernel.py); the step then runs eagerly once more, for the checks,
    and traces afresh, up to MAX_RETRACES times."""
    from mlx_lily.toolchain import tracing

    calls = []

    def fn(x):
        calls.append("eager" if isinstance(x, mx.array) and not _tracing(x) else "trace")
        if calls[-1] == "trace" and calls.count("trace") <= traces_with_first_uses:
            tracing.count_first_use_in_trace()  # as a first use inside this trace does
        return x * 2

    store = {}
    x = mx.arange(4, dtype=mx.float32)
    for _ in range(6):
        step = D.compiled_step(store, "step", 0, lambda: fn)
        assert mx.array_equal(step(x), x * 2).item()
    assert calls.count("trace") == traces
    # The first call's eager run, then one more after each trace that met a first use.
    assert calls.count("eager") == 1 + min(traces_with_first_uses, D.MAX_RETRACES)


def test_a_call_whose_trace_met_a_first_use_is_answered_by_the_kernels(monkeypatch):
    """The reference answers inside a trace that meets a kernel's first use;
    that call must still get the kernels' bits (a server row meeting a new
    batch size must get what it gets alone), and a step meeting new shapes
    all its life (batch sizes 1..16) keeps its kernels in every trace, not
    only in its first MAX_RETRACES."""
    from mlx_lily.toolchain import tracing

    checked = set()

    def fn(x):
        if _tracing(x):
            if x.shape not in checked:  # this shape's first use, inside a trace: the reference
                tracing.count_first_use_in_trace()
                return x * 3
            return x * 2
        checked.add(x.shape)  # eager: the kernel's check, then the kernel
        return x * 2

    store = {}
    for n in range(1, 3 + 2 * D.MAX_RETRACES):
        x = mx.arange(n, dtype=mx.float32)
        for _ in range(2):
            step = D.compiled_step(store, "step", 0, lambda: fn)
            assert mx.array_equal(step(x), x * 2).item(), n


def test_a_first_use_inside_a_trace_is_named_once(monkeypatch, fresh_notices, capsys):
    """The notice says which kernel instance a compiled step met inside its
    trace (a build in the middle of decoding), once per instance."""
    from mlx_lily.toolchain import tracing

    def fn(x):
        if _tracing(x) and x.shape == (3,):
            tracing.count_first_use_in_trace("moe_decode_route (T=bfloat16, K=8; inputs bfloat16)")
        return x + 1

    store = {}
    for n in (2, 3, 3, 4, 3):
        step = D.compiled_step(store, ("batch", True), 0, lambda: fn)
        step(mx.zeros((n,)))
    said = capsys.readouterr().err
    assert said.count("kernel moe_decode_route (T=bfloat16, K=8; inputs bfloat16) first met inside a compiled "
                      "step (batch True)") == 1


def test_priming_meets_kernels_inside_traces_without_the_notice(fresh_notices, capsys):
    """Under warmup's priming the step still checks and traces again, but a
    first use inside a trace is expected there: no notice."""
    from mlx_lily.toolchain import tracing

    traces = []

    def fn(x):
        if _tracing(x):
            traces.append(x.shape)
            if x.shape == (3,) and traces.count((3,)) == 1:
                tracing.count_first_use_in_trace("moe_decode_route (T=bfloat16, K=8; inputs bfloat16)")
        return x + 1

    store = {}
    with D.priming():
        for n in (2, 3):
            D.compiled_step(store, ("batch", True), 0, lambda: fn)(mx.zeros((n,)))
    assert traces.count((3,)) == 2  # traced again after the first use
    assert "first met inside" not in capsys.readouterr().err
    D.compiled_step(store, ("batch", True), 0, lambda: fn)(mx.zeros((3,)))
    assert not D._PRIMING["on"]


def _tracing(x: mx.array) -> bool:
    """Whether ``x`` is a tracer of mx.compile (it cannot be evaluated)."""
    try:
        mx.eval(x)
        return False
    except ValueError:
        return True


def test_the_weights_check_sees_every_way_a_module_entry_changes():
    """weights_version compares entries again only when an nn.Module entry
    was set or removed somewhere: each of mlx's ways of changing a weight or
    a submodule moves the version; reading and plain attributes do not."""
    from mlx_lily.layers.decoder import _MODULE_CHANGES, weights_version

    root = nn.Module()
    root.proj, root.norm = nn.Linear(32, 32), nn.RMSNorm(32)
    store = {}
    version, _ = weights_version(store, [root])
    changes = [
        lambda: setattr(root.proj, "weight", mx.ones((32, 32))),
        lambda: root.proj.update({"bias": mx.ones((32,))}),
        lambda: root.load_weights([("norm.weight", mx.ones((32,)))], strict=False),
        lambda: root.norm.pop("weight"),
        lambda: root.norm.setdefault("weight", mx.ones((32,))),
        lambda: root.update_modules({"proj": nn.Linear(32, 32)}),
        lambda: delattr(root.proj, "bias"),
        lambda: nn.quantize(root, group_size=32, bits=4, class_predicate=lambda _, m: isinstance(m, nn.Linear)),
    ]
    for change in changes:
        change()
        new, changed = weights_version(store, [root])
        assert changed and new == version + 1
        version = new
    before = _MODULE_CHANGES[0]
    root.proj.training_note = "not an entry"  # a plain attribute: mlx pops its name, no entry goes
    _ = root.proj.weight, root.parameters()
    root.norm.pop("missing", None)
    assert _MODULE_CHANGES[0] == before and weights_version(store, [root]) == (version, False)


def test_a_decode_step_changes_no_module_entry(demo_checkpoint):
    """In steady decoding the weights check is one comparison: neither the
    one-stream step nor the server's batched step sets or removes an entry of
    any module."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lily.layers.decoder import _MODULE_CHANGES

    model, _ = mlx_lily.load(str(demo_checkpoint))
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1, 2, 3, 4]]), cache=cache))
    mx.eval(model(mx.array([[5]]), cache=cache))
    before = _MODULE_CHANGES[0]
    for token in (6, 7, 8):
        mx.eval(model(mx.array([[token]]), cache=cache))
    assert _MODULE_CHANGES[0] == before
