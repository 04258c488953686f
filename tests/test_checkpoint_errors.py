"""Bad checkpoints give a clear error naming the tensor or setting at fault."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import pytest

import mlx_lily
from mlx_lily.errors import CheckpointError

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


@pytest.mark.parametrize("where", ["model", "tensor"])
def test_unsupported_quantization(copy_of, where):
    config_path = copy_of / "config.json"
    config = json.loads(config_path.read_text())
    if where == "model":
        config["quantization"]["bits"] = 7
        match = "unsupported quantization for the model.*bits=7"
    else:
        config["quantization"][EXPERT] = {"group_size": 48, "bits": 4}
        match = f"unsupported quantization for tensor '{EXPERT}'.*group_size=48"
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=match):
        mlx_lily.load(str(copy_of), backend="lily")


def test_good_checkpoint_loads(demo_checkpoint):
    model, tokenizer = mlx_lily.load(str(demo_checkpoint), backend="lily")
    assert type(model).__module__ == "mlx_lily.models.qwen3_5_moe"
