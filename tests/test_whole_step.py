"""The whole-stack decode step (mlx_lily/layers/text_model.py).

With the attention's decode kernels on, one token of ``mlx_lm.generate``'s
caches is one compiled call: the KV caches are held at a fixed capacity, each
new row scattered in at a position the graph takes as input, and the decode
attention bounded by that position. The CPU emulator cannot run kernels inside
``mx.compile``'s trace, so here the step runs eagerly (``mx.compile`` stood
in for by the function itself): the same ops in the same order, against the
segmented path (the previous reference for this path, which stays stock's on
the reference backend) under the same stand-in.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

import mlx_lily
from mlx_lily import call_trace
from mlx_lily.layers import text_model as T

TOKENS = mx.array([[17, 301, 45, 499, 2, 77, 212, 8, 64, 123, 400, 5, 6, 7, 300, 31]])
PROMPT = 10
WHOLE, SEGMENTS = "lily whole decode step", "lily decode segments"


@pytest.fixture
def lily(demo_checkpoint, emulator_backend, monkeypatch):
    """Lily's demo model, its decode steps run eagerly in the emulator."""
    monkeypatch.setattr(T, "compile_enabled", lambda: True)
    monkeypatch.setattr(mx, "compile", lambda fn: fn)
    model, _ = mlx_lily.load(str(demo_checkpoint), backend="lily")
    return model


def _decode(model, whole: bool = True):
    """Logits of the prompt and each decode token, the paths the decode
    tokens took, and the caches. The first decode token comes as int32 and
    the others as uint32, as from mlx_lm.generate (its prompt, its sampler)."""
    model.language_model.model.__dict__["_lily_whole_ok"] = None if whole else False
    cache = make_prompt_cache(model)
    out = [model(TOKENS[:, :PROMPT], cache=cache)]
    call_trace.start()
    try:
        for t in range(PROMPT, TOKENS.shape[1]):
            token = TOKENS[:, t : t + 1]
            out.append(model(token if t == PROMPT else token.astype(mx.uint32), cache=cache))
        seen = {r["path"] for r in call_trace.seen()}
    finally:
        call_trace.stop()
    return mx.concatenate(out, axis=1), seen, cache


def _close(got: mx.array, want: mx.array) -> None:
    """The same greedy tokens, and logits within a few bf16 steps (the bounded
    attention splits the keys by the cache's capacity, not its length)."""
    assert mx.array_equal(got.argmax(-1), want.argmax(-1)).item()
    scale = mx.abs(want).max().item()
    assert mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item() <= 2**-6 * scale


def _kv(cache) -> list:
    return [c for c in cache if type(c) is KVCache]


def test_the_whole_step_decodes_as_the_segments_do(lily):
    got, seen, cache = _decode(lily)
    want, seen_segments, want_cache = _decode(lily, whole=False)
    assert seen == {WHOLE} and seen_segments == {SEGMENTS}
    _close(got, want)
    for g, w in zip(_kv(cache), _kv(want_cache)):
        # The same offset and rows; the capacity a whole number of steps.
        assert g.offset == w.offset == TOKENS.shape[1]
        assert g.keys.shape[2] % T.CAPACITY_STEP == 0
        (gk, gv), (wk, wv) = g.keys_and_values(), w.keys_and_values()
        assert mx.array_equal(gk, wk).item() and mx.array_equal(gv, wv).item()
    for g, w in zip(cache, want_cache):
        if type(g) is not KVCache:  # the DeltaNet states the step returned
            assert mx.allclose(g[1], w[1], atol=1e-3).item()


def test_the_caches_grow_between_tokens_and_stay_stock_caches(lily, monkeypatch):
    # A capacity step of 4 rows (stock's KVCache grows 4 at a time here too):
    # the prompt leaves 12 rows, and the decode grows them at position 12.
    monkeypatch.setattr(KVCache, "step", 4)
    monkeypatch.setattr(T, "CAPACITY_STEP", 4)
    got, seen, cache = _decode(lily)
    want, _, want_cache = _decode(lily, whole=False)
    assert seen == {WHOLE}
    _close(got, want)
    assert {c.keys.shape[2] for c in _kv(cache)} == {16}
    # Stock's own prefill goes on from the whole step's caches as from the segments'.
    more, more_wanted = lily(TOKENS[:, :5], cache=cache), lily(TOKENS[:, :5], cache=want_cache)
    assert {c.offset for c in _kv(cache)} == {TOKENS.shape[1] + 5}
    _close(more, more_wanted)


def test_reserve_rows_keeps_the_filled_rows_and_zeros_the_rest():
    cache = KVCache()
    keys = mx.arange(2 * 3 * 4, dtype=mx.float32).reshape(1, 2, 3, 4).astype(mx.bfloat16)
    cache.update_and_fetch(keys, keys + 1)
    assert cache.keys.shape[2] == KVCache.step and cache.offset == 3
    T.reserve_rows(cache, 4)
    assert cache.keys.shape[2] == T.CAPACITY_STEP
    assert mx.array_equal(cache.keys[:, :, :3], keys).item()
    assert mx.array_equal(cache.values[:, :, :3], keys + 1).item()
    assert not mx.any(cache.keys[:, :, 3:]).item()
    held = cache.keys
    T.reserve_rows(cache, T.CAPACITY_STEP)  # room enough: the same arrays
    assert cache.keys is held
    T.reserve_rows(cache, T.CAPACITY_STEP + 1)
    assert cache.keys.shape[2] == 2 * T.CAPACITY_STEP and cache.offset == 3


def test_reserve_rows_cuts_a_partial_capacity_back_to_the_rows_whole_capacity(monkeypatch):
    # A reused prefix (a checkpoint's position, not on stock's 256-row grid)
    # plus the rest of the prompt leaves the buffer at position + k * 256
    # rows: it takes the whole capacity of its rows, as a cold prompt's does,
    # not the one above its partial capacity.
    monkeypatch.setattr(T, "CAPACITY_STEP", 512)
    cache = KVCache()
    keys = mx.random.normal((1, 2, 288, 4)).astype(mx.bfloat16)
    cache.state = (keys, keys + 1, 288)
    more = mx.random.normal((1, 2, 11, 4)).astype(mx.bfloat16)
    cache.update_and_fetch(more, more + 1)
    assert cache.keys.shape[2] == 288 + KVCache.step and cache.offset == 299
    T.reserve_rows(cache, 300)
    assert cache.keys.shape[2] == 512 == T.held_capacity(544, 300)
    assert mx.array_equal(cache.keys[:, :, :288], keys).item()
    assert mx.array_equal(cache.values[:, :, 288:299], more + 1).item()
    assert not mx.any(cache.keys[:, :, 299:]).item()
    assert T.held_capacity(1024, 300) == 1024 and T.held_capacity(512, 513) == 1024


def test_the_whole_step_needs_the_attention_kernels(lily, monkeypatch):
    # On the reference backend (and where the decode kernels failed their
    # self-check) the step stays in segments, stock's op sequence.
    monkeypatch.setenv("MLX_LILY_KERNEL_BACKEND", "reference")
    _, seen, _ = _decode(lily)
    assert seen == {SEGMENTS}
    monkeypatch.setenv("MLX_LILY_KERNEL_BACKEND", "emulator")
    monkeypatch.setattr(T.attention_kernels, "decode_on", lambda backend: False)
    _, seen, _ = _decode(lily)
    assert seen == {SEGMENTS}


def test_a_failing_whole_step_falls_back_to_segments_once(lily, monkeypatch, fresh_notices, capsys):
    want, _, _ = _decode(lily, whole=False)
    real = T.LilyTextModel._whole_fn

    def broken(self):
        step = real(self)

        def fail(*args):
            step(*args)
            raise RuntimeError("whole step broke")

        return fail

    monkeypatch.setattr(T.LilyTextModel, "_whole_fn", broken)
    text = lily.language_model.model
    text.__dict__.pop("_lily_segments", None)
    got, seen, cache = _decode(lily)
    assert seen == {WHOLE, SEGMENTS}
    # Nothing of the failed step was kept: the tokens are the segments'.
    assert mx.array_equal(got, want).item()
    err = capsys.readouterr().err
    assert err.count("whole decode step failed") == 1 and "whole step broke" in err
    assert text._lily_whole_ok is False


@pytest.mark.parametrize("change, why", [
    (lambda cache, kv: setattr(kv[0], "offset", kv[0].offset - 1), "offsets differ between layers"),
    (lambda cache, kv: [setattr(c, "keys", None) for c in kv], "no keys yet"),
    (lambda cache, kv: [setattr(c, "keys", c.keys.astype(mx.float32)) for c in kv], "float32 keys"),
    (lambda cache, kv: cache.__setitem__(cache.index(kv[0]), RotatingKVCache(max_size=64)), "a rotating cache"),
    (lambda cache, kv: cache.__setitem__(cache.index(kv[0]), kv[0].to_quantized(group_size=32)), "a quantized cache"),
])
def test_the_whole_step_declines_what_it_does_not_take(emulator_backend, change, why):
    from mlx_lily.random_checkpoints import SHAPES, build_model
    from mlx_lily.models.qwen3_5_moe import Model

    # Eight layers: two attention layers, whose offsets can differ.
    lily, _ = build_model(dict(SHAPES["demo"], num_hidden_layers=8), seed=0, model_class=Model)
    text = lily.language_model.model
    cache = make_prompt_cache(lily)
    lily(TOKENS[:, :PROMPT], cache=cache)
    assert len(_kv(cache)) == 2
    assert text._whole_takes(cache, None, None)
    assert not text._whole_takes(cache, mx.array([[True]]), None)  # a mask: the server's caches
    kv = _kv(cache)
    change(cache, kv)
    assert not text._whole_takes(cache, None, None), why


@pytest.fixture
def compiled_reference(demo_checkpoint, monkeypatch):
    """Lily's demo model on the reference backend with the whole step let in
    (its ops run their references) and MLX's real mx.compile."""
    monkeypatch.setenv("MLX_LILY_KERNEL_BACKEND", "reference")
    monkeypatch.setattr(T, "kernel_backend", lambda: ("cuda", "as on a GPU"))
    monkeypatch.setattr(T.attention_kernels, "decode_on", lambda backend: True)
    model, _ = mlx_lily.load(str(demo_checkpoint), backend="lily")
    return model


def test_compiled_the_whole_step_traces_once_per_capacity(compiled_reference, monkeypatch):
    lily = compiled_reference
    monkeypatch.setattr(KVCache, "step", 4)
    monkeypatch.setattr(T, "CAPACITY_STEP", 4)
    runs = []
    real = T.LilyTextModel._whole_fn

    def counted(self):
        step = real(self)
        return lambda *args: runs.append(args[-2].shape[2]) or step(*args)

    monkeypatch.setattr(T.LilyTextModel, "_whole_fn", counted)
    got, seen, _ = _decode(lily)
    want, _, _ = _decode(lily, whole=False)
    assert seen == {WHOLE}
    _close(got, want)
    # The eager first run, then one trace per capacity (12 rows, then 16 from
    # position 12): neither the tokens' dtypes nor their positions trace anew.
    assert runs == [12, 12, 16]


def test_compiled_the_whole_step_leaves_arrays_held_elsewhere_as_they_were(compiled_reference):
    lily = compiled_reference
    cache = make_prompt_cache(lily)
    lily(TOKENS[:, :PROMPT], cache=cache)
    lily(TOKENS[:, PROMPT : PROMPT + 1], cache=cache)
    held = [(c.keys, mx.array(c.keys)) for c in _kv(cache)]  # the cache's array and a copy
    for t in range(PROMPT + 1, PROMPT + 4):
        mx.eval(lily(TOKENS[:, t : t + 1], cache=cache))
    for (kept, copy), c in zip(held, _kv(cache)):
        assert mx.array_equal(kept, copy).item()  # written out of place: someone held it
        assert not mx.array_equal(c.keys, kept).item()  # the cache's own rows did change


def test_the_whole_step_puts_no_view_between_a_deltanet_layer_s_kernels(emulator_backend):
    """The graph MLX compiles for a decode token, kernels as on CUDA (each
    launch one node here): a Gated DeltaNet layer is its six launches alone
    (z and y stay flat, [B, 1, Hv * Dv]), and an attention layer moves no
    element to transpose (one position: [B, 1, H, D] read as [B, H, 1, D]).
    Every view is host work at every token: built by the compiled step's
    replay and evaluated by MLX."""
    from collections import Counter

    from bench.counts import trace
    from bench.diagnostics.decode.host_cost import stubbed_kernels
    from mlx_lily.models.qwen3_5_moe import Model
    from mlx_lily.random_checkpoints import SHAPES, build_model
    from mlx_lily.toolchain import kernel

    def views(layers: int) -> Counter:
        model, _ = build_model(dict(SHAPES["demo"], num_hidden_layers=layers), seed=0, model_class=Model)
        mx.eval(model.parameters())
        text = model.language_model.model
        launches = []
        with stubbed_kernels():
            def build(self, backend, absent=()):
                def launch(inputs, template, grid, threadgroup, output_shapes, output_dtypes, **kw):
                    launches.append(self.name)  # one Depends node a launch, as one kernel node
                    return mx.depends([mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)], list(inputs))
                return launch
            held, kernel.Kernel._build = kernel.Kernel._build, build
            try:
                cache = make_prompt_cache(model)
                mx.eval(model(mx.array([list(range(1, 9))]), cache=cache), [c.state for c in cache])
                for i in text._cuts():
                    T.reserve_rows(cache[i], cache[text.fa_idx].offset + 1)
                args = [mx.array([[1]], dtype=mx.int32)]
                for layer, c in zip(text.layers, cache):
                    args += [c[0], c[1]] if layer.is_linear else [c.keys, c.values]
                args.append(mx.array([cache[text.fa_idx].offset], dtype=mx.int32))
                mx.eval(args)
                launches.clear()
                nodes = trace(text._whole_fn(), *args)
            finally:
                kernel.Kernel._build = held
        counted = Counter(n["name"] for n in nodes)
        assert counted["Depends"] == len(launches)
        return counted

    # The demo stack puts attention at every fourth layer: four more layers
    # are three DeltaNet layers and one attention layer.
    more = views(8) - views(4)
    assert more["Depends"] == 3 * 6 + 8, more  # their launches
    assert more["Transpose"] == 0, more
    # All of them the attention layer's: q into heads and its gate split off,
    # k and v into heads, the queries as the kernel's rows, its output as q's
    # shape and as the projection's row. (The DeltaNet layers add none.)
    assert more["Reshape"] + more["Split"] == 7, more
