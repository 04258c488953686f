"""Checkpoints stock mlx-lm loads, lily loads the same way and runs as stock.

mlx-lm 0.32's loader takes a layer's quantization from config.json's entry
for that layer where there is one, and otherwise reads it off the layer's
tensors (``infer_quant_config``): the top-level bits and group size are not
used. So a config.json with only ``{"group_size": 64, "bits": 4}`` over 8-bit
router gates (what ``nn.quantize`` with the model's ``quant_predicate`` and
``save_config`` write), or one declaring 8 or 7 bits or group size 32 over
4-bit tensors, loads at the tensors' own packing. A ``qwen3_5_moe`` config
without ``num_experts`` (or with 0) builds dense MLP layers.

On the reference path (``MLX_LILY_KERNELS=0``) lily's logits equal stock's to
the bit. With the kernels in the CPU emulator, each GEMV call the model makes
(dense MLP, 8-bit gates) meets its contract against an fp32-summed reference
(``quantized_matvec_agree``, as in test_gemv.py), and the logits, with the
kernels whose sums stock's CPU matmul rounds differently set aside (as in
test_model.py), are within LOGIT_STEPS bf16 steps of stock's.
"""

from __future__ import annotations

import json
import math
import shutil

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.generate import generate
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import save_config, save_model

import mlx_lily
from mlx_lily import _notice
from mlx_lily import kernels as K
from mlx_lily.random_checkpoints import build_model, make_checkpoint
from mlx_lily.kernels.linear.gemv import quantized_matvec_agree, quantized_matvec_reference
from mlx_lily.toolchain.registry import BACKEND_ENV, LilyOp

TOKENS = mx.array([[17, 301, 45, 499, 2, 77, 212, 8, 64, 123, 400, 5, 6, 7, 300, 31]])
PROMPT = 10

# With kernels, logits may differ from stock's by a few bf16 steps at their
# own magnitude: each kernel sums in fp32 in another order than stock and
# rounds to bf16 where stock does, so a layer's output can move by a step,
# and on the conditioned checkpoints (not chaotic) that stays a few steps at
# the logits (measured: at most 3). A wrong group, bit width or routed expert
# moves them by far more.
LOGIT_STEPS = 4
# The kernels whose sums stock's CPU quantized matmul (bf16 sums) cannot be
# held to; they are checked per call against an fp32-summed reference.
CPU_ROUNDING_KERNELS = ("moe_experts", "moe_combine", "moe_decode", "quantized_matvec")

MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
GATE = "language_model.model.layers.0.mlp.gate"
EXPERT = "language_model.model.layers.0.mlp.switch_mlp.gate_proj"


@pytest.fixture(scope="session")
def dense_checkpoint(tmp_path_factory):
    """The demo shape with dense MLP layers (intermediate_size 256)."""
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "dense", shape={"num_experts": 0}, conditioned=True)


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "reference")


def copy_checkpoint(source, path, change_config=None, weights=None):
    shutil.copytree(source, path)
    if change_config is not None:
        config = json.loads((path / "config.json").read_text())
        change_config(config)
        (path / "config.json").write_text(json.dumps(config))
    if weights is not None:
        for old in path.glob("model*.safetensors*"):
            old.unlink()
        mx.save_safetensors(str(path / "model.safetensors"), weights)
    return path


def declare(quantization, keep_layer_entries=False):
    """A config change: the top-level quantization replaced by ``quantization``,
    each layer's entry kept or dropped."""
    def change(config):
        for key in ("quantization", "quantization_config"):
            entries = {k: v for k, v in config[key].items() if isinstance(v, dict)} if keep_layer_entries else {}
            config[key] = dict(quantization, **entries)

    return change


def without_experts(config):
    for name in MOE_FIELDS:
        config["text_config"].pop(name, None)


def packing(model) -> dict:
    """Each quantized layer's (bits, group size, mode)."""
    return {name: (m.bits, m.group_size, m.mode) for name, m in model.named_modules() if hasattr(m, "bits")}


def run(model) -> mx.array:
    """Prompt logits, then one decode step at a time on a cache: every step's logits."""
    cache = make_prompt_cache(model)
    steps = [model(TOKENS[:, :PROMPT], cache=cache)]
    for t in range(PROMPT, TOKENS.shape[1]):
        steps.append(model(TOKENS[:, t : t + 1], cache=cache))
    out = mx.concatenate(steps, axis=1)
    mx.eval(out)
    return out


def load_both(path):
    stock, _ = mlx_lily.load(str(path), backend="mlx")
    lily, _ = mlx_lily.load(str(path), backend="lily")
    assert type(lily).__module__ == "mlx_lily.models.qwen3_5_moe"
    return stock, lily


def no_failed_fast_path():
    failed = ("fused-decode-failed", "segments-failed", "whole-step-failed")
    return not any(key.startswith(failed) for key in _notice._seen)


# -- what lily loads ------------------------------------------------------------------

DECLARED = {
    "4 bits": {"group_size": 64, "bits": 4},
    "8 bits": {"group_size": 64, "bits": 8},
    "7 bits": {"group_size": 64, "bits": 7},
    "group 32": {"group_size": 32, "bits": 4},
}


@pytest.fixture
def top_level_only(demo_conditioned_checkpoint, tmp_path):
    """checkpoint(declared, keep_layer_entries): the conditioned demo checkpoint
    (4-bit group 64, router and shared-expert gates 8-bit) under another
    config.json quantization."""
    def make(declared, keep_layer_entries=False):
        name = f"{declared}-{keep_layer_entries}".replace(" ", "-")
        return copy_checkpoint(demo_conditioned_checkpoint, tmp_path / name,
                               declare(DECLARED[declared], keep_layer_entries))

    return make


@pytest.mark.parametrize("keep_layer_entries", [False, True])
@pytest.mark.parametrize("declared", list(DECLARED))
def test_declared_quantization_loads_as_stock_reads_the_tensors(top_level_only, declared, keep_layer_entries,
                                                                fresh_notices):
    stock, lily = load_both(top_level_only(declared, keep_layer_entries))
    assert packing(lily) == packing(stock)
    assert packing(lily)[GATE] == (8, 64, "affine") and packing(lily)[EXPERT] == (4, 64, "affine")
    assert mx.array_equal(run(lily), run(stock)).item()
    assert no_failed_fast_path()


def test_what_nn_quantize_and_save_config_write_loads(demo_conditioned_checkpoint, tmp_path, fresh_notices):
    # The model quantized by nn.quantize with its quant_predicate (8-bit
    # gates), config.json written with the top-level quantization only.
    model, config = build_model("demo", quantize=False, conditioned=True)
    predicate = model.quant_predicate
    nn.quantize(model, group_size=64, bits=4,
                class_predicate=lambda path, m: hasattr(m, "to_quantized") and predicate(path, m))
    path = copy_checkpoint(demo_conditioned_checkpoint, tmp_path / "nn-quantize")
    (path / "model.safetensors").unlink()
    save_model(path, model)
    config = dict(json.loads((demo_conditioned_checkpoint / "config.json").read_text()),
                  quantization={"group_size": 64, "bits": 4})
    config.pop("quantization_config")
    save_config(config, path / "config.json")
    stock, lily = load_both(path)
    assert packing(lily) == packing(stock) and packing(lily)[GATE] == (8, 64, "affine")
    assert mx.array_equal(run(lily), run(stock)).item()


def test_a_layer_packed_at_other_bits_loads_at_its_own(demo_checkpoint, tmp_path):
    # Half the packed words of a 4-bit layer read as a 2-bit layer, by stock
    # as by lily (mixed-precision checkpoints whose config.json names only the
    # top level look the same).
    weights = dict(mx.load(str(demo_checkpoint / "model.safetensors")))
    weights[f"{EXPERT}.weight"] = weights[f"{EXPERT}.weight"][..., : weights[f"{EXPERT}.weight"].shape[-1] // 2]
    stock, lily = load_both(copy_checkpoint(demo_checkpoint, tmp_path / "half", weights=weights))
    assert packing(lily)[EXPERT] == packing(stock)[EXPERT] == (2, 64, "affine")
    assert mx.array_equal(run(lily), run(stock)).item()


@pytest.fixture(params=["no num_experts", "num_experts 0"])
def dense(request, dense_checkpoint, tmp_path):
    change = without_experts if request.param == "no num_experts" else None
    return copy_checkpoint(dense_checkpoint, tmp_path / "dense", change)


def test_dense_mlp_layers_load_and_match_stock(dense, fresh_notices, monkeypatch):
    stock, lily = load_both(dense)
    assert all(type(layer.mlp).__name__ == "LilyDenseMLP" for layer in lily.layers)
    assert packing(lily) == packing(stock)
    calls = []
    original = LilyOp.__call__

    def counted(self, *args, **kwargs):
        calls.append(self.name)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(LilyOp, "__call__", counted)
    assert mx.array_equal(run(lily), run(stock)).item()
    # Decode steps ran the dense MLPs through the GEMV op: two calls per layer.
    decode_steps = TOKENS.shape[1] - PROMPT
    assert calls.count("quantized_matvec") == 2 * len(lily.layers) * decode_steps
    assert no_failed_fast_path()


def test_dense_mlp_layers_generate_as_stock(dense):
    stock, lily = load_both(dense)
    _, tokenizer = mlx_lily.load(str(dense), backend="mlx")
    texts = [generate(model, tokenizer, "The quick brown fox", max_tokens=12) for model in (stock, lily)]
    assert texts[0] == texts[1]


# -- with kernels (CPU emulator) ------------------------------------------------------


def bf16_steps(got: mx.array, want: mx.array) -> float:
    """The largest difference in bf16 steps at the largest logit's magnitude."""
    scale = mx.abs(want.astype(mx.float32)).max().item()
    step = 2.0 ** (math.floor(math.log2(scale)) - 7)
    return mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item() / step


@pytest.fixture
def gemv_calls(monkeypatch):
    """Each quantized_matvec call: (args, kwargs, result, path)."""
    calls = []
    original = LilyOp.__call__

    def recorded(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        if self.name == "quantized_matvec":
            calls.append((args, kwargs, result, self.last_path))
        return result

    monkeypatch.setattr(LilyOp, "__call__", recorded)
    return calls


def check_kernels_against_stock(path, gemv_calls, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "emulator")
    stock, lily = load_both(path)
    want = run(stock)
    # Every kernel on: each GEMV call met its contract on the kernel's path.
    run(lily)
    assert gemv_calls and all(p == "kernel" for *_, p in gemv_calls)
    for args, kwargs, got, _ in gemv_calls:
        reference = quantized_matvec_reference(*args, **kwargs)
        assert quantized_matvec_agree(got, reference, *args, **kwargs) is None
    # The kernels stock's CPU matmul rounds otherwise set aside: the logits.
    for name in CPU_ROUNDING_KERNELS:
        monkeypatch.setattr(K.OPS[name], "kernel", None)
    assert bf16_steps(run(lily), want) <= LOGIT_STEPS
    return gemv_calls


@pytest.mark.parametrize("declared", list(DECLARED))
def test_declared_quantization_with_kernels(top_level_only, declared, gemv_calls, monkeypatch):
    calls = check_kernels_against_stock(top_level_only(declared), gemv_calls, monkeypatch)
    # The 8-bit router and shared-expert gates ran on the GEMV kernel.
    widths = {args[1][0][0].shape[-1] * 32 // args[0].shape[-1] for args, *_ in calls if len(args[1]) == 2}
    assert 8 in widths


def test_dense_mlp_layers_with_kernels(dense_checkpoint, tmp_path, gemv_calls, monkeypatch):
    path = copy_checkpoint(dense_checkpoint, tmp_path / "dense", without_experts)
    calls = check_kernels_against_stock(path, gemv_calls, monkeypatch)
    assert len(calls) >= 2 * 4 * (TOKENS.shape[1] - PROMPT)
