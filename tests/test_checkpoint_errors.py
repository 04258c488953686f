"""Bad checkpoints give a clear error naming the tensor or setting at fault."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import mlx.core as mx
import pytest

import mlx_lily
from mlx_lily.errors import CheckpointError, ConfigError

EXPERT = "language_model.model.layers.0.mlp.switch_mlp.gate_proj"


@pytest.fixture
def copy_of(demo_checkpoint, tmp_path):
    path = tmp_path / "ckpt"
    shutil.copytree(demo_checkpoint, path)
    return path


def edit_weights(path, change):
    weights = dict(mx.load(str(path / "model.safetensors")))
    change(weights)
    mx.save_safetensors(str(path / "model.safetensors"), weights)


def test_missing_tensor(copy_of):
    edit_weights(copy_of, lambda w: w.pop(f"{EXPERT}.scales"))
    with pytest.raises(CheckpointError, match=f"{EXPERT}.scales"):
        mlx_lily.load(str(copy_of), backend="lily")


def test_missing_plain_tensor(copy_of):
    name = "language_model.model.layers.1.linear_attn.A_log"
    edit_weights(copy_of, lambda w: w.pop(name))
    with pytest.raises(CheckpointError, match=f"missing tensor '{name}'"):
        mlx_lily.load(str(copy_of), backend="lily")


def test_wrong_shape(copy_of):
    name = "language_model.model.layers.2.linear_attn.dt_bias"

    def shrink(w):
        w[name] = w[name][:-1]

    edit_weights(copy_of, shrink)
    with pytest.raises(CheckpointError, match=rf"'{name}' has shape \(3,\), expected \(4,\)"):
        mlx_lily.load(str(copy_of), backend="lily")


def test_unexpected_tensor(copy_of):
    edit_weights(copy_of, lambda w: w.__setitem__("language_model.model.layers.0.extra.weight", mx.zeros(3)))
    with pytest.raises(CheckpointError, match="layers.0.extra.weight"):
        mlx_lily.load(str(copy_of), backend="lily")


def edit_config(path, change):
    config_path = path / "config.json"
    config = json.loads(config_path.read_text())
    change(config)
    config_path.write_text(json.dumps(config))


def test_a_layer_entry_must_match_its_tensors(copy_of):
    # config.json's entry for a layer is what mlx-lm builds it with (it reads
    # only layers without one off their tensors): stock fails in load_weights
    # on the 8-bit router gate declared at 4 bits.
    gate = "language_model.model.layers.0.mlp.gate"
    edit_config(copy_of, lambda c: c["quantization"].__setitem__(gate, {"group_size": 64, "bits": 4}))
    match = rf"'{gate}.weight' is packed at 8 bits, group size 64 .* quantization.{gate} declares 4 bits, group size 64"
    with pytest.raises(CheckpointError, match=match):
        mlx_lily.load(str(copy_of), backend="lily")


def test_top_level_quantization_needs_group_size_and_bits(copy_of):
    # Stock: a KeyError from its quantization step.
    edit_config(copy_of, lambda c: c["quantization"].pop("group_size"))
    with pytest.raises(ConfigError, match="config.json quantization has no group_size"):
        mlx_lily.load(str(copy_of), backend="lily")


def test_unsupported_quantization_for_a_tensor(copy_of):
    edit_config(copy_of, lambda c: c["quantization"].__setitem__(EXPERT, {"group_size": 48, "bits": 4}))
    with pytest.raises(CheckpointError, match=f"unsupported quantization for tensor '{EXPERT}'.*group_size=48"):
        mlx_lily.load(str(copy_of), backend="lily")


def set_packed_words(words):
    def change(w):
        w[f"{EXPERT}.weight"] = mx.zeros((*w[f"{EXPERT}.weight"].shape[:-1], words), dtype=mx.uint32)

    return change


def test_packed_weight_of_no_whole_number_of_bits(copy_of):
    # 15 words for 128 inputs: 3.75 bits. Stock fails in load_weights.
    edit_weights(copy_of, set_packed_words(15))
    with pytest.raises(CheckpointError, match=rf"'{EXPERT}.weight' \(shape \(8, 128, 15\).* 3.75 bits per weight"):
        mlx_lily.load(str(copy_of), backend="lily")


def test_packed_weight_at_bits_mlx_has_not(copy_of):
    # 28 words for 128 inputs: 7 bits, which MLX cannot quantize to (stock
    # fails in mx.quantize).
    edit_weights(copy_of, set_packed_words(28))
    match = rf"unsupported quantization for tensor '{EXPERT}': its tensors are packed at mode=affine, bits=7"
    with pytest.raises(CheckpointError, match=match):
        mlx_lily.load(str(copy_of), backend="lily")


def test_missing_lm_head(copy_of):
    # Stock fails with a bare KeyError from inside its quantization step.
    edit_weights(copy_of, lambda w: w.pop("language_model.lm_head.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'language_model.lm_head.weight'.*\(512, 128\)"):
        mlx_lily.load(str(copy_of), backend="lily")


def set_text_field(name, value):
    def change(config):
        if value is None:
            config["text_config"].pop(name)
        else:
            config["text_config"][name] = value

    return change


@pytest.mark.parametrize(
    "name, value, match",
    [
        # stock: an argpartition error from inside the router
        ("num_experts_per_tok", 9, r"num_experts_per_tok is 9; expected at most text_config.num_experts \(8\)"),
        # stock: loads and generates with no routed experts
        ("num_experts_per_tok", 0, "num_experts_per_tok is 0; expected .* a positive integer"),
        ("num_experts_per_tok", None, "has no text_config.num_experts_per_tok"),
        # stock: "group size 2048 not supported" (its default width)
        ("hidden_size", None, r"has no text_config.hidden_size \(the model width"),
        ("num_key_value_heads", 3, r"num_attention_heads \(4\) is not a multiple of text_config.num_key_value_heads \(3\)"),
        # stock: a TypeError comparing it with 0
        ("num_experts", "8", "num_experts is '8'; expected an integer"),
        # stock builds dense MLP layers and fails on the MoE tensors
        ("num_experts", None, "num_experts is missing, so each layer's MLP is dense, but the checkpoint holds MoE"),
    ],
)
def test_bad_config_field(copy_of, name, value, match):
    edit_config(copy_of, set_text_field(name, value))
    with pytest.raises(ConfigError, match=match):
        mlx_lily.load(str(copy_of), backend="lily")


def test_command_line_error_is_one_line(copy_of):
    edit_config(copy_of, set_text_field("num_experts_per_tok", 9))
    env = {k: v for k, v in os.environ.items() if k not in ("MLX_LM_BACKEND", "MLX_LILY_TRACEBACK")}
    for command in (["mlx_lm.generate", "--backend", "lily"], [sys.executable, "-m", "mlx_lily", "generate"]):
        out = subprocess.run([*command, "--model", str(copy_of), "--prompt", "hi", "--max-tokens", "2"],
                             capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 1
        errors = [line for line in out.stderr.splitlines() if not line.startswith("[mlx-lily]")]
        assert errors == ["mlx-lily: config.json text_config.num_experts_per_tok is 9; "
                          "expected at most text_config.num_experts (8)"], out.stderr
    asked = subprocess.run(["mlx_lm.generate", "--backend", "lily", "--model", str(copy_of), "--prompt", "hi"],
                           capture_output=True, text=True, timeout=300, env={**env, "MLX_LILY_TRACEBACK": "1"})
    assert "Traceback" in asked.stderr and "ConfigError" in asked.stderr


def test_good_checkpoint_loads(demo_checkpoint):
    model, tokenizer = mlx_lily.load(str(demo_checkpoint), backend="lily")
    assert type(model).__module__ == "mlx_lily.models.qwen3_5_moe"
