"""bench/ end to end on the demo shape at tiny lengths: both run modes and
--ops, checking the outputs are complete and well formed. Not a timing test:
throughputs only need to be positive.

The numerics check is real: on this machine every lily op runs its reference
(stock's own computation), so lily and stock must agree exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # the in-process tests import bench/
    sys.path.insert(0, str(REPO))
LENGTHS = [32, 64]
ROUNDS = 2
STEPS = 4


def run_bench(out: Path, *flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--out", str(out), *flags],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def outputs(out: Path, kind: str) -> dict:
    files = {p.suffix: p for p in out.iterdir() if p.name.startswith(f"{kind}-")}
    assert ".json" in files and ".md" in files, sorted(out.iterdir())
    return {"json": json.loads(files[".json"].read_text()), "md": files[".md"].read_text(),
            "png": files.get(".png")}


@pytest.fixture(scope="module", params=["fresh-process", "same-process"])
def ab_run(request, tmp_path_factory):
    out = tmp_path_factory.mktemp(request.param)
    flags = ["--lengths", "32,64", "--rounds", str(ROUNDS), "--decode-steps", str(STEPS)]
    if request.param == "same-process":
        flags.append("--same-process")
    else:  # through the workers' specs
        flags.append("--gpu-clocks")
    proc = run_bench(out, *flags)
    return request.param, proc, outputs(out, "ab")


def _mlx_lily_ops():
    from mlx_lily.kernels import OPS

    return OPS


def test_ab_json_is_complete(ab_run):
    mode, _, out = ab_run
    doc = out["json"]
    for key in ("machine", "software", "settings", "op_paths", "arms", "summary", "numerics", "files"):
        assert key in doc
    assert {"hostname", "os", "cpu", "memory_bytes", "accelerator"} <= doc["machine"].keys()
    assert {"python", "mlx", "mlx_lm", "mlx_lily", "git_revision"} <= doc["software"].keys()
    st = doc["settings"]
    assert st["mode"] == mode and st["lengths"] == LENGTHS and st["rounds"] == ROUNDS
    assert st["decode_steps"] == STEPS and st["prefill_step_size"] == 2048
    assert set(doc["op_paths"]) == set(_mlx_lily_ops())
    for info in doc["op_paths"].values():
        assert info["path"] in ("kernel", "reference") and info["reason"]


def test_ab_arms_raw_figures(ab_run):
    mode, _, out = ab_run
    arms = out["json"]["arms"]
    assert len(arms) == len(LENGTHS) * ROUNDS * 2
    for arm in arms:
        assert "error" not in arm, arm
        assert arm["prefill_tps"] > 0 and arm["decode_tps"] > 0
        assert arm["peak_memory_bytes"] > 0
        assert len(arm["tokens"]) == STEPS + 1  # the first token + the decode steps
        # Each arm really ran the engine it is labelled with.
        assert (arm["lily_layers"] > 0) == (arm["engine"] == "lily")
        # The decode's GPU clocks where asked for (fresh processes here).
        clocks = arm["decode_gpu_clocks"]
        if mode == "same-process":
            assert clocks == {"unavailable": "not asked for"}
        elif shutil.which("nvidia-smi") is None:
            assert clocks == {"unavailable": "no nvidia-smi"}
        else:
            assert "samples" in clocks or "no sample in the window" in clocks["unavailable"]
    assert out["json"]["settings"]["gpu_clocks"] == (mode == "fresh-process")
    # ABBA: lily leads in round 1, stock in round 2.
    for r, first in ((0, "lily"), (1, "stock")):
        in_round = sorted((a for a in arms if a["round"] == r), key=lambda a: a["order"])
        assert in_round[0]["engine"] == first


def test_ab_summary_and_table(ab_run):
    _, proc, out = ab_run
    doc, md = out["json"], out["md"]
    assert [row["length"] for row in doc["summary"]] == LENGTHS
    assert doc["flags"] == []
    for row in doc["summary"]:
        lily, stock = row["lily"], row["stock"]
        assert row["decode_ratio"] == pytest.approx(lily["decode_tps_median"] / stock["decode_tps_median"])
        assert row["prefill_ratio"] == pytest.approx(lily["prefill_tps_median"] / stock["prefill_tps_median"])
        # Greedy tokens repeat exactly across rounds.
        assert len(lily["digests"]) == ROUNDS and lily["digests_consistent"]
        assert len(stock["digests"]) == ROUNDS and stock["digests_consistent"]

    header = ("| length | decode lily | decode stock | ratio | prefill lily | prefill stock | ratio "
              "| kernels/token lily | kernels/token stock | MB/token lily | MB/token stock |")
    assert header in md and header in proc.stdout
    table = [line for line in md.splitlines() if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    table = table[: len(LENGTHS)]
    assert [line.split("|")[1].strip() for line in table] == [str(n) for n in LENGTHS]
    for line, row in zip(table, doc["summary"]):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 15
        assert float(cells[3]) == pytest.approx(row["decode_ratio"], abs=6e-4)
        assert float(cells[6]) == pytest.approx(row["prefill_ratio"], abs=6e-4)
        # One decode step's counts, in the summary beside the throughput and in the table.
        for engine, cell in (("lily", 7), ("stock", 8)):
            kernels = row[engine]["kernels_per_decode_token"]
            assert kernels > 0 and int(cells[cell].replace(",", "")) == kernels
            assert row[engine]["bytes_per_decode_token"] > row[engine]["bytes_token_must_read"] > 0
            # The host's share of a decode token: building its graph, in ms.
            host = row[engine]["host_ms_per_decode_token"]
            assert host > 0 and float(cells[11 if engine == "lily" else 12]) == pytest.approx(host, abs=6e-3)
            # The kernels' device time: none on this machine's CPU, and the reason with it.
            assert row[engine]["gpu_ms_per_decode_token"] is None and cells[13 if engine == "lily" else 14] == "-"
            assert row[engine]["gpu_time_notes"] == ["no GPU"]


def _reference_only(doc) -> bool:
    return all(info["path"] == "reference" for info in doc["op_paths"].values())


def test_ab_numerics_agree_on_reference_path(ab_run):
    _, _, out = ab_run
    doc = out["json"]
    num = doc["numerics"]
    assert num["positions"] == 256
    assert num["lily_layers"]["lily"] > 0 and num["lily_layers"]["stock"] == 0
    assert num["ppl_lily"] > 1 and num["ppl_stock"] > 1
    # The noise floor: stock against its own one-bf16-step nudge, reported.
    floor = num["noise_floor"]
    assert 0.0 <= floor["top1_agreement"] <= 1.0 and floor["kl_mean"] >= 0.0
    assert "Noise floor" in out["md"]
    if not _reference_only(doc):  # kernels (a GPU, or the emulator): close, not equal
        # Random weights give near-uniform distributions whose top-1 flips on
        # tiny differences, so only bound the divergence loosely here.
        assert 0.0 <= num["top1_agreement"] <= 1.0 and 0.0 <= num["kl_mean"] < 0.05
        return
    # Lily's reference is stock's computation: the engines must agree exactly.
    assert num["top1_agreement"] == 1.0
    assert num["kl_mean"] == pytest.approx(0.0, abs=1e-7)
    assert num["ppl_rel_diff"] == pytest.approx(0.0, abs=1e-7)
    for row in doc["summary"]:
        assert row["engines_tokens_match"]


def test_ab_plot(ab_run):
    _, _, out = ab_run
    pytest.importorskip("matplotlib")
    png = out["png"]
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out["json"]["files"]["plot"] == str(png)


def test_ops_mode(tmp_path):
    proc = run_bench(tmp_path, "--ops", "--shape", "demo", "--ops-chunk", "64", "--lengths", "32,64")
    out = outputs(tmp_path, "ops")
    doc, md = out["json"], out["md"]
    assert {"machine", "software", "settings", "op_paths", "rows"} <= doc.keys()
    assert doc["settings"]["chunk"] == 64 and doc["settings"]["contexts"] == [32, 64]
    ops = _mlx_lily_ops()
    assert {row["op"] for row in doc["rows"]} == set(ops)
    for row in doc["rows"]:
        assert "error" not in row, row
        assert row["stock_ms"] > 0
        if row["path"] == "reference":
            assert row["lily_ms"] is None
        else:
            assert row["lily_ms"] > 0 and row["speedup"] > 0
    attention = [r for r in doc["rows"] if r["op"] == "attention"]
    assert {(r["phase"], r["context"]) for r in attention} >= {("prefill", 32), ("decode", 64)}
    header = "| op | phase | context | tokens | path | lily ms | stock ms | speedup | lily ms in a graph |"
    assert header in md and header in proc.stdout
    # No GPU here: nothing is timed in a graph.
    assert not any("lily_graph_ms" in r or "stock_graph_ms" in r for r in doc["rows"])
    assert "reference only" in md


def test_ops_times_a_kernel_its_op_declines_beside_the_reference(monkeypatch):
    # Attention prefill on CUDA prefers MLX's sdpa; --ops still times the
    # kernel (the figure its issue tracks) and says which ran.
    import mlx_lily.kernels  # noqa: F401  (registers the ops)
    from bench import ops, report

    A = sys.modules["mlx_lily.kernels.attention.sdpa"]
    monkeypatch.setenv("MLX_LILY_KERNEL_BACKEND", "emulator")
    monkeypatch.setattr(A.attention, "prefers_reference", lambda backend, *a, **k: "measured faster")
    monkeypatch.setattr(ops, "time_call", lambda fn, args, kwargs: {"ms": 2.0, "min_ms": 2.0, "iters": 1})
    args, kwargs = A._prefill_check_inputs(7, 30, 4, 2, 32)[:4] + ("causal",), {}
    assert ops._declined_kernel_path(A.attention, args, kwargs) == ("emulator", "prefill")
    row = {"op": "attention", "phase": "prefill", "tokens": 7, "context": 30, "path": "reference",
           "lily_ms": None, "speedup": None, "stock_ms": 1.0, "declined_kernel_ms": 2.0, "kernels": "prefill"}
    (line,) = [l for l in report.ops_table([row]) if l.startswith("| attention")]
    assert "| reference | reference (its prefill kernel: 2.000) |" in line
    monkeypatch.setattr(A.attention, "prefers_reference", lambda backend, *a, **k: None)
    assert ops._declined_kernel_path(A.attention, args, kwargs) is None


def test_ops_times_short_calls_in_a_graph_on_a_gpu(monkeypatch):
    # One evaluation per call holds its launch and sync overhead; on a GPU the
    # short calls are also timed eight to a graph, as a model's layers run.
    from bench import ops, report
    from mlx_lily.toolchain import registry

    monkeypatch.setattr(registry, "gpu_backend", lambda: "cuda")
    timed = []
    monkeypatch.setattr(ops, "time_in_graph", lambda fn, args, kwargs: timed.append(fn) or 0.25)
    monkeypatch.setattr(ops, "time_call", lambda fn, args, kwargs: {"ms": 1.0, "min_ms": 1.0, "iters": 1})
    row = ops.run_case("router_topk", "decode", 1, None, ops.dims_for("demo"))
    assert row["stock_graph_ms"] == 0.25 and len(timed) == (2 if row["path"] == "kernel" else 1)
    (line,) = [l for l in report.ops_table([row]) if l.startswith("| router_topk")]
    assert line.endswith("| 0.250 |")
    monkeypatch.setattr(ops, "time_call", lambda fn, args, kwargs: {"ms": 50.0, "min_ms": 50.0, "iters": 1})
    assert "stock_graph_ms" not in ops.run_case("router_topk", "decode", 1, None, ops.dims_for("demo"))


def test_in_graph_timing_builds_every_call_before_timing():
    from bench import ops

    built = []
    ms = ops.time_in_graph(lambda x: built.append(1) or x + 1, (mx.zeros((4,)),), {}, calls=3, graphs=5)
    assert len(built) == 3 * (5 + 1) and ms > 0


# ----------------------------------------------------------- small pieces


def test_lengths_and_prompt():
    from bench.common import length_label, parse_lengths, prompt_ids

    assert parse_lengths("256,1K,4k,1K") == [256, 1024, 4096]
    assert [length_label(n) for n in (256, 1024, 131072)] == ["256", "1K", "128K"]
    ids = prompt_ids(5, 1000)
    assert ids.tolist() == [(i * 2654435761) % 2**32 % 1000 for i in range(5)]


def test_abba_plan():
    from bench.ab import fresh_plan

    plan = fresh_plan([1, 2], 2)
    assert [e for r, e, n in plan if n == 1] == ["lily", "stock", "stock", "lily"]


def test_numerics_detect_a_difference():
    """The numerics are not vacuous: a perturbed lily shows up in every figure."""
    from bench.measure import compare

    rng = np.random.default_rng(0)
    logits = rng.normal(size=(200, 50)).astype(np.float32)
    stock = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    lily_logits = logits + rng.normal(scale=2.0, size=logits.shape).astype(np.float32)
    lily = lily_logits - np.log(np.exp(lily_logits).sum(-1, keepdims=True))
    tokens = rng.integers(0, 50, size=200)
    same = compare(stock, stock, tokens)
    assert same["top1_agreement"] == 1.0 and same["kl_mean"] == 0.0
    diff = compare(lily, stock, tokens)
    assert diff["top1_agreement"] < 0.9 and diff["kl_mean"] > 0.1
    assert diff["ppl_rel_diff"] != 0.0


def test_plot_skipped_without_matplotlib(monkeypatch):
    from bench import report

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails
    assert report.ab_plot({"summary": []}, Path("unused.png")) is False


def test_oracle_mode(tmp_path, monkeypatch):
    # Both engines against the fp32 CPU oracle, on the reference path (pinned):
    # lily computes exactly what stock does, so every figure is equal, and the
    # oracle is a different computation, so the errors are not zero.
    monkeypatch.setenv("MLX_LILY_KERNEL_BACKEND", "reference")
    run_bench(tmp_path, "--oracle", "--shape", "small-alt", "--conditioned", "--oracle-tokens", "48")
    files = outputs(tmp_path, "oracle")
    doc = files["json"]
    engines = doc["engines"]
    assert set(engines) == {"lily", "stock"}
    for figures in engines.values():
        assert set(figures) == {"kl_mean", "kl_max", "top1"}
        assert 0 < figures["kl_mean"] <= figures["kl_max"] and 0 <= figures["top1"] <= 1
    assert engines["lily"] == engines["stock"]
    layers = doc["oracle"]["layers"]
    assert [r["layer"] for r in layers] == [0, 1, 2, 3]
    assert [r["kind"] for r in layers] == ["linear", "full", "linear", "full"]
    for r in layers:
        assert r["lily_rel_err"] == r["stock_rel_err"] > 0 and r["lily_no_worse"]
        for part in ("mixer", "moe", "moe_arith"):
            assert r[f"lily_{part}_rel_err"] == r[f"stock_{part}_rel_err"] > 0
        assert 0 <= r["routing_agreement"] <= 1
    assert doc["oracle"]["criterion"]["met"] and doc["settings"]["conditioned"]
    assert files["md"].count("\n| ") >= 2 + 2 + len(layers)


def test_prefill_at_depth_continues_the_same_prompt(tmp_path):
    # --depth-from: lily prefills the prompt's head for both engines, the
    # engine times the tail and decodes; on the reference path that gives
    # the tokens a whole prefill gives, for either engine.
    from bench.engines import load_shared, switch
    from bench.measure import lily_prefilled_cache, measure_arm

    model, vocab, _, _ = load_shared({"model": None, "shape": "demo", "seed": 0, "conditioned": False})
    for engine in ("stock", "lily"):
        switch(model, engine)
        whole = measure_arm(model, 96, vocab, 4)
        cache = lily_prefilled_cache(model, vocab, 64)
        assert sum(c.offset for c in cache if hasattr(c, "keys")) > 0
        tail = measure_arm(model, 96, vocab, 4, cache=cache, timed_from=64)
        assert tail["digest"] == whole["digest"], engine
        assert tail["prefill_tps"] == pytest.approx(32 / tail["prefill_s"])
        assert (model.layers[0].__class__.__name__.startswith("Lily")) == (engine == "lily")  # switched back


def test_ab_depth_arms_are_marked(tmp_path):
    run_bench(tmp_path, "--same-process", "--lengths", "32,96", "--depth-from", "64", "--depth-tail", "32",
              "--rounds", "1", "--decode-steps", "2", "--no-numerics", "--no-plot")
    out = outputs(tmp_path, "ab")
    doc, md = out["json"], out["md"]
    assert doc["settings"]["depth_from"] == 64 and doc["settings"]["depth_tail"] == 32
    rows = {r["length"]: r for r in doc["summary"]}
    assert rows[32]["prefill_method"] is None
    assert rows[96]["prefill_method"] == "last 32 tokens at depth 64 (lily prefilled the rest, untimed)"
    assert "| 96 |" in md and " †" in md and "Prefill at depth" in md
    assert rows[96]["engines_tokens_match"]


def test_cold_start_times_fresh_processes_of_both_engines(tmp_path):
    """bench --cold-start: two fresh processes per engine, each reaching its
    first token, in the JSON the issue asks for (engines.{lily,mlx}.*)."""
    proc = run_bench(tmp_path, "--cold-start", "--prompt", "8", "--decode", "1")
    (path,) = [p for p in tmp_path.iterdir() if p.name.startswith("cold-") and p.suffix == ".json"]
    doc = json.loads(path.read_text())
    assert set(doc["engines"]) == {"lily", "mlx"}
    for engine, result in doc["engines"].items():
        assert 0 < result["first_process_s"] <= result["first_process_reply_s"], engine
        assert 0 < result["second_process_s"] <= result["second_process_reply_s"], engine
        first, second = result["processes"]
        assert first["tokens"] == second["tokens"] and len(first["tokens"]) == 2
    assert "lily" in doc["engines"]["lily"]["processes"][0]  # lily's own counters
    assert "| lily |" in proc.stdout and "| mlx |" in proc.stdout


def test_decode_gpu_ms_sums_the_recorded_kernels_per_step(monkeypatch):
    """Where a device timer exists, the figure is the recorded kernels' device
    time divided by the steps run, and the steps advance the cache."""
    from bench import gpu_time
    from mlx_lily.random_checkpoints import build_model
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = build_model("demo", seed=0)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[1, 2, 3]]), cache=cache))

    def fake_kernel_times(run):
        run()
        return {"a": [100.0] * 8, "b": [300.0, 500.0]}

    monkeypatch.setattr(gpu_time, "why_unavailable", lambda: None)
    monkeypatch.setattr(gpu_time, "kernel_times", fake_kernel_times)
    ms, note = gpu_time.decode_gpu_ms(model, cache, token=5, steps=4)
    assert note is None and ms == pytest.approx((800.0 + 800.0) / 4 / 1e3)
    offsets = {c.offset for c in cache if hasattr(c, "offset")}
    assert offsets == {3 + 4}
    monkeypatch.setattr(gpu_time, "kernel_times", lambda run: {})
    assert gpu_time.decode_gpu_ms(model, cache, token=5, steps=2) == (None, "the profiler recorded no kernels")
