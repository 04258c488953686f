"""Lily's model against stock mlx-lm on the same checkpoint.

With lily's ops on their references, lily must reproduce stock to the bit
(these tests pin the reference backend and assert equality). With kernels
(run here in the CPU emulator), logits must agree within LOGIT_ATOL and
greedy tokens exactly, and two runs of lily must be identical to the bit.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache, make_prompt_cache

import mlx_lily
from mlx_lily import kernels as K
from mlx_lily.toolchain.registry import BACKEND_ENV, LilyOp
from mlx_lily.layers import LilyAttention, LilyGatedDeltaNet, LilySparseMoeBlock

# bf16 logits of a random model are O(1..10); kernels may differ by rounding.
LOGIT_ATOL = 5e-2

# Ids within the random checkpoints' 512-token vocabulary.
TOKENS = mx.array([[17, 301, 45, 499, 2, 77, 212, 8, 64, 123, 400, 5, 6, 7, 300, 31]])


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "reference")


@pytest.fixture(params=["demo", "alt"])
def engines(request, demo_checkpoint, alt_checkpoint):
    path = str(demo_checkpoint if request.param == "demo" else alt_checkpoint)
    stock, _ = mlx_lily.load(path, backend="mlx")
    lily, _ = mlx_lily.load(path, backend="lily")
    return stock, lily


@pytest.fixture
def op_calls(monkeypatch):
    """Count the calls each lily op receives, on either path (to prove lily's path ran)."""
    # gated_delta_decode, moe_decode and quantized_matvec serve single-token steps only (a
    # prompt never calls them; their own tests hold the model's decode to them).
    decode_only = ("gated_delta_decode", "moe_decode", "quantized_matvec")
    calls = {name: 0 for name, op in K.OPS.items() if op.in_model and name not in decode_only}
    original = LilyOp.__call__

    def counted(self, *args, **kwargs):
        calls[self.name] = calls.get(self.name, 0) + 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LilyOp, "__call__", counted)
    return calls


def close(a: mx.array, b: mx.array) -> float:
    return mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()


def test_lily_model_uses_lily_layers(engines):
    stock, lily = engines
    assert type(lily).__module__ == "mlx_lily.models.qwen3_5_moe"
    kinds = {type(m) for l in lily.layers for m in (getattr(l, "linear_attn", None), getattr(l, "self_attn", None), l.mlp) if m is not None}
    assert kinds == {LilyGatedDeltaNet, LilyAttention, LilySparseMoeBlock}
    assert not any(type(m).__module__.startswith("mlx_lily") for l in stock.layers for m in l.children().values())


def test_prefill_matches_stock(engines, op_calls):
    stock, lily = engines
    want = stock(TOKENS)
    got = lily(TOKENS)
    assert got.shape == want.shape
    assert close(got, want) == 0.0
    # Every op ran on lily's path.
    assert all(n > 0 for n in op_calls.values()), op_calls


def test_decode_with_cache_matches_stock(engines):
    stock, lily = engines
    cs, cl = make_prompt_cache(stock), make_prompt_cache(lily)
    assert close(lily(TOKENS[:, :10], cache=cl), stock(TOKENS[:, :10], cache=cs)) == 0.0
    for t in range(10, 16):
        step = TOKENS[:, t : t + 1]
        assert close(lily(step, cache=cl), stock(step, cache=cs)) == 0.0


def _chunked(model, chunks=((0, 5), (5, 11), (11, 16))):
    cache = make_prompt_cache(model)
    return mx.concatenate([model(TOKENS[:, a:b], cache=cache) for a, b in chunks], axis=1)


def test_prompt_in_chunks_equals_one_pass(engines):
    stock, lily = engines
    one = lily(TOKENS, cache=make_prompt_cache(lily))
    chunked = _chunked(lily)
    assert close(chunked, _chunked(stock)) == 0.0
    # Other chunk shapes round differently (in stock as in lily): not bit-exact.
    assert close(chunked, one) <= LOGIT_ATOL
    assert (chunked.argmax(-1) == one.argmax(-1)).mean().item() >= 0.9


def test_quantized_kv_cache_takes_stock_attention(engines, op_calls):
    stock, lily = engines

    def quantized_cache(model):
        cache = make_prompt_cache(model)
        return [QuantizedKVCache(group_size=32, bits=8) if isinstance(c, KVCache) else c for c in cache]

    cs, cl = quantized_cache(stock), quantized_cache(lily)
    assert close(lily(TOKENS, cache=cl), stock(TOKENS, cache=cs)) == 0.0
    assert op_calls["attention"] == 0 and op_calls["gated_delta"] > 0


def test_rotating_kv_cache_takes_stock_attention(engines, op_calls):
    stock, lily = engines
    def rotating_cache(model):
        cache = make_prompt_cache(model)
        return [RotatingKVCache(max_size=8) if isinstance(c, KVCache) else c for c in cache]

    cs, cl = rotating_cache(stock), rotating_cache(lily)
    for a, b in ((0, 6), (6, 12), (12, 16)):
        assert close(lily(TOKENS[:, a:b], cache=cl), stock(TOKENS[:, a:b], cache=cs)) == 0.0
    assert op_calls["attention"] == 0 and op_calls["gated_delta"] > 0


def test_kernels_in_the_emulator_match_stock(demo_conditioned_checkpoint, monkeypatch):
    # On the conditioned checkpoint: the plain one is chaotic in rounding, and
    # there the DeltaNet kernel's one-bf16-step differences from stock (1e-4
    # of its output, as close to an fp32 oracle as stock's) grow into logits
    # 0.4 apart.
    monkeypatch.setenv(BACKEND_ENV, "emulator")
    for op in K.OPS.values():
        monkeypatch.setattr(op, "last_path", None)
    # The MoE kernels accumulate in fp32 as stock's GPU kernels do, but stock's
    # CPU quantized matmul accumulates bf16 products in bf16 (~4% of the scale
    # at these widths) and its bf16 sigmoid can land a step off: far above this
    # test's tolerance. They are held to a precise reference per layer, and the
    # model with them to stock, in test_moe_kernels.py. The same holds for the
    # decode GEMV and MoE chain (test_gemv.py, test_moe_decode.py).
    for name in ("moe_experts", "moe_combine", "moe_decode", "quantized_matvec"):
        monkeypatch.setattr(K.OPS[name], "kernel", None)
    stock, _ = mlx_lily.load(str(demo_conditioned_checkpoint), backend="mlx")
    lily, _ = mlx_lily.load(str(demo_conditioned_checkpoint), backend="lily")
    cs, cl = make_prompt_cache(stock), make_prompt_cache(lily)
    assert close(lily(TOKENS[:, :10], cache=cl), stock(TOKENS[:, :10], cache=cs)) <= LOGIT_ATOL
    prefill = {name: op.last_path for name, op in K.OPS.items() if op.kernel is not None}
    for t in range(10, 16):
        step = TOKENS[:, t : t + 1]
        assert close(lily(step, cache=cl), stock(step, cache=cs)) <= LOGIT_ATOL
    decode = {name: op.last_path for name, op in K.OPS.items() if op.kernel is not None}
    # Every kernel op the model ran took its kernel, in prefill and in decode.
    model_ops = [name for name, path in prefill.items() if path is not None]
    assert "router_topk" in model_ops and "gated_delta" in model_ops
    assert all(prefill[name] == "kernel" for name in model_ops), prefill
    assert all(decode[name] == "kernel" for name in model_ops), decode


def test_saved_prompt_cache_continues_like_stock(engines, tmp_path):
    # mlx-lm's prompt-cache files (mlx_lm.cache_prompt, --prompt-cache-file)
    # hold lily's caches as they hold stock's.
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    stock, lily = engines
    for name, model in (("stock", stock), ("lily", lily)):
        cache = make_prompt_cache(model)
        model(TOKENS[:, :12], cache=cache)
        save_prompt_cache(str(tmp_path / f"{name}.safetensors"), cache)
    cs = load_prompt_cache(str(tmp_path / "stock.safetensors"))
    cl = load_prompt_cache(str(tmp_path / "lily.safetensors"))
    rest = TOKENS[:, 12:]
    assert close(lily(rest, cache=cl), stock(rest, cache=cs)) == 0.0


def greedy(model, n_tokens: int = 24) -> list:
    """Greedy tokens after TOKENS, one decode step at a time."""
    cache = make_prompt_cache(model)
    logits = model(TOKENS, cache=cache)
    tokens = []
    for _ in range(n_tokens):
        token = logits[0, -1].argmax().item()
        tokens.append(token)
        logits = model(mx.array([[token]]), cache=cache)
    return tokens


@pytest.fixture
def only_kernels(monkeypatch):
    """only_kernels(names): ops outside ``names`` lose their kernel (this test only)."""

    def keep(names):
        for name, op in K.OPS.items():
            if name not in names:
                monkeypatch.setattr(op, "kernel", None)

    return keep


@pytest.mark.parametrize("which", ["demo", "alt"])
def test_greedy_tokens_match_stock_with_the_router_kernel(which, demo_checkpoint, alt_checkpoint, monkeypatch, only_kernels):
    # The router kernel ranks experts as stock does (rounded softmax, stock's
    # tie order), so on plain random checkpoints, which are chaotic enough that
    # one different expert shows in later tokens, the greedy tokens are stock's.
    monkeypatch.setenv(BACKEND_ENV, "emulator")
    only_kernels({"router_topk"})
    path = str(demo_checkpoint if which == "demo" else alt_checkpoint)
    stock, _ = mlx_lily.load(path, backend="mlx")
    lily, _ = mlx_lily.load(path, backend="lily")
    assert greedy(lily) == greedy(stock)
    assert K.router_topk.last_path == "kernel", K.router_topk.last_reason


@pytest.mark.parametrize("which", ["demo"])
def test_greedy_tokens_match_stock_with_all_kernels_on_conditioned_checkpoints(which, demo_conditioned_checkpoint, alt_conditioned_checkpoint, monkeypatch,
                                                                          record_op_paths):
    # With every kernel, fp32 sums in another order differ from stock in the
    # last bits; a plain random model amplifies that into other tokens within
    # a few dozen, a well-conditioned one less so. (The conditioned small-alt
    # model, with the MoE, attention and combine kernels, still parts from stock
    # after 6-10 greedy tokens on the CPU, where stock's quantized matmuls
    # accumulate in bf16: its per-layer numerics are what the oracle judges.)
    monkeypatch.setenv(BACKEND_ENV, "emulator")
    path = str(demo_conditioned_checkpoint if which == "demo" else alt_conditioned_checkpoint)
    stock, _ = mlx_lily.load(path, backend="mlx")
    lily, _ = mlx_lily.load(path, backend="lily")
    paths = record_op_paths()
    assert greedy(lily) == greedy(stock)
    # Every op of the model that has a kernel ran it.
    kernel_ops = [name for name, op in K.OPS.items() if op.kernel is not None and op.in_model]
    assert kernel_ops and all("kernel" in paths.get(name, ()) for name in kernel_ops), paths


@pytest.mark.parametrize("backend", ["emulator", "reference"])
def test_lily_is_deterministic(backend, alt_checkpoint, monkeypatch):
    # Two runs of the same prompt, each with a fresh cache: bit-identical logits.
    monkeypatch.setenv(BACKEND_ENV, backend)
    lily, _ = mlx_lily.load(str(alt_checkpoint), backend="lily")
    runs = []
    for _ in range(2):
        cache = make_prompt_cache(lily)
        prefill = lily(TOKENS[:, :12], cache=cache)
        decode = [lily(TOKENS[:, t : t + 1], cache=cache) for t in range(12, 16)]
        runs.append(mx.concatenate([prefill, *decode], axis=1))
    assert mx.array_equal(runs[0], runs[1]).item()
