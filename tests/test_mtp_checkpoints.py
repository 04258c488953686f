"""The MTP head in checkpoints: lily's model keeps it, quantized like the rest;
random checkpoints with a head in mlx-lm's and the original layout;
``graft-mtp`` adds it to an mlx-lm checkpoint (round trip, bit for bit) and
names what is wrong with an original that does not fit."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

import mlx_lily
from mlx_lily import mtp
from mlx_lily.__main__ import main as lily_main
from mlx_lily.errors import CheckpointError
from mlx_lily.graft_mtp import OUTPUT_FILE, graft
from mlx_lily.random_checkpoints import build_model, make_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return {
        "head": make_checkpoint(root / "head", mtp=True),
        "plain": make_checkpoint(root / "plain"),
        "original": make_checkpoint(root / "original", mtp=True, original=True),
    }


def _params(model) -> dict:
    return dict(tree_flatten(model.parameters()))


def _weights(folder) -> dict:
    out = {}
    for f in sorted(folder.glob("model*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def _plain_copy(checkpoints, tmp_path):
    target = tmp_path / "ckpt"
    shutil.copytree(checkpoints["plain"], target)
    return target


def _original_copy(checkpoints, tmp_path, edit=None):
    """A copy of the original-layout checkpoint, its head's shard edited by
    ``edit(tensors) -> tensors``."""
    target = tmp_path / "original"
    shutil.copytree(checkpoints["original"], target)
    if edit is not None:
        index = json.loads((target / "model.safetensors.index.json").read_text())
        shard = target / next(v for k, v in index["weight_map"].items() if k.startswith("mtp."))
        tensors = edit(dict(mx.load(str(shard))))
        mx.save_safetensors(str(shard), tensors)
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if not k.startswith("mtp.")}
        index["weight_map"].update({k: shard.name for k in tensors})
        (target / "model.safetensors.index.json").write_text(json.dumps(index))
    return target


def test_lily_keeps_the_head_quantized_like_the_rest(checkpoints):
    model, _ = mlx_lily.load(str(checkpoints["head"]))
    head = mtp.head_of(model)
    assert isinstance(head, mtp.MTPHead) and len(head.layers) == 1
    assert isinstance(head.fc, nn.QuantizedLinear) and head.fc.bits == 4 and head.fc.group_size == 64
    layer = head.layers[0]
    assert not layer.is_linear
    assert layer.mlp.gate.bits == 8 and layer.mlp.shared_expert_gate.bits == 8
    assert layer.mlp.switch_mlp.down_proj.bits == 4
    # The main model is the one of the same seed without a head.
    plain, _ = mlx_lily.load(str(checkpoints["plain"]))
    with_head, without = _params(model), _params(plain)
    assert {k for k in with_head if not k.startswith(mtp.PREFIX)} == set(without)
    assert all(mx.array_equal(without[k], with_head[k]) for k in without)
    assert not mtp.has_head(plain)


def test_the_heads_draft_step_runs_lilys_fused_decode(checkpoints, emulator_backend, record_op_paths):
    """Lily's model switches the head's layer to lily's classes with its own:
    a one-token draft step takes the fused decode step on kernels, close to
    the same head on stock's classes; switching the model back to stock's
    classes switches the head too."""
    from mlx_lm.models.cache import KVCache
    from mlx_lm.models.qwen3_5 import DecoderLayer

    from mlx_lily.layers import LilyDecoderLayer
    from mlx_lily.models.qwen3_5_moe import specialize

    model, _ = mlx_lily.load(str(checkpoints["head"]))
    head = mtp.head_of(model)
    assert type(head.layers[0]) is LilyDecoderLayer
    embed = model.language_model.model.embed_tokens
    D = head.fc.weight.shape[0]
    hidden = mx.random.normal((1, 6, D), key=mx.random.key(3)).astype(mx.bfloat16)
    tokens = mx.array([[5, 17, 2, 9, 30, 11]])

    def draft(cache):
        out = [head(hidden[:, :5], embed(tokens[:, :5]), cache)]
        paths = record_op_paths()
        out.append(head(hidden[:, 5:], embed(tokens[:, 5:]), cache))
        return out, {k: set(v) for k, v in paths.items()}

    (lily_prompt, lily_step), paths = draft([KVCache()])
    assert paths["moe_decode"] == {"kernel"}, paths
    specialize(model, lily=False)
    assert type(head.layers[0]) is DecoderLayer
    (stock_prompt, stock_step), stock_paths = draft([KVCache()])
    assert "moe_decode" not in stock_paths
    for got, want in ((lily_prompt, stock_prompt), (lily_step, stock_step)):
        scale = mx.abs(want.astype(mx.float32)).max().item()
        assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=0.05 * scale).item()


def test_stock_drops_the_head(checkpoints):
    model, _ = mlx_lily.load(str(checkpoints["head"]), backend="mlx")
    assert not any(k.startswith(mtp.PREFIX) for k in _params(model))


def test_original_layout_loads_as_built(checkpoints):
    """mlx-lm's sanitize (and lily's for the head) turns the original layout
    back into the model built in memory: names, fused experts, conv1d and the
    norms' offsets (the head's norms are not all 1)."""
    model, _ = mlx_lily.load(str(checkpoints["original"]))
    built, _ = build_model("demo", mtp=True, quantize=False)
    got, want = _params(model), _params(built)
    assert set(got) == set(want)
    assert all(got[k].dtype == want[k].dtype and mx.array_equal(got[k], want[k]) for k in want)
    norms = [want[k] for k in want if k.startswith(mtp.PREFIX) and "norm" in k]
    assert any(not mx.all(n == 1).item() for n in norms)
    config = json.loads((checkpoints["original"] / "config.json").read_text())
    assert "quantization" not in config and config["text_config"][mtp.LAYERS_FIELD] == 1
    index = json.loads((checkpoints["original"] / "model.safetensors.index.json").read_text())
    assert "mtp.layers.0.mlp.experts.gate_up_proj" in index["weight_map"]
    assert "mtp.fc.weight" in index["weight_map"] and "mtp.norm.weight" in index["weight_map"]


def test_graft_round_trip(checkpoints, tmp_path, capsys):
    """graft-mtp on the checkpoint without a head gives, tensor for tensor and
    in config.json, the checkpoint written with one; lily loads it with its
    head and the main model unchanged."""
    target = _plain_copy(checkpoints, tmp_path)
    with pytest.raises(SystemExit) as done:
        lily_main(["graft-mtp", str(target), str(checkpoints["original"])])
    assert done.value.code == 0
    assert OUTPUT_FILE in capsys.readouterr().out
    want, got = _weights(checkpoints["head"]), _weights(target)
    assert set(got) == set(want)
    assert all(got[k].dtype == want[k].dtype and mx.array_equal(got[k], want[k]) for k in want)
    assert json.loads((target / "config.json").read_text()) == json.loads(
        (checkpoints["head"] / "config.json").read_text())
    grafted, _ = mlx_lily.load(str(target))
    reference, _ = mlx_lily.load(str(checkpoints["head"]))
    a, b = _params(grafted), _params(reference)
    assert set(a) == set(b) and all(mx.array_equal(a[k], b[k]) for k in b)


def test_graft_reads_experts_one_tensor_each(checkpoints, tmp_path):
    def per_expert(tensors):
        for proj in ("gate_up_proj", "down_proj"):
            fused = tensors.pop(f"mtp.layers.0.mlp.experts.{proj}")
            for e in range(fused.shape[0]):
                if proj == "down_proj":
                    tensors[f"mtp.layers.0.mlp.experts.{e}.down_proj.weight"] = fused[e]
                else:
                    mid = fused.shape[1] // 2
                    tensors[f"mtp.layers.0.mlp.experts.{e}.gate_proj.weight"] = fused[e, :mid]
                    tensors[f"mtp.layers.0.mlp.experts.{e}.up_proj.weight"] = fused[e, mid:]
        return tensors

    target = _plain_copy(checkpoints, tmp_path)
    graft(target, _original_copy(checkpoints, tmp_path, per_expert))
    want, got = _weights(checkpoints["head"]), _weights(target)
    assert set(got) == set(want) and all(mx.array_equal(got[k], want[k]) for k in want)


def _drop(name):
    def edit(tensors):
        del tensors[name]
        return tensors
    return edit


def _reshape(name, shape):
    def edit(tensors):
        tensors[name] = mx.zeros(shape, dtype=tensors[name].dtype)
        return tensors
    return edit


@pytest.mark.parametrize("edit, message", [
    (_drop("mtp.fc.weight"), r"missing tensor 'mtp\.fc\.weight' \(shape \(128, 256\)\)"),
    (_drop("mtp.layers.0.mlp.experts.gate_up_proj"),
     r"missing tensor 'mtp\.layers\.0\.mlp\.experts\.gate_up_proj' \(shape \(8, 256, 128\)\)"),
    (_reshape("mtp.layers.0.self_attn.k_proj.weight", (32, 128)),
     r"tensor 'mtp\.layers\.0\.self_attn\.k_proj\.weight' in model-00002-of-00002\.safetensors has shape "
     r"\(32, 128\); expected \(64, 128\)"),
    (_reshape("mtp.layers.0.mlp.experts.gate_up_proj", (8, 128, 128)),
     r"'mtp\.layers\.0\.mlp\.experts\.gate_up_proj' in model-00002-of-00002\.safetensors has shape "
     r"\(8, 128, 128\); expected \(8, 256, 128\)"),
    (_reshape("mtp.layers.0.mlp.experts.gate_up_proj", (8, 256)), r"'mtp\.layers\.0\.mlp\.experts\.gate_up_proj' has "
                                                                 r"shape \(8, 256\); expected \[experts"),
])
def test_graft_names_the_tensor_at_fault(checkpoints, tmp_path, edit, message):
    target = _plain_copy(checkpoints, tmp_path)
    before = {p.name: p.read_bytes() for p in target.iterdir()}
    with pytest.raises(CheckpointError, match=message):
        graft(target, _original_copy(checkpoints, tmp_path, edit))
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before  # nothing written


def test_graft_refusals_are_one_line(checkpoints, tmp_path, capsys):
    # No head in the folder (the mlx checkpoint without one).
    target = _plain_copy(checkpoints, tmp_path)
    with pytest.raises(SystemExit) as done:
        lily_main(["graft-mtp", str(target), str(checkpoints["plain"])])
    assert str(done.value.code).startswith("mlx-lily: no MTP head in ") and "\n" not in str(done.value.code)
    # A checkpoint that has one already; --force replaces a grafted one.
    with pytest.raises(CheckpointError, match=r"already has an MTP head: tensor 'language_model\.mtp\.fc\.biases' "
                                              r"in model\.safetensors$"):
        graft(_copy(checkpoints["head"], tmp_path / "head"), checkpoints["original"])
    graft(target, checkpoints["original"])
    with pytest.raises(CheckpointError, match=r"--force replaces it"):
        graft(target, checkpoints["original"])
    graft(target, checkpoints["original"], force=True)
    assert set(_weights(target)) == set(_weights(checkpoints["head"]))


def _copy(source, target):
    shutil.copytree(source, target)
    return target


def test_config_declaring_other_layers_is_refused(checkpoints, tmp_path):
    target = _copy(checkpoints["head"], tmp_path / "head")
    config = json.loads((target / "config.json").read_text())
    config["text_config"][mtp.LAYERS_FIELD] = 2
    (target / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"mtp_num_hidden_layers is 2, but the checkpoint's MTP tensors have "
                                              r"1 layer"):
        mlx_lily.load(str(target))
