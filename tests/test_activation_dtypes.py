"""Checkpoints whose float tensors are fp16 or fp32 instead of bf16.

fp16: lily loads it, every op that runs its kernel on bf16 runs it on fp16
too (but the two whose matrix tiles multiply bf16 only: the prompt's
attention and the MoE prefill GEMMs, ``moe_experts``), and its logits stay
close to stock mlx-lm's. fp32: the ops without an fp32 kernel run their
references, and the model says so in one notice (none for bf16).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

import mlx_lily
from mlx_lily import kernels as K
from mlx_lily.kernels.dtypes import REFERENCE_FOR
from mlx_lily.toolchain.registry import BACKEND_ENV

from test_toolchain import emulator_or_skip

# Ids within the random checkpoints' 512-token vocabulary.
TOKENS = mx.array([[17, 301, 45, 499, 2, 77, 212, 8, 64, 123, 400, 5, 6, 7, 300, 31]])


def cast_checkpoint(src: Path, dst: Path, dtype) -> Path:
    """A copy of ``src`` with its bf16 tensors (scales, biases, norms,
    embeddings' scales ...) in ``dtype``; packed weights and the fp32 ones
    (A_log, as stock keeps it) as they are."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        weights = mx.load(str(f))
        weights = {k: v.astype(dtype) if v.dtype == mx.bfloat16 else v for k, v in weights.items()}
        mx.save_safetensors(str(f), weights, metadata={"format": "mlx"})
    return dst


@pytest.fixture(scope="module")
def fp16_checkpoint(tmp_path_factory, request):
    src = request.getfixturevalue("demo_conditioned_checkpoint")
    return cast_checkpoint(Path(src), tmp_path_factory.mktemp("ckpt") / "demo-fp16", mx.float16)


@pytest.fixture(scope="module")
def fp32_checkpoint(tmp_path_factory, request):
    src = request.getfixturevalue("demo_checkpoint")
    return cast_checkpoint(Path(src), tmp_path_factory.mktemp("ckpt") / "demo-fp32", mx.float32)


def test_an_fp16_checkpoint_runs_its_kernels_and_stays_close_to_stock(fp16_checkpoint, monkeypatch,
                                                                      fresh_notices, capsys, record_op_paths):
    emulator_or_skip()
    monkeypatch.setenv(BACKEND_ENV, "emulator")
    stock, _ = mlx_lily.load(str(fp16_checkpoint), backend="mlx")
    lily, _ = mlx_lily.load(str(fp16_checkpoint), backend="lily")
    cs, cl = make_prompt_cache(stock), make_prompt_cache(lily)
    prompt_paths = record_op_paths()
    got, want = lily(TOKENS[:, :10], cache=cl), stock(TOKENS[:, :10], cache=cs)
    assert got.dtype == want.dtype == mx.float16
    logits = [(got, want)]
    prompt_paths = {k: set(v) for k, v in prompt_paths.items()}
    decode_paths = record_op_paths()
    for t in range(10, 14):
        step = TOKENS[:, t : t + 1]
        logits.append((lily(step, cache=cl), stock(step, cache=cs)))
    # Every op that runs a kernel on bf16 ran it on fp16, in the prompt and
    # in decode, but for the tile kernels' prompt calls.
    kernel_ops = [n for n, op in K.OPS.items() if op.kernel is not None and op.in_model]
    tiles_only = {"moe_experts", "attention"}
    for name in kernel_ops:
        ran = prompt_paths.get(name, set()) | decode_paths.get(name, set())
        assert "kernel" in ran or name == "moe_experts", (name, ran, K.OPS[name].last_reason)
    assert prompt_paths["moe_experts"] == {"reference"} and prompt_paths["attention"] == {"reference"}
    assert all(paths == {"kernel"} for name, paths in decode_paths.items() if name not in tiles_only), decode_paths
    assert decode_paths["attention"] == {"kernel"}
    # Close to stock: the kernels sum in fp32 where stock's CPU ops sum fp16
    # products in fp16 (its quantized matmuls), so a few fp16 steps of the
    # logits' scale, as test_model.py allows for bf16 (LOGIT_ATOL 5e-2) with
    # fp16's finer step making it a looser bound here.
    for g, w in logits:
        scale = mx.abs(w.astype(mx.float32)).max().item()
        assert mx.abs(g.astype(mx.float32) - w.astype(mx.float32)).max().item() <= 2e-2 * max(scale, 1.0)
    # And the one notice names what stays on its reference.
    err = capsys.readouterr().err
    assert err.count("float16 activations:") == 1 and "moe_experts" in err


def test_an_fp32_checkpoint_says_once_which_ops_run_their_references(fp32_checkpoint, demo_checkpoint,
                                                                    monkeypatch, fresh_notices, capsys,
                                                                    record_op_paths):
    emulator_or_skip()
    monkeypatch.setenv(BACKEND_ENV, "emulator")
    lily, _ = mlx_lily.load(str(fp32_checkpoint), backend="lily")
    paths = record_op_paths()
    cache = make_prompt_cache(lily)
    assert lily(TOKENS[:, :8], cache=cache).dtype == mx.float32
    for t in range(8, 11):
        lily(TOKENS[:, t : t + 1], cache=cache)
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "float32 activations:" in line]
    assert len(lines) == 1, err
    for name in REFERENCE_FOR[mx.float32]:
        assert name in lines[0]
        assert paths.get(name, {"reference"}) == {"reference"}, (name, paths.get(name))
    assert "kernels take bfloat16 and float16" in lines[0]
    # Once per process and dtype: a second fp32 model says nothing more.
    again, _ = mlx_lily.load(str(fp32_checkpoint), backend="lily")
    again(TOKENS[:, :4])
    assert "activations:" not in capsys.readouterr().err
    # bf16: no such notice.
    bf16, _ = mlx_lily.load(str(demo_checkpoint), backend="lily")
    bf16(TOKENS[:, :4])
    assert "activations:" not in capsys.readouterr().err
