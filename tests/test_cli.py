"""The command lines as users type them, in subprocesses: mlx-lm's own
programs with --backend, the startup hook, and python -m mlx_lily."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ENV = {k: v for k, v in os.environ.items() if k not in ("MLX_LM_BACKEND", "MLX_LILY_HOOK")}


def run(args, env=None, timeout=300):
    return subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, env={**ENV, **(env or {})}
    )


def generated_text(stdout: str) -> str:
    """The text between mlx_lm.generate's two '==========' rulers."""
    parts = stdout.split("==========")
    assert len(parts) >= 3, stdout
    return parts[1]


def test_hook_is_installed():
    # The CLI tests below need the package installed (pip install .), which
    # puts mlx_lily_hook.pth into site-packages; the hook it imports must be
    # this checkout's (an older install tests an older hook).
    purelib = Path(sysconfig.get_paths()["purelib"])
    assert (purelib / "mlx_lily_hook.pth").exists(), "run: pip install -e '.[test]'"
    out = run([sys.executable, "-c", "import mlx_lily_hook; print(mlx_lily_hook.__file__)"])
    assert out.returncode == 0, out.stderr
    installed = Path(out.stdout.strip()).read_text()
    assert installed == (ROOT / "hook" / "mlx_lily_hook.py").read_text(), (
        f"{out.stdout.strip()} is not this checkout's hook: reinstall (pip install -e '.[test]')"
    )


def test_plain_import_is_untouched():
    # Whatever MLX_LM_BACKEND says: only mlx-lm's programs take it.
    code = (
        "import sys, mlx_lm, mlx_lm.utils as u;"
        "print('mlx_lily' in sys.modules, u.load_model.__module__, u.load_model.__qualname__)"
    )
    for env in ({}, {"MLX_LM_BACKEND": "lily"}):
        out = run([sys.executable, "-c", code], env)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == ["False", "mlx_lm.utils", "load_model"]
        assert out.stderr == ""


def test_env_does_not_break_importing_mlx_lily():
    # It used to crash with a circular import ("partially initialized module").
    code = "import mlx_lily; print(mlx_lily.is_enabled())"
    out = run([sys.executable, "-c", code], {"MLX_LM_BACKEND": "lily"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"  # not an mlx-lm program: untouched


def test_env_selects_lily_in_an_mlx_lm_program_even_if_mlx_lily_comes_first():
    # An mlx-lm program (argv[0] named like its console scripts) that imports
    # mlx_lily before mlx_lm.utils: the hook fires while mlx_lily is importing.
    code = "import sys; sys.argv[0] = 'mlx_lm.generate'; import mlx_lily; print(mlx_lily.is_enabled())"
    assert run([sys.executable, "-c", code], {"MLX_LM_BACKEND": "lily"}).stdout.strip() == "True"
    assert run([sys.executable, "-c", code], {"MLX_LM_BACKEND": "mlx"}).stdout.strip() == "False"
    off = {"MLX_LM_BACKEND": "lily", "MLX_LILY_HOOK": "0"}
    assert run([sys.executable, "-c", code], off).stdout.strip() == "False"


def test_help_lists_the_backend_flag():
    for command in (["mlx_lm.generate"], ["mlx_lm.server"], ["mlx_lm.chat"], ["mlx_lm.benchmark"],
                    [sys.executable, "-m", "mlx_lm", "generate"], [sys.executable, "-m", "mlx_lily", "generate"]):
        out = run([*command, "--help"])
        assert out.returncode == 0, out.stderr
        assert "--backend {lily,mlx}" in out.stdout, (command, out.stdout)
    off = run(["mlx_lm.generate", "--help"], {"MLX_LILY_HOOK": "0"})
    assert "--backend" not in off.stdout  # the hook is what adds it


def test_generate_lily_equals_stock(demo_checkpoint):
    common = ["--model", str(demo_checkpoint), "--prompt", "Tell me a story", "--max-tokens", "16", "--temp", "0"]
    lily = run(["mlx_lm.generate", *common, "--backend", "lily"])
    stock = run(["mlx_lm.generate", *common, "--backend", "mlx"])
    assert lily.returncode == 0 and stock.returncode == 0, lily.stderr + stock.stderr
    assert "runs on lily's model" in lily.stderr
    assert "lily" not in stock.stderr
    assert generated_text(lily.stdout) == generated_text(stock.stdout)


def test_generate_via_python_m_and_env(demo_checkpoint):
    common = ["--model", str(demo_checkpoint), "--prompt", "hi", "--max-tokens", "4"]
    out = run([sys.executable, "-m", "mlx_lm", "generate", *common, "--backend=lily"])
    assert out.returncode == 0, out.stderr
    assert "runs on lily's model" in out.stderr
    out = run([sys.executable, "-m", "mlx_lm.generate", *common], {"MLX_LM_BACKEND": "lily"})
    assert out.returncode == 0 and "runs on lily's model" in out.stderr, out.stderr


def test_unknown_backend_is_a_clear_error(demo_checkpoint):
    out = run(["mlx_lm.generate", "--model", str(demo_checkpoint), "--backend", "fast"])
    assert out.returncode == 2
    assert "unknown backend 'fast'" in out.stderr


def test_backend_lily_on_other_model_type_runs_stock(tmp_path):
    # A tiny qwen3 (dense) checkpoint: lily does not specialize it.
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3
    from mlx_lm.utils import save_config

    from mlx_lily.random_checkpoints import make_tokenizer

    config = dict(model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                  vocab_size=600, max_position_embeddings=512, rope_theta=1e4, tie_word_embeddings=True)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    save_config(config, tmp_path / "config.json")
    make_tokenizer().save_pretrained(tmp_path)
    out = run(["mlx_lm.generate", "--model", str(tmp_path), "--prompt", "hi", "--max-tokens", "3", "--backend", "lily"])
    assert out.returncode == 0, out.stderr
    assert out.stderr.count("does not specialize model type 'qwen3'; running stock mlx-lm") == 1


def test_mlx_lily_generate_and_demo_and_doctor(demo_checkpoint, tmp_path):
    out = run([sys.executable, "-m", "mlx_lily", "generate", "--model", str(demo_checkpoint),
               "--prompt", "hi", "--max-tokens", "4"])
    assert out.returncode == 0 and "runs on lily's model" in out.stderr, out.stderr

    for kernels, says in (("reference", "No lily op ran a kernel here"),
                          ("emulator", "Lily ran kernels for ")):
        demo = run([sys.executable, "-m", "mlx_lily", "demo", "--max-tokens", "8"],
                   {"MLX_LILY_CACHE": str(tmp_path), "MLX_LILY_KERNEL_BACKEND": kernels})
        assert demo.returncode == 0, demo.stdout + demo.stderr
        if kernels == "reference":
            assert "greedy tokens agree: yes" in demo.stdout
        else:  # fp32-summing kernels against stock's bf16 CPU sums: a near tie may flip
            assert "greedy tokens agree: yes" in demo.stdout or "This is not an error." in demo.stdout
        assert says in demo.stdout, demo.stdout
        if kernels == "emulator":
            ran = next(line for line in demo.stdout.splitlines() if line.startswith(says))
            assert "gated_delta" in ran and "router_topk" in ran, ran
        assert demo.stdout.count("tok/s") == 4  # prompt and generation, both engines

    doctor = run([sys.executable, "-m", "mlx_lily", "doctor"])
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    from mlx_lily.kernels import OPS

    for name in OPS:
        # Its path and its self-check (whole names: gated_delta_decode is not gated_delta).
        assert len(re.findall(rf"\b{name}\b", doctor.stdout)) == 2, name
    assert "all ops ok" in doctor.stdout
    assert "decode       one token of one sequence" in doctor.stdout


def test_benchmark_and_chat_take_the_flag(demo_checkpoint):
    bench = run(["mlx_lm.benchmark", "--model", str(demo_checkpoint), "--backend", "lily",
                 "-p", "32", "-g", "4", "-n", "1"])
    assert bench.returncode == 0, bench.stderr
    assert "runs on lily's model" in bench.stderr and "generation_tps" in bench.stdout
    chat = subprocess.run(
        ["mlx_lm.chat", "--model", str(demo_checkpoint), "--backend", "lily", "--max-tokens", "4"],
        input="q\n", capture_output=True, text=True, timeout=300, env=ENV,
    )
    assert chat.returncode == 0, chat.stderr
    assert "runs on lily's model" in chat.stderr


def test_backend_without_a_value_says_so_everywhere(demo_checkpoint):
    # The hook's message, from every entry point that takes --backend; a flag
    # after --backend is not its value, and --backend= is empty.
    model = ["--model", str(demo_checkpoint), "--prompt", "hi", "--max-tokens", "1"]
    for command in (["mlx_lm.generate"], ["mlx_lm.server"], [sys.executable, "-m", "mlx_lm", "generate"],
                    [sys.executable, "-m", "mlx_lily", "generate"], [sys.executable, "-m", "mlx_lily", "serve"]):
        for args in ([*model, "--backend"], ["--backend", *model], [*model, "--backend="]):
            out = run([*command, *args], timeout=120)
            assert out.returncode == 2, (command, args, out.stderr)
            assert out.stderr.strip().splitlines() == ["mlx-lily: --backend needs a value: lily or mlx"], (
                command, args, out.stderr)
    out = run([sys.executable, "-m", "mlx_lily", "generate", *model, "--backend", "fast"])
    assert out.returncode == 2 and out.stderr.strip() == "mlx-lily: unknown backend 'fast': use lily or mlx"
