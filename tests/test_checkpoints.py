"""The random-checkpoint maker: cached, rebuilt on format change, real shapes."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from mlx_lily import random_checkpoints
from mlx_lily.random_checkpoints import build_model, make_checkpoint, model_config


def test_checkpoint_is_cached_and_rebuilt_on_format_change(tmp_path, monkeypatch):
    path = make_checkpoint(tmp_path / "c", shape="demo")
    weights = path / "model.safetensors"
    first = weights.stat().st_mtime_ns
    assert make_checkpoint(tmp_path / "c", shape="demo") == path
    assert weights.stat().st_mtime_ns == first
    monkeypatch.setattr(random_checkpoints, "FORMAT_VERSION", random_checkpoints.FORMAT_VERSION + 1)
    make_checkpoint(tmp_path / "c", shape="demo")
    assert json.loads((path / random_checkpoints.MARKER).read_text())["format"] == random_checkpoints.FORMAT_VERSION
    assert weights.stat().st_mtime_ns != first


def test_the_old_module_name_is_the_same_module():
    """``mlx_lily.checkpoints`` (the README's import path) is an alias."""
    from mlx_lily import checkpoints
    from mlx_lily.checkpoints import SHAPES

    assert checkpoints is random_checkpoints and SHAPES is random_checkpoints.SHAPES
    assert checkpoints.make_checkpoint is make_checkpoint and checkpoints.build_model is build_model


def test_default_location_is_the_user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_LILY_CACHE", str(tmp_path))
    assert make_checkpoint(shape="demo").parent == tmp_path / "checkpoints"


def test_quantized_like_mlx_community(demo_checkpoint):
    config = json.loads((demo_checkpoint / "config.json").read_text())
    q = config["quantization"]
    assert (q["group_size"], q["bits"], q["mode"]) == (64, 4, "affine")
    gates = [k for k in q if k.endswith(("mlp.gate", "shared_expert_gate"))]
    assert len(gates) == 2 * config["text_config"]["num_hidden_layers"]
    assert all(q[k]["bits"] == 8 for k in gates)
    weights = mx.load(str(demo_checkpoint / "model.safetensors"))
    assert weights["language_model.model.layers.0.mlp.switch_mlp.down_proj.weight"].dtype == mx.uint32
    assert weights["language_model.model.layers.0.mlp.switch_mlp.down_proj.scales"].dtype == mx.bfloat16
    assert weights["language_model.model.layers.0.linear_attn.A_log"].dtype == mx.float32


def test_real_shapes():
    text = model_config("qwen3.6-35b-a3b")["text_config"]
    assert text["hidden_size"] == 2048 and text["num_hidden_layers"] == 40
    assert (text["num_attention_heads"], text["num_key_value_heads"], text["head_dim"]) == (16, 2, 256)
    assert (text["linear_num_key_heads"], text["linear_num_value_heads"]) == (16, 32)
    assert (text["linear_key_head_dim"], text["linear_value_head_dim"]) == (128, 128)
    assert (text["num_experts"], text["num_experts_per_tok"], text["moe_intermediate_size"]) == (256, 8, 512)
    assert text["vocab_size"] == 248320 and text["full_attention_interval"] == 4
    assert text["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert text["rope_parameters"]["rope_theta"] == 1e7


def test_built_layer_by_layer():
    # Experts dominate: all 12 layers' unquantized fp32 experts together are
    # ~600 MB; built layer by layer the peak stays within a few layers' worth.
    shape = dict(num_hidden_layers=12, num_experts=64, moe_intermediate_size=256, hidden_size=256)
    one_layer_experts = 64 * 3 * 256 * 256 * 4
    mx.reset_peak_memory()
    model, _ = build_model(shape)
    peak = mx.get_peak_memory()
    assert peak < 4 * one_layer_experts, (peak, one_layer_experts)


def test_unknown_shape_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown shape 'huge'"):
        model_config("huge")


def test_conditioned_scales_branches_and_routers_only():
    # The same seed draws the same weights; conditioning scales the residual
    # branches' output projections and the routers, nothing else.
    from mlx.utils import tree_flatten

    from mlx_lily.random_checkpoints import BRANCH_SCALE, ROUTER_SCALE, build_model

    plain = dict(tree_flatten(build_model("demo", seed=3, quantize=False)[0].parameters()))
    cond = dict(tree_flatten(build_model("demo", seed=3, quantize=False, conditioned=True)[0].parameters()))
    layers = 4
    branch = BRANCH_SCALE / (2 * layers) ** 0.5
    scaled = 0
    for name, w in plain.items():
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            factor = branch
        elif name.endswith("mlp.gate.weight"):
            factor = ROUTER_SCALE
        else:
            assert mx.array_equal(cond[name], w).item(), name
            continue
        scaled += 1
        want = (w.astype(mx.float32) * factor).astype(w.dtype)
        assert mx.allclose(cond[name].astype(mx.float32), want.astype(mx.float32), rtol=1e-2).item(), name
    # Per layer: one attention output, one router, routed and shared down projections.
    assert scaled == layers * 4


def test_refuses_a_folder_lily_did_not_write(tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    for force in (False, True):
        with pytest.raises(FileExistsError, match="not a lily checkpoint"):
            make_checkpoint(folder, shape="demo", force=force)
    assert (folder / "notes.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no leftovers
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(FileExistsError, match="not a folder"):
        make_checkpoint(a_file, shape="demo")


def test_writes_into_an_empty_folder_and_replaces_its_own(tmp_path):
    folder = tmp_path / "empty"
    folder.mkdir()
    path = make_checkpoint(folder, shape="demo")
    assert (path / random_checkpoints.MARKER).is_file()
    make_checkpoint(folder, shape="demo", force=True)  # lily's own: rebuilt
    assert (path / random_checkpoints.MARKER).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_another_process_writing_the_same_checkpoint_first_is_no_error(tmp_path, monkeypatch):
    # Two processes (or test workers) ask for the same checkpoint at once:
    # the other one renames its copy into place between this one's check and
    # its own rename. This one then takes theirs and leaves no partial folder.
    from pathlib import Path

    target = tmp_path / "shared"
    rename = Path.rename

    def other_process_first(self, dest):
        if Path(dest) == target and not target.exists():
            monkeypatch.setattr(Path, "rename", rename)
            make_checkpoint(target, shape="demo")  # the other process, done first
        return rename(self, dest)

    monkeypatch.setattr(Path, "rename", other_process_first)
    assert make_checkpoint(target, shape="demo") == target
    assert random_checkpoints.is_written(target, "demo", 0, False, False, False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shared"]
    # A different checkpoint put in its place meanwhile is an error, not taken.
    other = tmp_path / "other"

    def seed_one_first(self, dest):
        if Path(dest) == other and not other.exists():
            monkeypatch.setattr(Path, "rename", rename)
            make_checkpoint(other, shape="demo", seed=1)
        return rename(self, dest)

    monkeypatch.setattr(Path, "rename", seed_one_first)
    with pytest.raises(OSError):
        make_checkpoint(other, shape="demo", seed=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "shared"]


def test_rebuild_keeps_what_lily_did_not_write(tmp_path, capsys):
    path = make_checkpoint(tmp_path / "x", shape="demo")
    written = sorted(p.name for p in path.iterdir())
    (path / "MY_NOTES.txt").write_text("keep me")
    (path / "mine").mkdir()
    (path / "mine" / "data").write_text("and me")
    capsys.readouterr()
    make_checkpoint(path, shape="small-alt")  # another shape: rebuilt in place
    assert (path / "MY_NOTES.txt").read_text() == "keep me"
    assert (path / "mine" / "data").read_text() == "and me"
    assert json.loads((path / random_checkpoints.MARKER).read_text())["shape"] == "small-alt"
    assert sorted(p.name for p in path.iterdir()) == sorted(written + ["MY_NOTES.txt", "mine"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x"]  # no leftovers beside it
    notices = [line for line in capsys.readouterr().err.splitlines() if "did not write" in line]
    assert len(notices) == 1 and "MY_NOTES.txt" in notices[0] and "mine" in notices[0], notices
    # The rebuilt checkpoint is the small-alt one, and loads.
    config = json.loads((path / "config.json").read_text())
    assert config["text_config"]["num_experts"] == 16
    # A checkpoint of an older format (its marker lists no files): the same.
    marker = json.loads((path / random_checkpoints.MARKER).read_text())
    marker.pop("files", None)
    marker["format"] = 2
    (path / random_checkpoints.MARKER).write_text(json.dumps(marker))
    make_checkpoint(path, shape="demo")
    assert (path / "MY_NOTES.txt").read_text() == "keep me"
    assert json.loads((path / "config.json").read_text())["text_config"]["num_experts"] == 8


def test_tokenizer_covers_the_model_vocabulary(demo_checkpoint):
    # Every id the model can emit decodes (the demo's vocabulary was once twice
    # its tokenizer's: undecodable text, logprobs with token null).
    from transformers import AutoTokenizer

    config = json.loads((demo_checkpoint / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(str(demo_checkpoint))
    vocab = config["text_config"]["vocab_size"]
    assert len(tokenizer) == vocab
    assert None not in tokenizer.convert_ids_to_tokens(list(range(vocab)))


@pytest.mark.parametrize("size", [300, 512, 2000])
def test_make_tokenizer_has_exactly_the_size_asked(size):
    from mlx_lily.random_checkpoints import make_tokenizer

    tokenizer = make_tokenizer(size)
    assert len(tokenizer) == size
    assert tokenizer.decode(tokenizer.encode("Hello world")) == "Hello world"
    last = tokenizer.decode([size - 1])
    assert last.strip().isalpha(), last  # a filler word, decodable text
