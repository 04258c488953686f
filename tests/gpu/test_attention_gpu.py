"""The attention kernels on the GPU at the model's shapes, against float64.

Run with ``python3 -m pytest tests/gpu -m gpu -q``; without a GPU every test
skips. Shapes: 16 query / 2 KV heads of dim 256, a bf16 KV cache read as the
strided view mlx-lm's KVCache hands over. Tolerance: one bf16 step of the
exact result (the kernels round once, from fp32), as in the emulator tests.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import pytest

import mlx_lily.kernels  # noqa: F401

A = sys.modules["mlx_lily.kernels.attention.sdpa"]

pytestmark = pytest.mark.gpu

HQ, HKV, D = 16, 2, 256
CACHE_STEP = 256


def cache_view(S, L=1, seed=0):
    keys = mx.random.split(mx.random.key(seed), 3)
    rows = (S // CACHE_STEP + 1) * CACHE_STEP
    q = mx.random.normal((1, HQ, L, D), key=keys[0]).astype(mx.bfloat16)
    k = (2 * mx.random.normal((1, HKV, rows, D), key=keys[1])).astype(mx.bfloat16)[:, :, :S, :]
    v = mx.random.normal((1, HKV, rows, D), key=keys[2]).astype(mx.bfloat16)[:, :, :S, :]
    return q, k, v, D**-0.5


def exact(q, k, v, scale, mask=None) -> np.ndarray:
    """float64 attention of the bf16 values, one KV head's query group at a time."""
    q, k, v = (np.array(a.astype(mx.float32)).astype(np.float64) for a in (q, k, v))
    B, Hq, L, _ = q.shape
    S, G = k.shape[2], Hq // k.shape[1]
    out = np.empty(q.shape)
    for h in range(k.shape[1]):
        qs = q[0, h * G:(h + 1) * G].reshape(G * L, -1)
        s = (qs @ k[0, h].T * scale).reshape(G, L, S)
        if mask == "causal":
            visible = np.arange(S)[None, :] <= np.arange(L)[:, None] + (S - L)
            s = np.where(visible[None], s, -np.inf)
        p = np.exp(s - s.max(axis=-1, keepdims=True))
        p /= p.sum(axis=-1, keepdims=True)
        out[0, h * G:(h + 1) * G] = p @ v[0, h]
    return out


def assert_within_one_bf16_step(got, want):
    got = np.array(got.astype(mx.float32)).astype(np.float64)
    step = np.maximum(np.abs(want), 1e-2 * np.abs(want).max()) * 2.0**-7
    bad = np.abs(got - want) > step
    assert not bad.any(), f"{int(bad.sum())} of {bad.size}; max error {np.abs(got - want).max()}"


@pytest.mark.parametrize("S", [1, 255, 4096, A.SPLIT_FROM - 1, A.SPLIT_FROM, 131072 + 77])
def test_decode_at_real_shapes(backend, S):
    q, k, v, scale = cache_view(S, seed=S)
    fn, path, why = A.attention.choose(q, k, v, scale, None)
    assert path == "kernel", why
    got = A.attention(q, k, v, scale, None)
    assert A.attention.last_path == "kernel"
    assert_within_one_bf16_step(got, exact(q, k, v, scale))


@pytest.mark.parametrize("S, options", [
    (4096, dict(split_from=1)),                   # split well below the threshold
    (4096 + 3, dict(split_from=1, key_block=1000)),  # a block not a multiple of a pass
    (40000, dict(split_from=1 << 40)),           # single pass above it
])
def test_decode_both_paths_at_any_context(backend, S, options):
    q, k, v, scale = cache_view(S, seed=S + 1)
    got = A.run_decode(backend, q, k, v, scale, None, **options)
    assert_within_one_bf16_step(got, exact(q, k, v, scale))


def assert_prefill_close(got, want, v):
    # As in the emulator tests: one bf16 step plus P's bf16 rounding (2^-8 max|v|).
    got = np.array(got.astype(mx.float32)).astype(np.float64)
    step = np.maximum(np.abs(want), 1e-2 * np.abs(want).max()) * 2.0**-7
    slack = 2.0**-8 * np.abs(np.array(v.astype(mx.float32))).max()
    bad = np.abs(got - want) > step + slack
    assert not bad.any(), f"{int(bad.sum())} of {bad.size}; max error {np.abs(got - want).max()}"


@pytest.mark.parametrize("L, S", [(2048, 2048), (2048, 8192 + 5), (37, 4096), (512, 32768)])
def test_prefill_at_real_shapes(backend, L, S):
    # The kernel itself: on CUDA the op sends calls this large to MLX's fused
    # sdpa (CUDA_PREFILL_REFERENCE_FROM), which is faster there.
    q, k, v, scale = cache_view(S, L=L, seed=L + S)
    assert A.attention_kernels.path_for(backend, q, k, v, scale, "causal") == "prefill"
    A.attention_kernels.ready_on(backend)
    got = A.attention_kernels.run_on(backend, q, k, v, scale, "causal")
    assert_prefill_close(got, exact(q, k, v, scale, "causal"), v)


def test_a_bounded_decode_over_a_cache_of_fixed_capacity(backend):
    # The whole decode step's form: the grid follows the capacity (here a
    # split into many blocks), the keys stop at the length on the device.
    q, k, v, scale = cache_view(8192)
    for length in (1, 4097, 8192):
        bound = mx.array([length], dtype=mx.int32)
        got = A.run_decode(backend, q, k, v, scale, None, bound)
        assert_within_one_bf16_step(got, exact(q, k[:, :, :length], v[:, :, :length], scale))


def test_the_whole_decode_step_decodes_as_the_segments_do(backend, demo_conditioned_checkpoint, fresh_notices, capsys):
    """Compiled on the GPU: the whole stack in one call (KV rows scattered in
    at an array position, the attention bounded by it) against the compiled
    segments, over a capacity step. The demo shape's experts are 128 wide: at
    64 (one quantization group per row), MLX's CUDA quantized matmul in the
    shared expert alone made two runs of the same prompt differ."""
    from mlx_lm.models.cache import make_prompt_cache

    import mlx_lily
    from mlx_lily import call_trace
    from mlx_lily.layers import text_model as T
    from mlx_lily.toolchain.tracing import first_uses_in_traces

    model, _ = mlx_lily.load(str(demo_conditioned_checkpoint), backend="lily")
    unchecked = first_uses_in_traces()
    tokens = mx.array([[(i * 2654435761) % 2**32 % 500 for i in range(T.CAPACITY_STEP + 40)]])
    prompt = T.CAPACITY_STEP - 8

    def decode(whole):
        model.language_model.model.__dict__["_lily_whole_ok"] = None if whole else False
        cache = make_prompt_cache(model)
        out = [model(tokens[:, :prompt], cache=cache)[:, -1:]]
        call_trace.start()
        out += [model(tokens[:, t : t + 1], cache=cache) for t in range(prompt, tokens.shape[1])]
        seen = {r["path"] for r in call_trace.seen()}
        call_trace.stop()
        return mx.concatenate(out, axis=1).astype(mx.float32), seen

    got, seen = decode(True)
    want, seen_segments = decode(False)
    assert seen == {"lily whole decode step"} and seen_segments == {"lily decode segments"}
    assert "kernel off" not in capsys.readouterr().err
    assert first_uses_in_traces() == unchecked  # every kernel checked outside the traces
    assert mx.array_equal(got.argmax(-1), want.argmax(-1)).item()
    assert mx.abs(got - want).max().item() <= 2**-6 * mx.abs(want).max().item()
