"""Lily under mlx-lm's tensor and pipeline parallelism, two ranks on this
machine (MLX's ring backend on 127.0.0.1; bench/dist.py's ``launch_local``
does what ``mlx.launch -n 2`` does): lily's sharded model generates stock's
sharded greedy tokens, alone and in a batch, and no attention, Gated DeltaNet
or MoE call takes stock's code; a rank that fails gives an error naming it,
never a hang."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # bench/ is not in the wheel
    sys.path.insert(0, str(REPO))

from bench.dist import RankFailed, launch_local
from mlx_lily.layers import sharded

WORKER = str(Path(__file__).with_name("dist_worker.py"))
KINDS = {"Gated DeltaNet", "full attention", "MoE"}


def _run(checkpoint, parallel: str, timeout: float = 150.0) -> list:
    outs = launch_local([sys.executable, WORKER, "--model", str(checkpoint), "--parallel", parallel,
                         "--tokens", "5"], n=2, timeout=timeout)
    return [json.loads(out.strip().splitlines()[-1]) for out in outs]


def _check_same_as_stock(results: list) -> None:
    for r in results:
        assert r["size"] == 2
        assert r["lily"]["alone"] == r["mlx"]["alone"], f"rank {r['rank']}"
        assert r["lily"]["batched"] == r["mlx"]["batched"], f"rank {r['rank']}"
        stock = [p for p in r["paths"] if p["path"] == "stock"]
        assert not stock, f"rank {r['rank']}: calls on stock's code: {stock}"
    # Both ranks print the same tokens (rank 0's are the model's output).
    assert results[0]["lily"] == results[1]["lily"]


def _kinds(record: dict, path_prefix: str) -> set:
    return {p["layer"] for p in record["paths"] if p["path"].startswith(path_prefix)}


def test_tensor_parallel_lily_gives_stocks_text(demo_checkpoint):
    results = _run(demo_checkpoint, "tensor")
    _check_same_as_stock(results)
    for r in results:
        assert r["split"]["tensor"] == 2 and r["split"]["pipeline"] == 1
        # Prompts on lily's layers, decode tokens in the compiled segments
        # (with their all_sums inside), every kind of layer on each rank.
        assert _kinds(r, "lily") - {"head"} == KINDS
        # The server's decode (batch caches): the head's vocabulary slice on
        # lily's GEMV, gathered as stock gathers it (one stream keeps stock's
        # head off CUDA: language_model.ONE_STREAM_BACKENDS).
        assert {p["batch"] for p in r["paths"] if p["layer"] == "head" and p["path"] == sharded.SHARDED_HEAD
                and p["step"] == "decode"} == {2}, f"rank {r['rank']}"
        assert {p["layer"] for p in r["paths"] if p["step"] == "decode" and p["batch"] == 1
                and p["path"] in ("lily decode segments", "lily whole decode step", "lily fused decode")} == KINDS
        # The MoE decode inside them: the fused chain without the residual,
        # all_sum, then the residual (not lily's unfused MoE ops).
        assert {"layer": "MoE", "path": sharded.SHARDED_MOE_DECODE, "batch": 1, "step": "decode", "mask": "none",
                "cache": "none"} in r["paths"], f"rank {r['rank']}"


def test_pipeline_lily_gives_stocks_text(demo_checkpoint):
    results = _run(demo_checkpoint, "pipeline")
    _check_same_as_stock(results)
    ranges = sorted(tuple(r["split"]["layers"]) for r in results)
    assert ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] == 4
    for r in results:
        assert r["split"]["pipeline"] == 2
        # The rank's own layers decode on their fused steps.
        assert "lily fused decode" in {p["path"] for p in r["paths"] if p["step"] == "decode"}


def test_a_rank_that_dies_is_named(demo_checkpoint):
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"rank 1 of 2 exited with status 1(.|\n)*rank 1 stops on purpose"):
        launch_local([sys.executable, WORKER, "--model", str(demo_checkpoint), "--parallel", "tensor", "--die"],
                     n=2, timeout=60)
    assert time.monotonic() - start < 60


def test_a_rank_that_never_joins_times_out():
    # Rank 1 never starts MLX: rank 0 waits in the ring's connect; the deadline stops both.
    code = "import os, time, mlx.core as mx\n" \
           "time.sleep(60) if os.environ['MLX_RANK'] == '1' else mx.distributed.init(backend='ring', strict=True)"
    start = time.monotonic()
    with pytest.raises(RankFailed, match=r"still running after 4 s"):
        launch_local([sys.executable, "-c", code], n=2, timeout=4)
    assert time.monotonic() - start < 20


def test_a_rank_that_fails_to_start_is_named():
    code = "import os, sys, mlx.core as mx\n" \
           "sys.exit(3) if os.environ['MLX_RANK'] == '1' else mx.distributed.init(backend='ring', strict=True)"
    with pytest.raises(RankFailed, match=r"rank 1 of 2 exited with status 3"):
        launch_local([sys.executable, "-c", code], n=2, timeout=60)


def test_sharded_switch_off_gives_stock(monkeypatch):
    """MLX_LILY_SHARDED=0: a sharded layer runs stock's code (the reason
    names the switch); a whole layer is unaffected."""
    import mlx.core as mx

    class Module:
        sharding_group = mx.distributed.init()
        num_k_heads = num_v_heads = 2

    assert sharded.why_stock(Module()) is None
    monkeypatch.setenv(sharded.SHARDED_ENV, "0")
    assert "MLX_LILY_SHARDED=0" in sharded.why_stock(Module())
    Module.sharding_group = None
    assert sharded.why_stock(Module()) is None


@pytest.mark.parametrize("shape, layers", [("qwen3.5-397b-a17b", 60), ("qwen3.5-397b-a17b-4l", 4)])
def test_large_shapes(shape, layers):
    """The family's largest configuration and its reduced-depth variant:
    lily's config checks pass, the layer count is the shape's, and the full
    model's parameters (drawn lazily, never evaluated) come to the published
    397B, about 223 GB at 4 bits."""
    from mlx_lily.models.qwen3_5_moe import check_config
    from mlx_lily.random_checkpoints import SHAPES, estimated_size_gb, model_config

    text = model_config(shape)["text_config"]
    check_config(text)
    assert text["num_hidden_layers"] == layers
    assert {k: v for k, v in SHAPES[shape].items() if k != "num_hidden_layers"} == \
        {k: v for k, v in SHAPES["qwen3.5-397b-a17b"].items() if k != "num_hidden_layers"}
    if layers == 60:
        assert 222 < estimated_size_gb(shape) < 225  # 4.5 bits a parameter: 396-397B parameters


def test_doctor_one_process_and_rank_paths(demo_checkpoint):
    """Without a group, doctor says so; a whole model's rank lines list every
    kind of layer on lily's ops (under mlx.launch each rank prints its own)."""
    import mlx_lily
    from mlx_lily.doctor import distributed

    assert distributed()[0].startswith("one process")
    model, _ = mlx_lily.load(str(demo_checkpoint))
    lines = sharded.rank_paths(model)
    assert lines[0] == "rank 0: layers 0-3, not split"
    assert {line.split(":")[0].strip() for line in lines[1:]} == KINDS
    assert all("lily's ops, decode fused" in line for line in lines[1:])


def test_bench_dist_writes_summary_rows(demo_checkpoint, tmp_path):
    """bench/dist.py's A/B on two CPU ranks: one summary row per split and
    length, each engine with its decode and prefill rates."""
    from bench import dist

    out = tmp_path / "dist-demo.json"
    assert dist.main(["--model", str(demo_checkpoint), "--shape", "demo", "--parallel", "tensor",
                      "--lengths", "16", "--tokens", "4", "--timeout", "150", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["summary"]
    assert [(r["parallel"], r["length"]) for r in rows] == [("tensor x2", 16)]
    for engine in ("lily", "stock"):
        assert set(rows[0][engine]) == {"decode_tps", "prefill_tps"} and rows[0][engine]["decode_tps"] > 0
