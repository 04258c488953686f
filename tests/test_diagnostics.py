"""Diagnostics that run on any machine: turned_off.py finds the kernel
instances a first-use check turned off and judges a captured call against
the fp32 oracle; host_cost.py measures a decode step's host work with the
kernels stubbed; decode_split.py splits a decode step's host time by part;
launch_cost.py times chains of launches. bandwidth.py needs PyTorch on CUDA
and says so."""

from __future__ import annotations

import os

import mlx.core as mx
import pytest

from bench.diagnostics.numerics.turned_off import capture_turned_off, distance, judge
from mlx_lily.kernels.gated_delta.decode import gated_delta_decode_kernel
from mlx_lily.toolchain.registry import BACKEND_ENV

from test_gated_delta_decode import _cuda_case
from test_toolchain import emulator_or_skip


def test_judge_puts_the_kernel_and_the_references_beside_the_oracle():
    emulator_or_skip()
    args, _ = _cuda_case()
    runs = judge(gated_delta_decode_kernel, args, {}, "emulator")
    oracle = runs["fp32 oracle"]
    # The kernel rounds as MLX's CPU ops do: the same output, close to fp32.
    assert mx.array_equal(runs["kernel"][0], runs["reference on the CPU"][0]).item()
    assert distance(runs["kernel"][0], oracle[0]) < 0.05
    assert distance(oracle[0] * 1.1, oracle[0]) == pytest.approx(0.1, rel=1e-3)


def test_capture_finds_an_instance_its_check_turned_off(monkeypatch):
    emulator_or_skip()
    monkeypatch.setenv(BACKEND_ENV, "emulator")
    gated_delta_decode_kernel.forget()
    assert gated_delta_decode_kernel.ready_on("emulator")[0]  # its self-check, as it is
    # Then a contract no result meets: the first decode call's instance goes off.
    monkeypatch.setattr(gated_delta_decode_kernel, "agree", lambda got, want, *a, **k: "always off")
    try:
        captured = capture_turned_off(tokens=8, decode_steps=2)
    finally:
        gated_delta_decode_kernel.forget()
    assert list(captured) == ["gated_delta_decode"]
    kernel, args, kwargs, why = captured["gated_delta_decode"]
    assert kernel is gated_delta_decode_kernel and "always off" in why
    assert args[0].shape[:2] == (1, 1)  # a decode call: one token


def test_host_cost_stubs_the_kernels_and_puts_them_back(tmp_path, capsys):
    from bench.diagnostics.decode import host_cost
    from mlx_lily.toolchain import kernel, registry

    before = (registry.gpu_backend, kernel.Kernel._build, kernel.Kernel.ready_on)
    assert host_cost.main(["--layers", "4", "--steps", "2", "--rounds", "2", "--out", str(tmp_path)]) == 0
    assert (registry.gpu_backend, kernel.Kernel._build, kernel.Kernel.ready_on) == before
    table = (tmp_path / "host_cost.txt").read_text()
    # The stubbed step took lily's default decode path, as on a GPU.
    assert "path: lily whole decode step" in table and "| whole step |" in table
    # One step's launches by kernel and inputs (4 layers: three DeltaNet, one
    # attention): a recurrence launch per DeltaNet layer with its 12 inputs,
    # one attention launch with queries, keys, values, scale and the gate.
    assert "| gated_delta_decode | 3 | 12.0 |" in table and "| attention_decode | 1 | 5.0 |" in table
    assert "without the weights checks" in table and "| in segments |" in table
    assert "in segments, without the attention ops" in table
    assert "| on the server's caches, one row |" in table
    assert "on the server's caches: lily batched decode step;" in table
    # Every variant ran its compiled form: none failed over to layer by layer
    # (a stand-in attention that refused the output gate once did, silently
    # timing another path).
    assert "failed" not in capsys.readouterr().err


def test_spec_host_cost_builds_a_round_s_parts_on_their_fast_paths(tmp_path, monkeypatch):
    from bench.diagnostics.decode import spec_host_cost
    from mlx_lily.layers import verify_step
    from mlx_lily.toolchain import kernel, registry

    taken = {"verify": 0, "head": 0}
    real_verify, real_head = verify_step.verify, verify_step.head_rows

    def spy_verify(*args, **kwargs):
        out = real_verify(*args, **kwargs)
        taken["verify"] += out is not None
        return out

    def spy_head(*args):
        out = real_head(*args)
        taken["head"] += out is not None
        return out

    monkeypatch.setattr(verify_step, "verify", spy_verify)
    monkeypatch.setattr(verify_step, "head_rows", spy_head)
    before = (registry.gpu_backend, kernel.Kernel._build, kernel.Kernel.ready_on)
    assert spec_host_cost.main(["--layers", "4", "--calls", "2", "--rounds", "1", "--out", str(tmp_path)]) == 0
    assert (registry.gpu_backend, kernel.Kernel._build, kernel.Kernel.ready_on) == before
    # The pass and the head's rows path took their calls (as on a GPU), not the model's own ops.
    assert taken["verify"] > 0 and taken["head"] > 0
    table = (tmp_path / "spec_host_cost.txt").read_text()
    for row in ("| decode step |", "| verify pass, 2 positions |", "| verify pass, 4 positions |",
                "| head's draft, 2 positions |"):
        assert row in table


def test_launch_cost_times_chains_of_launches(tmp_path):
    from bench.diagnostics.decode import launch_cost

    # The chain really is N launches of x + 1.
    assert launch_cost.chain(lambda x: x + 1, 5)(mx.zeros((launch_cost.WIDTH,))).tolist() == [5.0] * 32
    with pytest.raises(SystemExit):
        launch_cost.main(["--launches", "8"])  # one count gives no slope
    assert launch_cost.main(["--launches", "4,16", "--steps", "3", "--out", str(tmp_path)]) == 0
    table = (tmp_path / "launch_cost.txt").read_text()
    assert "| MLX add, op by op |" in table and "N = 16" in table


def test_launch_cost_s_lily_gemv_row_chains_the_model_s_decode_gemv(emulator_backend):
    """The --lily-gemv row's op: the model's decode GEMV (here on the
    emulator), W x, its output the next launch's x."""
    from bench.diagnostics.decode import launch_cost

    D = launch_cost.GEMV_WIDTH
    gemv = launch_cost.lily_gemv()
    x = (mx.random.normal((1, 1, D), key=mx.random.key(3))).astype(mx.bfloat16)
    y = gemv(x)
    w = mx.random.normal((D, D), key=mx.random.key(0)).astype(mx.bfloat16) * 0.02
    wq = mx.dequantize(*mx.quantize(w, group_size=64, bits=4), group_size=64, bits=4)
    want = x.astype(mx.float32) @ wq.astype(mx.float32).T
    assert y.shape == x.shape and y.dtype == mx.bfloat16
    assert mx.allclose(y.astype(mx.float32), want, atol=2e-2, rtol=2e-2).item()
    assert launch_cost.chain(gemv, 2)(x).shape == x.shape


def test_decode_split_times_each_part_and_puts_the_model_back():
    """The split's parts are timed inside the build, the launch and wait
    after it; the segmented path ran (its parts took time), and every
    patched method and the caches' writes are the originals again."""
    from bench.diagnostics.decode import decode_split
    from bench.engines import load_shared, switch
    from bench.measure import prefilled_cache
    from mlx_lily.layers import text_model

    model, vocab, _, _ = load_shared({"model": None, "shape": "demo", "seed": 0, "conditioned": False})
    switch(model, "lily")
    cache = prefilled_cache(model, vocab, 16)
    names = ("_segment", "_weights_version", "_segment_masks")
    before = (text_model.K, *(text_model.LilyTextModel.__dict__[n] for n in names))
    split = decode_split.split_steps(model, cache, 3)
    assert (text_model.K, *(text_model.LilyTextModel.__dict__[n] for n in names)) == before
    assert all("update_and_fetch" not in vars(c) for c in cache)
    for part in decode_split.PARTS:
        assert 0 <= split[part] <= split["build"], part
    assert split["segment calls"] > 0 and split["attention ops"] > 0 and split["KV-cache writes"] > 0
    assert split["weights check"] > 0 and split["eligibility and masks"] > 0
    collections = []
    times = decode_split.generate_token_ms(model, mx.array([1, 2]), cache, 4, collections)
    assert len(times) == 4 and all(t > 0 for t in times)
    assert "tok/s" in decode_split.describe_tokens(times)
    assert f"{len(collections)} garbage collection" in decode_split.describe_tokens(times, collections)
    assert "1 garbage collection," in decode_split.describe_tokens(times, [0.001])


def test_decode_split_rounds_report_each_round(tmp_path):
    """--rounds N: one column of the split per round and one decode line
    after each, on the same cache."""
    from bench.diagnostics.decode import decode_split

    decode_split.main(["--shape", "demo", "--context", "16", "--steps", "2", "--rounds", "2",
                       "--out", str(tmp_path)])
    text = (tmp_path / "decode_split.txt").read_text()
    assert "| phase | round 1 | round 2 |" in text
    assert "| - weights check |" in text and text.count("after round") == 2
    assert "garbage collection" in text


def test_collector_time_counts_each_collection():
    import gc

    from bench.diagnostics.decode.decode_split import collector_time

    spent = []
    with collector_time(spent):
        gc.collect()
        gc.collect()
    gc.collect()  # outside the block: not counted
    assert len(spent) == 2 and all(s >= 0 for s in spent)


def test_bandwidth_says_what_it_needs_without_pytorch_on_cuda(capsys, monkeypatch):
    import builtins

    from bench.diagnostics.tuning import bandwidth

    real_import = builtins.__import__

    def no_torch(name, *args, **kwargs):
        if name == "torch":
            raise ImportError("No module named 'torch'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_torch)
    assert bandwidth.main([]) == 2
    assert "needs PyTorch with CUDA" in capsys.readouterr().out


def test_decode_graph_lists_the_nodes_of_one_decode_step(tmp_path):
    from bench.diagnostics.decode import decode_graph

    assert decode_graph.main(["--shape", "demo", "--context", "16", "--first", "3", "--out", str(tmp_path)]) == 0
    lines = (tmp_path / "decode_graph.txt").read_text().splitlines()
    assert lines[0].endswith(" nodes") and int(lines[0].split()[0]) > 100
    assert "SliceUpdate" in lines[1]  # the KV caches' writes
    assert len(lines) == 2 + 3 and " -> " in lines[2]


def test_decode_profile_gives_lily_kernels_their_bytes_and_bandwidth():
    """The profile's table: each custom kernel's bytes per launch from the
    step's traced graph (bench/counts.py), matched to the profiler's name by
    its built name, GB/s from its device time, and the share of the peak."""
    from bench.diagnostics.decode.decode_profile import _report, call_bytes, custom_kernel_bytes

    def kernel(name):
        return mx.fast.metal_kernel(name=name, input_names=["a"], output_names=["o"], source="")

    small, large = kernel("small_1"), kernel("small_12")
    x = mx.zeros((4, 8))
    mx.eval(x)

    def step(a):
        run = lambda k, shape: k(inputs=[a], grid=(32, 1, 1), threadgroup=(32, 1, 1),  # noqa: E731
                                 output_shapes=[shape], output_dtypes=[mx.float32])[0]
        return run(small, (4, 8)).sum() + run(large, (1000, 1000)).sum()

    per_call = custom_kernel_bytes(step, x)
    assert per_call == {"custom_kernel_small_1_float_float": (32 + 32) * 4,
                        "custom_kernel_small_12_float_float": (32 + 10**6) * 4}
    # The longest built name the profiler's name contains; MLX's own kernels have none.
    assert call_bytes("mlx::core::cu::custom_kernel_small_12_float_float<1>", per_call) == (32 + 10**6) * 4
    assert call_bytes("mlx::core::cu::custom_kernel_small_1_float_float", per_call) == 64 * 4
    assert call_bytes("void mlx::core::cu::gather<float>", per_call) is None
    kernels = {"mlx::core::cu::custom_kernel_small_12_float_float": [2.0, 2.0],  # 4 MB in 2 us: 2000 GB/s
               "void mlx::core::cu::gather<float>": [1.0, 1.0]}
    lines = _report("lily", 1.0, kernels, 2, per_call, peak=4000.0)
    row = next(line for line in lines if "small_12" in line)
    assert row.split()[-3:] == ["4.00", "2000", "50%"]
    gather = next(line for line in lines if "gather" in line)
    assert gather.split()[-1] == "0.001"  # ms per step, no bytes or rate


def test_decode_split_times_the_servers_batched_step(tmp_path, monkeypatch):
    """--batch: the server's step on its batch caches, split (the batched
    step is its own part) and pipelined, one column per stream count."""
    from bench.diagnostics.decode import decode_split

    emulator_or_skip()
    monkeypatch.setenv(BACKEND_ENV, "emulator")
    assert decode_split.main(["--shape", "demo", "--context", "12", "--steps", "2", "--batch", "1,2",
                              "--out", str(tmp_path)]) == 0
    text = (tmp_path / "decode_split_batch.txt").read_text()
    assert "| phase | B = 1 | B = 2 |" in text and "Pipelined" in text
    row = next(line for line in text.splitlines() if line.startswith("| - batched step |"))
    assert all(float(v) > 0 for v in row.strip("|").split("|")[1:])


def test_sdpa_first_call_times_each_shape_first_and_later(tmp_path, monkeypatch):
    import json

    from bench.diagnostics.prefill import sdpa_first_call

    monkeypatch.setattr(sdpa_first_call, "WARMUP_SHAPE", (8, 16))
    monkeypatch.setattr(sdpa_first_call, "SHAPES", (("small", 12, 40), ("smaller", 3, 9)))
    monkeypatch.setattr(sdpa_first_call, "REPEATS", 1)
    assert sdpa_first_call.main(["--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "sdpa_first_call.json").read_text())["rows"]
    assert [(r["queries"], r["keys"]) for r in rows] == [(12, 40), (3, 9)]
    assert all(r["first_ms"] > 0 and r["later_ms"] > 0 for r in rows)
    assert "| small | 12 | 40 |" in (tmp_path / "sdpa_first_call.md").read_text()


def test_moe_decode_sweep_checks_each_rows_per_pass_and_restores_the_default(tmp_path):
    import json

    from bench.diagnostics.tuning import moe_decode_sweep
    from mlx_lily.kernels.moe import decode

    emulator_or_skip()
    default = decode.GATE_UP_GROUP
    defaults = (decode.GATE_UP_SIMD_GROUPS, decode.DOWN_SIMD_GROUPS, decode.DOWN_ROWS_PER_SG)
    code = moe_decode_sweep.main(["--out", str(tmp_path), "--backend", "emulator", "--dims", "128,16,3,64,128",
                                  "--batch", "1,5", "--groups", "1,16"])
    assert code == 0 and decode.GATE_UP_GROUP == default
    record = json.loads((tmp_path / "moe-decode-sweep.json").read_text())
    assert [r["batch"] for r in record["rows"]] == [1, 5] and record["groups"] == [1, 16]
    for r in record["rows"]:
        assert set(r["groups"]) == {"group 1", "group 16"} and all(e["same_bits"] for e in r["groups"].values())
        assert r["fastest"] in ("1", "16") and r["expert_bytes"] > 0 and r["contract"] == "met"
    # --launch adds gate/up's and down's launch shapes, each the same bits.
    choices = moe_decode_sweep.variants([1], True)
    assert "gate_up sg 16" in choices and choices["down sg 2 x 8"] == {"DOWN_SIMD_GROUPS": 2, "DOWN_ROWS_PER_SG": 8,
                                                                      "DOWN_BY_BATCH": False,
                                                                      "COMBINED_DOWN_MAX_ROWS": 0}
    picked = {label: choices[label] for label in ("group 1", "gate_up sg 4", "down sg 4 x 1")}
    row = moe_decode_sweep.sweep(3, picked, "emulator", (128, 16, 3, 64, 128), False)
    assert all(e["same_bits"] for e in row["groups"].values()) and row["contract"] == "met"
    assert (decode.GATE_UP_SIMD_GROUPS, decode.DOWN_SIMD_GROUPS, decode.DOWN_ROWS_PER_SG) == defaults
    assert decode.DOWN_BY_BATCH is True
    # "route apart": the default SIMD groups, route and gate/up as two launches at every B.
    assert choices["route apart"] == {"ROUTED_MAX_ROWS": 0}
    assert choices["routed rows 4"] == {"ROUTED_ROWS_PER_SG": 4, "ROUTED_ROWS_BY_BATCH": False, "ROUTED_MAX_ROWS": 4}
    assert choices["gate_up rows 2"] == {"GATE_UP_ROWS_PER_SG": 2, "ROUTED_MAX_ROWS": 0}
    apart = moe_decode_sweep.sweep(2, {label: choices[label] for label in ("group 1", "route apart", "routed rows 8")},
                                   "emulator",
                                   (128, 16, 3, 64, 128), False)
    assert all(e["same_bits"] for e in apart["groups"].values()) and decode.ROUTED_MAX_ROWS == 1
    assert decode.ROUTED_ROWS_PER_SG == 1 and decode.ROUTED_ROWS_BY_BATCH is True
    # "down apart": down and the combine as two launches; "combined down": as
    # one at every B, and its launch shapes. The same bits.
    assert choices["down apart"] == {"COMBINED_DOWN_MAX_ROWS": 0}
    assert choices["combined down sg 2"] == {"COMBINED_DOWN_MAX_ROWS": decode.MAX_BATCH,
                                             "COMBINED_DOWN_SIMD_GROUPS": 2}
    assert choices["combined down rows 16"] == {"COMBINED_DOWN_MAX_ROWS": decode.MAX_BATCH, "COMBINED_DOWN_ROWS": 16}
    for rows in (1, 3):
        both = moe_decode_sweep.sweep(rows, {label: choices[label] for label in (
            "group 1", "down apart", "combined down", "combined down sg 2", "combined down rows 1")},
            "emulator", (128, 16, 3, 64, 128), False)
        assert all(e["same_bits"] for e in both["groups"].values()) and both["contract"] == "met"
    assert (decode.COMBINED_DOWN_MAX_ROWS, decode.COMBINED_DOWN_SIMD_GROUPS, decode.COMBINED_DOWN_ROWS) == (2, None, 4)
    # --cold: the timed calls cycle over weight sets; the first set is checked as before.
    cold = moe_decode_sweep.sweep(2, {"group 1": choices["group 1"]}, "emulator", (128, 16, 3, 64, 128), False, cold=2)
    assert cold["weight_sets"] == 2 and cold["contract"] == "met" and cold["groups"]["group 1"]["chain_us"] > 0
    with pytest.raises(SystemExit):
        moe_decode_sweep.main(["--out", str(tmp_path), "--backend", "emulator", "--cold", "1"])
    # --only: the choices whose labels start with the prefixes given.
    code = moe_decode_sweep.main(["--out", str(tmp_path / "only"), "--backend", "emulator", "--dims",
                                  "128,16,3,64,128", "--batch", "2", "--groups", "1", "--launch",
                                  "--only", "group 1,routed rows 2"])
    assert code == 0
    only = json.loads((tmp_path / "only" / "moe-decode-sweep.json").read_text())
    assert list(only["rows"][0]["groups"]) == ["group 1", "routed rows 2"]
    with pytest.raises(SystemExit):
        moe_decode_sweep.main(["--out", str(tmp_path), "--backend", "emulator", "--launch", "--only", "nothing"])
    # Five rows pick more distinct experts than one: more bytes to read.
    assert record["rows"][1]["expert_bytes"] > record["rows"][0]["expert_bytes"]
    assert "| 5 |" in (tmp_path / "moe-decode-sweep.md").read_text()
    with pytest.raises(SystemExit):
        moe_decode_sweep.main(["--out", str(tmp_path), "--backend", "emulator", "--groups", "3"])


def test_host_placement_reads_the_topology_and_times_each_placement(tmp_path):
    from bench.diagnostics.decode import host_placement as hp

    assert hp.parse_cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert hp._ranges([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    # A fake machine: 4 CPUs, two cores of two hardware threads, two NUMA nodes.
    cpu, node = tmp_path / "cpu", tmp_path / "node"
    for c, siblings in {0: "0,2", 1: "1,3", 2: "0,2", 3: "1,3"}.items():
        (cpu / f"cpu{c}" / "topology").mkdir(parents=True)
        (cpu / f"cpu{c}" / "topology" / "thread_siblings_list").write_text(siblings + "\n")
    for n, cpus in {0: "0,2", 1: "1,3"}.items():
        (node / f"node{n}").mkdir(parents=True)
        (node / f"node{n}" / "cpulist").write_text(cpus + "\n")
    topo = hp.topology({0, 1, 2, 3}, cpu, node)
    assert sorted(topo["cores"]) == [[0, 2], [1, 3]]
    assert topo["nodes"] == {0: [0, 2], 1: [1, 3]}
    where = hp.placements({0, 1, 2, 3}, topo)
    assert where == {"as started": [0, 1, 2, 3], "node 0": [0, 2], "node 1": [1, 3],
                     "one CPU per core": [0, 1], "one core's hardware threads": [0, 2], "one CPU": [0]}
    # CPUs outside the allowed set are left out of the nodes.
    assert hp.topology({0, 2}, cpu, node)["nodes"] == {0: [0, 2]}

    # The tool itself, on this machine, with the demo model: every placement
    # timed, and the process's threads back on every allowed CPU after.
    import os

    allowed = os.sched_getaffinity(0)
    assert hp.main(["--shape", "demo", "--context", "16", "--steps", "2", "--repeats", "1",
                    "--out", str(tmp_path / "out")]) == 0
    assert os.sched_getaffinity(0) == allowed
    table = (tmp_path / "out" / "host_placement.txt").read_text()
    assert "| as started |" in table and "| one CPU |" in table
    row = next(line for line in table.splitlines() if line.startswith("| one CPU |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert all(float(v) > 0 for v in cells[2:5])
    assert cells[5] == cells[1]  # the decoding thread ran only where it was pinned


def test_kernel_resources_reads_mlx_s_cache_listing_and_says_what_it_needs(tmp_path, capsys, monkeypatch):
    """The PTX cache's ``<module>.txt`` lists ``name<TAB>mangled`` per kernel
    beside ``<module>.ptx``; modules are chosen by name, a listing without
    its binary is skipped, and without a CUDA driver the tool exits 2 saying so."""
    import ctypes

    from bench.diagnostics.tuning import kernel_resources

    (tmp_path / "moe_decode_route_gate_up_abc.txt").write_text("k1\t_Z2k1v\nk2\t_Z2k2v\n")
    (tmp_path / "moe_decode_route_gate_up_abc.ptx").write_bytes(b"binary")
    (tmp_path / "rms_norm_def.txt").write_text("n\t_Z1nv\n")
    (tmp_path / "rms_norm_def.ptx").write_bytes(b"binary")
    (tmp_path / "orphan_moe_decode.txt").write_text("o\t_Z1ov\n")  # no .ptx beside it
    picked = list(kernel_resources.cached_kernels(tmp_path, ["moe_decode"]))
    assert [(p.name, n, m) for p, n, m in picked] == [
        ("moe_decode_route_gate_up_abc.ptx", "k1", "_Z2k1v"), ("moe_decode_route_gate_up_abc.ptx", "k2", "_Z2k2v")]
    assert len(list(kernel_resources.cached_kernels(tmp_path, []))) == 3

    def no_driver(name, *args, **kwargs):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(ctypes, "CDLL", no_driver)
    assert kernel_resources.main(["--cache-dir", str(tmp_path)]) == 2
    assert "needs the CUDA driver" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        kernel_resources.main(["--cache-dir", str(tmp_path / "missing")])


def test_decode_ab_alternates_arms_from_the_defaults_and_compares_greedy_tokens(tmp_path, emulator_backend):
    """Each arm's module settings on top of the defaults, the compiled steps
    dropped so the step is traced under it, the defaults back at the end; two
    arms that give the same bits (down and the combine as one launch or two)
    give the same greedy tokens; bad arms are refused by name."""
    import json

    from bench.diagnostics.decode import decode_ab
    from mlx_lily.kernels.moe import decode

    emulator_or_skip()
    arm = "two launches:mlx_lily.kernels.moe.decode.COMBINED_DOWN_MAX_ROWS=0"
    code = decode_ab.main(["--arm", "defaults:", "--arm", arm, "--shape", "demo", "--context", "24", "--tokens", "3",
                           "--rounds", "2", "--greedy", "5", "--out", str(tmp_path)])
    assert code == 0 and decode.COMBINED_DOWN_MAX_ROWS == 2
    record = json.loads((tmp_path / "decode-ab.json").read_text())
    defaults, two = record["arms"]["defaults"], record["arms"]["two launches"]
    assert defaults["settings"] == {} and two["settings"] == {"mlx_lily.kernels.moe.decode.COMBINED_DOWN_MAX_ROWS": "0"}
    assert len(defaults["ms_per_token"]) == len(two["ms_per_token"]) == 2
    assert len(two["greedy"]) == 5 and two["greedy"] == defaults["greedy"] and two["greedy_same_as_first_arm"]
    assert "| two launches |" in (tmp_path / "decode-ab.md").read_text()
    assert [decode_ab.arm_order(["a", "b", "c"], r) for r in range(4)] == [
        ["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert decode_ab.parse_arm("x:mlx_lily.kernels.moe.decode.COMBINED_DOWN_ROWS=(1)") == (
        "x", [("mlx_lily.kernels.moe.decode", "COMBINED_DOWN_ROWS", 1)])
    for bad in ("no colon", ":mlx_lily.kernels.moe.decode.X=1", "x:mlx_lily.kernels.moe.decode.NOT_THERE=1",
                "x:mlx_lily.kernels.moe.decode.COMBINED_DOWN_ROWS=four"):
        with pytest.raises(ValueError):
            decode_ab.parse_arm(bad)
    with pytest.raises(SystemExit):
        decode_ab.main(["--arm", "a:", "--arm", "a:"])


def test_moe_router_launch_times_each_choice_with_the_two_launches_bits(tmp_path):
    import json

    from bench.diagnostics.tuning import moe_router_launch

    emulator_or_skip()
    code = moe_router_launch.main(["--out", str(tmp_path), "--backend", "emulator", "--dims", "128,24,3",
                                   "--batch", "1,3", "--sets", "2"])
    assert code == 0
    record = json.loads((tmp_path / "moe-router-launch.json").read_text())
    assert [r["batch"] for r in record["rows"]] == [1, 3]
    labels = {"two launches", *(f"router launch {n} x {r}" for n, r in moe_router_launch.CHOICES)}
    for r in record["rows"]:
        # Every choice gave the two launches' bits (a differing one has no time).
        assert set(r["us"]) == labels and "differs" not in r and all(t > 0 for t in r["us"].values())
    assert "| 3 |" in (tmp_path / "moe-router-launch.md").read_text()


def test_first_instances_records_what_a_prompt_and_reply_launch(tmp_path, monkeypatch):
    """Recorded without a GPU (kernels stubbed as on CUDA): the decode step's
    kernels and the prompt's are among them, each entry's build current; an
    instance a GPU's record lacks (but for its build name) is left out; the
    shipped record keeps its current entries and takes the new ones once."""
    import json

    from bench.diagnostics.tuning import first_instances
    from mlx_lily.toolchain import cuda_cache
    from mlx_lily.toolchain.kernel import KERNELS

    entries = first_instances.record("demo", 4, 24, 2)
    kernels = {e["kernel"] for e in entries}
    assert {"quantized_matvec_tiles", "moe_decode_route_gate_up", "moe_decode_down_combine", "gated_delta_decode",
            "attention_decode", "moe_gate_up"} <= kernels, kernels
    for entry in entries:
        instance = cuda_cache.Instance.from_json(entry)
        assert KERNELS[instance.kernel].backend_name("cuda", instance.absent) == instance.build
    renamed = [dict(e, build=e["build"] + "x") for e in entries[1:]]  # a GPU's record, one instance short
    kept, left_out = first_instances.met_on_gpu(entries, renamed)
    assert kept == entries[1:] and left_out == entries[:1]
    shipped = tmp_path / "shipped.json"
    stale = dict(entries[0], build=entries[0]["build"] + "0")
    shipped.write_text(json.dumps([stale, entries[0]]))
    monkeypatch.setattr(cuda_cache, "SHIPPED_INSTANCES", shipped)
    assert first_instances.shipped_with(entries) == entries
    # The command: its file, and the shipped record only with --write.
    assert first_instances.main(["--shape", "demo", "--layers", "4", "--prompt", "24", "--decode", "2",
                                 "--out", str(tmp_path)]) == 0
    assert json.loads((tmp_path / "first-instances.json").read_text()) == entries
    assert json.loads(shipped.read_text()) == [stale, entries[0]]


def test_the_attention_split_sweep_times_the_prefetch_choices_with_the_same_bits(tmp_path):
    """``attention_split --prefetch``: lily's chosen form with more passes of
    keys and values in flight, checked against the reference and, bit for
    bit, against the chosen form (here in the emulator: times meaningless)."""
    import json

    from bench.diagnostics.decode import attention_split
    from mlx_lily.kernels.attention import sdpa

    emulator_or_skip()
    held = sdpa.DECODE_PREFETCH
    assert attention_split.main(["--out", str(tmp_path), "--backend", "emulator", "--lengths", "256",
                                 "--prefetch", "2,4"]) == 0
    assert sdpa.DECODE_PREFETCH == held
    record = json.loads((tmp_path / "attention-split.json").read_text())
    (row,) = record["rows"]
    assert record["settings"]["DECODE_PREFETCH"] == held
    for name in ("chosen", "prefetch_2", "prefetch_4"):
        assert row[f"{name}_agrees"] is True and row[f"{name}_ms"] > 0, name
    assert "prefetch_4 ms" in (tmp_path / "attention-split.md").read_text()
    with pytest.raises(SystemExit):
        attention_split.main(["--out", str(tmp_path), "--backend", "emulator", "--prefetch", "0"])


def test_decode_profile_takes_set_constants_and_puts_them_back(monkeypatch):
    """``decode_profile --set MODULE.NAME=VALUE``: a malformed setting is the
    parser's error; a good one holds for the run (the profile itself stood in
    for here) and is put back after."""
    from bench.diagnostics.decode import decode_profile
    from mlx_lily.kernels.attention import sdpa

    with pytest.raises(SystemExit):
        decode_profile.main(["--set", "mlx_lily.kernels.attention.sdpa.DECODE_PREFETCH"])
    with pytest.raises(SystemExit):
        decode_profile.main(["--set", "mlx_lily.kernels.attention.sdpa.NO_SUCH_NAME=1"])
    held, seen = sdpa.DECODE_PREFETCH, []

    def profile(args, settings):
        seen.append((sdpa.DECODE_PREFETCH, settings))
        return 2

    monkeypatch.setattr(decode_profile, "_profile", profile)
    assert decode_profile.main(["--set", "mlx_lily.kernels.attention.sdpa.DECODE_PREFETCH=4"]) == 2
    assert seen == [(4, [("mlx_lily.kernels.attention.sdpa", "DECODE_PREFETCH", 4)])]
    assert sdpa.DECODE_PREFETCH == held


def test_launch_occupancy_counts_threadgroups_an_sm_holds_and_says_what_it_needs(capsys, monkeypatch):
    """Registers go a warp at a time in units of 256, a threadgroup's shared
    memory takes 1 KB more: the figures CUDA's occupancy calculator gives an
    sm_90 SM (65,536 registers, 2,048 threads, 228 KB, 32 threadgroups)."""
    import shutil

    from bench.diagnostics.tuning import launch_occupancy as occ

    assert occ.resident_per_sm(94, 256, 4704) == (2, "registers")  # the routed launch before 5ff7572
    assert occ.resident_per_sm(56, 256, 4704) == (4, "registers")  # and after: gate/up alone's 64 too
    assert occ.resident_per_sm(64, 256, 0) == (4, "registers")
    assert occ.resident_per_sm(72, 256, 43776) == (3, "registers")
    assert occ.resident_per_sm(69, 256, 43776) == (3, "registers")  # 69 x 32 rounds up to 2,304 a warp
    assert occ.resident_per_sm(16, 1024, 0) == (2, "threads")
    assert occ.resident_per_sm(32, 64, 100000) == (2, "shared memory")
    assert occ.resident_per_sm(16, 32, 0) == (32, "threadgroups")
    for bad in (["--batch", "0"], ["--batch", "17"], ["--batch", "one"]):
        with pytest.raises(SystemExit):
            occ.main(bad)
    monkeypatch.setattr(shutil, "which", lambda name: None)
    assert occ.main(["--batch", "1"]) == 2
    assert "needs nvcc" in capsys.readouterr().out


def test_wave_profile_times_each_arm_and_puts_its_environment_back(tmp_path, monkeypatch):
    import json

    from mlx.utils import tree_flatten

    from bench.diagnostics.serving import wave_profile

    monkeypatch.delenv("MLX_LILY_PACE_PREFILL", raising=False)
    seen = []
    real_wave = wave_profile.wave

    model_params = []

    def wave(model, ids):
        seen.append(os.environ.get("MLX_LILY_PACE_PREFILL"))
        model_params[:] = [model.parameters()]
        if os.environ.get("MLX_LILY_PACE_PREFILL") == "0":  # this arm's rounds hold 64 MB more at once
            mx.eval(mx.zeros((16 * 2**20,), mx.float32) + 1)
        return real_wave(model, ids)

    monkeypatch.setattr(wave_profile, "wave", wave)
    assert wave_profile.main(["--shape", "demo", "--prompts", "3", "--tokens", "12", "--rounds", "1",
                              "--arm", "pace off:MLX_LILY_PACE_PREFILL=0", "--out", str(tmp_path)]) == 0
    record = json.loads((tmp_path / "wave_profile.json").read_text())
    arms = {a["name"]: a for a in record["arms"]}
    assert list(arms) == ["default", "pace off"] and arms["pace off"]["settings"] == {"MLX_LILY_PACE_PREFILL": "0"}
    assert record["lengths"] == [12, 9, 11]
    for arm in arms.values():
        assert len(arm["first_tokens_s"]) == 1 and arm["median_s"] > 0
        # The round's peak holds at least the model's weights.
        assert arm["peak_gb"] * 2**30 >= sum(v.nbytes for _, v in tree_flatten(model_params[0]))
        # The host's profile finds the server's prefill of the rows together.
        assert any("prompt_rows" in line for line in arm["host_cumulative"])
    # Each arm's peak is its own rounds' (reset before each): the default's
    # rounds, which follow the other arm's, do not show its 64 MB.
    assert (arms["pace off"]["peak_gb"] - arms["default"]["peak_gb"]) * 2**30 >= 60 * 2**20
    # Warm, timed, host-profiled: each arm's runs under its own settings, none after.
    assert seen == [None, "0", None, "0", None, "0"]
    assert "MLX_LILY_PACE_PREFILL" not in os.environ
    with pytest.raises(ValueError, match="NAME:VAR=VALUE"):
        wave_profile.parse_arm("no colon")
    assert wave_profile.parse_arm("off:A=1, B=2") == ("off", {"A": "1", "B": "2"})


def test_logprob_reads_times_both_reads_and_checks_their_values(tmp_path):
    from bench.diagnostics.serving import logprob_reads

    assert logprob_reads.main(["--vocab", "64", "--batch", "1,3", "--steps", "2", "--rounds", "2",
                               "--out", str(tmp_path)]) == 0
    table = (tmp_path / "logprob_reads.txt").read_text().splitlines()
    rows = [line for line in table if line.startswith("| 1 ") or line.startswith("| 3 ")]
    assert len(rows) == 4 and all(line.count("/") == 3 - line.count("| - |") for line in rows), table
    assert [line.split("|")[2].strip() for line in rows] == ["host read", "picks"] * 2
    with pytest.raises(SystemExit):
        logprob_reads.main(["--batch", "0"])


def test_logprob_reads_notices_a_wrong_value_or_a_picks_arm_without_picks(monkeypatch):
    from bench.diagnostics.serving import logprob_reads
    from mlx_lily import served_logprobs

    weight = mx.random.normal((logprob_reads.HIDDEN, 32), key=mx.random.key(0)).astype(mx.bfloat16)
    with monkeypatch.context() as m:
        m.setattr(served_logprobs.StepPicks, "value", lambda self, row, token: -1.0)
        with pytest.raises(AssertionError, match="a read gave"):
            logprob_reads.run_arm(weight, 2, 1, True)
    monkeypatch.setattr(served_logprobs.StepPicks, "of_step", classmethod(lambda cls, rows, tokens: None))
    with pytest.raises(RuntimeError, match="took no picks"):
        logprob_reads.run_arm(weight, 2, 1, True)
