"""Prefill's peak memory on the GPU: lily's no higher than stock's.

Queued as one graph, a chunk of lily's fast prefill kernels held every queued
kernel's buffers at once (on the H200, ~3 GiB above stock's peak for a
2048-token chunk of the real model); lily's layers now pace the queue
(``pace_prefill`` in mlx_lily/layers/decoder.py). Real widths, 8 of the 40
layers (two full-attention layers), one 2048-token chunk and its cache state.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from bench.common import prompt_ids
from bench.engines import switch
from mlx_lily.random_checkpoints import SHAPES, build_model
from mlx_lily.layers import decoder

pytestmark = pytest.mark.gpu

TOKENS = 2048


def _peak_above_start(model, tokens) -> int:
    def prefill():
        cache = make_prompt_cache(model)
        model(tokens, cache=cache)
        mx.eval([c.state for c in cache])

    prefill()  # first use: kernels' checks and compilation are not measured
    mx.synchronize()
    mx.clear_cache()
    start = mx.get_active_memory()
    mx.reset_peak_memory()
    prefill()
    mx.synchronize()
    return mx.get_peak_memory() - start


def test_paced_prefill_peaks_no_higher_than_stock(backend, monkeypatch):
    monkeypatch.delenv(decoder.PACE_ENV, raising=False)
    model, config = build_model(dict(SHAPES["qwen3.6-35b-a3b"], num_hidden_layers=8))
    tokens = mx.array(prompt_ids(TOKENS, config["text_config"]["vocab_size"]))[None]
    peaks = {}
    for engine in ("stock", "lily"):
        switch(model, engine)
        peaks[engine] = _peak_above_start(model, tokens)
    monkeypatch.setattr(decoder, "PACE_MIN_ROWS", 1 << 30)
    peaks["lily, not paced"] = _peak_above_start(model, tokens)
    mib = {k: round(v / 2**20) for k, v in peaks.items()}
    assert peaks["lily"] <= peaks["stock"], f"peak MiB above the weights: {mib}"
    assert peaks["lily"] <= peaks["lily, not paced"], f"pacing raised the peak: {mib}"
