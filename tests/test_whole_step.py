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
from mlx_lm.models.cache import KVCache, make_prompt_cache

import mlx_lily
from mlx_lily import paths
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
    tokens took, and the caches."""
    model.language_model.model.__dict__["_lily_whole_ok"] = None if whole else False
    cache = make_prompt_cache(model)
    out = [model(TOKENS[:, :PROMPT], cache=cache)]
    paths.start()
    try:
        out += [model(TOKENS[:, t : t + 1], cache=cache) for t in range(PROMPT, TOKENS.shape[1])]
        seen = {r["path"] for r in paths.seen()}
    finally:
        paths.stop()
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
    want, _, _ = _decode(lily, whole=False)
    assert seen == {WHOLE}
    _close(got, want)
    assert {c.keys.shape[2] for c in _kv(cache)} == {16}
    # Stock's own prefill goes on from the whole step's caches.
    more = lily(TOKENS[:, :5], cache=cache)
    assert {c.offset for c in _kv(cache)} == {TOKENS.shape[1] + 5}
    assert more.shape[1] == 5


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
