"""The demo's report: which ops ran kernels, and what its agreement line means."""

from __future__ import annotations

import mlx.core as mx
import pytest

import mlx_lily
from mlx_lily import demo
from mlx_lily.kernels import OPS
from mlx_lily.toolchain.registry import BACKEND_ENV


@pytest.fixture
def reference_backend(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "reference")


def logits_with_top_two(first: float, second: float, size: int = 64) -> mx.array:
    values = mx.linspace(-3.0, 1.0, size)
    return mx.concatenate([mx.array([first, second]), values[2:]])


def test_rounding_level_near_tie_passes_with_an_explanation():
    oracle = logits_with_top_two(2.0, 2.0)
    stock = logits_with_top_two(2.0, 1.999)
    lily = logits_with_top_two(1.999, 2.0)  # the tie flipped by 1e-3, as far off as stock
    d = demo.judge(5, oracle, stock, lily, stock_token=0, lily_token=1)
    assert d.rounding_level and d.lily_distance == pytest.approx(1e-3, rel=1e-2)
    lines, ok = demo.explain(False, ["router_topk"], d)
    assert ok
    text = "\n".join(lines)
    assert "rounding-level near-tie" in text and "generated token 5" in text and "not an error" in text
    assert "fp32 oracle" in text


def test_a_difference_beyond_rounding_fails_and_says_so():
    stock = logits_with_top_two(2.0, 1.0)
    lily = logits_with_top_two(1.0, 2.0)  # a whole logit: a wrong kernel
    d = demo.judge(0, stock, stock, lily, stock_token=0, lily_token=1)
    assert not d.rounding_level
    lines, ok = demo.explain(False, ["router_topk"], d)
    assert not ok
    assert "farther from the oracle than stock" in "\n".join(lines) and "doctor" in "\n".join(lines)


def off_by(logits: mx.array, fraction: float) -> mx.array:
    """The logits with the first moved by ``fraction`` of their spread."""
    return logits + mx.array([fraction * mx.std(logits).item()] + [0.0] * (logits.size - 1))


@pytest.mark.parametrize("kernels", ["emulator", "reference"])
def test_one_rule_on_every_platform(monkeypatch, kernels):
    # A gap of 13% of the spread between lily and stock was accepted on the
    # CPU (kernels in the emulator) while the README said 5%: now lily is
    # judged against the fp32 oracle, by one rule wherever it runs.
    monkeypatch.setenv(BACKEND_ENV, kernels)
    oracle = logits_with_top_two(2.0, 1.0)
    d = demo.judge(0, oracle, oracle, off_by(oracle, 0.13), 0, 1)  # stock exact, lily 13% off
    assert d.lily_relative == pytest.approx(0.13, rel=1e-3) and not d.rounding_level
    d = demo.judge(0, oracle, off_by(oracle, -0.12), off_by(oracle, 0.13), 0, 1)  # both round
    assert d.rounding_level
    slack = demo.ORACLE_SLACK
    assert not demo.judge(0, oracle, off_by(oracle, 0.1), off_by(oracle, 0.1 + slack + 0.01), 0, 1).rounding_level
    assert demo.judge(0, oracle, off_by(oracle, 0.1), off_by(oracle, 0.1 + slack - 0.01), 0, 1).rounding_level


def test_readme_states_the_codes_rule():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    paragraph = next(p for p in readme.split("\n\n") if p.startswith("**Demo.**"))
    paragraph = " ".join(paragraph.split())
    assert "fp32 oracle" in paragraph and "no farther from the oracle than stock" in paragraph
    assert f"{100 * demo.ORACLE_SLACK:.0f}% of the oracle's spread" in paragraph, paragraph


def test_agreement_without_kernels_is_explained():
    lines, ok = demo.explain(True, [], None)
    assert ok and "same computation" in "\n".join(lines)
    lines, ok = demo.explain(False, [], None)
    assert not ok and "a bug in lily" in "\n".join(lines)


def test_first_divergence_measures_real_logits(demo_conditioned_checkpoint, reference_backend, monkeypatch):
    from mlx.utils import tree_flatten

    model, tokenizer = mlx_lily.load(str(demo_conditioned_checkpoint), backend="lily")
    before = tree_flatten(model.parameters())
    prompt = tokenizer.encode("Tell me a story")
    stock_tokens = [5, 6, 7, 8]
    lily_tokens = [5, 6, 9, 8]
    d = demo.first_divergence(model, prompt, stock_tokens, lily_tokens)
    assert (d.step, d.stock_token, d.lily_token) == (2, 7, 9)
    # Lily on references computes stock's math exactly; the oracle rounds less.
    assert d.lily_distance == d.stock_distance > 0 and d.rounding_level and d.spread > 0
    # The oracle's float32 copy is gone: the model holds its own arrays again.
    after = tree_flatten(model.parameters())
    assert all(a is b for (_, a), (_, b) in zip(before, after)) and type(model.layers[0].mlp).__module__.startswith(
        "mlx_lily.")
    # A wrong op (the MoE output scaled by 1.5) is far beyond rounding.
    combine = OPS["moe_combine"]
    monkeypatch.setattr(combine, "reference", lambda *a, _f=combine.reference, **k: _f(*a, **k) * 1.5)
    d = demo.first_divergence(model, prompt, stock_tokens, lily_tokens)
    assert not d.rounding_level, d


def test_op_paths_are_recorded(demo_checkpoint, reference_backend):
    with demo.recording_op_paths() as taken:
        demo.run_engine(str(demo_checkpoint), "lily", "hi", 2)
    lines = demo.describe_op_paths(taken)
    assert len(lines) == len(OPS)
    assert any("router_topk" in line and "MLX_LILY_KERNEL_BACKEND=reference" in line for line in lines)
    assert demo.kernels_that_ran(taken) == []
    with demo.recording_op_paths() as taken:
        demo.run_engine(str(demo_checkpoint), "mlx", "hi", 2)
    assert not taken  # stock runs no lily op


def test_refused_checkpoint_is_one_line_before_any_run(demo_checkpoint, tmp_path):
    # A checkpoint missing a tensor (stock cannot load it either): the demo
    # checks it first, instead of running stock's arm and then failing in lily's.
    import os
    import shutil
    import subprocess
    import sys

    path = tmp_path / "refused"
    shutil.copytree(demo_checkpoint, path)
    weights = dict(mx.load(str(path / "model.safetensors")))
    weights.pop("language_model.model.layers.1.linear_attn.A_log")
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    env = {k: v for k, v in os.environ.items() if k != "MLX_LILY_TRACEBACK"}
    out = subprocess.run([sys.executable, "-m", "mlx_lily", "demo", "--model", str(path)],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 1, out.stdout + out.stderr
    errors = [line for line in out.stderr.splitlines() if not line.startswith("[mlx-lily]")]
    assert errors == ["mlx-lily: checkpoint is missing tensor "
                      "'language_model.model.layers.1.linear_attn.A_log' (expected shape (4,))"], out.stderr
    assert "stock mlx-lm" not in out.stdout and "Traceback" not in out.stderr


def test_a_large_random_checkpoint_is_written_only_when_asked(monkeypatch, tmp_path, capsys):
    """demo --shape qwen3.6-35b-a3b would write ~20 GB: without --yes and
    without a terminal to ask at, it says so and stops before writing."""
    from mlx_lily import demo as demo_module
    from mlx_lily.random_checkpoints import estimated_size_gb

    monkeypatch.setenv("MLX_LILY_CACHE", str(tmp_path))
    monkeypatch.setattr("sys.stdin.isatty", lambda: False)
    written = []
    monkeypatch.setattr(demo_module, "make_checkpoint", lambda **kw: written.append(kw))
    assert 15 < estimated_size_gb("qwen3.6-35b-a3b") < 25 and estimated_size_gb("demo") < 0.1
    assert demo_module.main(["--shape", "qwen3.6-35b-a3b"]) == 1
    err = capsys.readouterr().err
    assert "about 19 GB" in err and "--yes" in err and not written
    assert demo_module.may_write("qwen3.6-35b-a3b", yes=True)
    assert demo_module.may_write("demo", yes=False)  # small: no question
    monkeypatch.setattr("sys.stdin.isatty", lambda: True)
    monkeypatch.setattr("builtins.input", lambda prompt: "n")
    assert not demo_module.may_write("qwen3.6-35b-a3b", yes=False)
    monkeypatch.setattr("builtins.input", lambda prompt: "y")
    assert demo_module.may_write("qwen3.6-35b-a3b", yes=False)
