"""python -m bench --serve, at a CPU-sized scale: both servers come up on
loopback, the waves run, every concurrent stream's greedy text equals its
prompt's single-request text, lily's server ran lily's path for every layer,
and the files say so."""

from __future__ import annotations

import json
import time

import pytest

from bench import serve


def test_serve_bench_on_the_demo_checkpoint(demo_checkpoint, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("MLX_LM_BACKEND", raising=False)
    # No Hugging Face cache folder (a fresh machine): the bench's wait for the
    # servers leaves no traceback in their logs (/v1/models would).
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "no-hf-cache"))
    code = serve.main([
        "--model", str(demo_checkpoint), "--concurrency", "1,3", "--prompt-tokens", "24",
        "--max-tokens", "6", "--decode-pair-tokens", "9", "--out", str(tmp_path), "--budget-s", "300",
    ])
    assert code == 0
    (json_file,) = tmp_path.glob("serve-*.json")
    (md_file,) = tmp_path.glob("serve-*.md")
    report = json.loads(json_file.read_text())
    assert report["settings"]["concurrency"] == [1, 3]
    assert {"hostname", "accelerator"} <= report["machine"].keys()
    assert {"mlx", "mlx_lm", "git_revision"} <= report["software"].keys()
    for engine in ("lily", "mlx"):
        e = report["engines"][engine]
        assert not e.get("error") and not e["skipped"], e
        assert "Traceback" not in (tmp_path / f"server-{engine}.log").read_text()
        alone, three = e["waves"]["1"], e["waves"]["3"]
        assert len(alone["streams"]) == 3 and len(three["streams"]) == 3
        assert not alone["errors"] and not three["errors"]
        # Greedy and deterministic: batching changes no stream's text.
        assert three["same_as_single"] == "3/3"
        assert all(s["completion_tokens"] == 6 and s["prompt_tokens"] >= 24 for s in three["streams"])
        assert three["aggregate_tps"] > 0 and three["ttft_median_s"] > 0
    # The lily server's layers all took lily's path, the three-stream wave
    # decoding as one batch of more than one row.
    paths = report["engines"]["lily"]["layer_paths"]
    assert paths and all(r["path"].startswith("lily") for r in paths)
    assert any(r["step"] == "decode" and r["batch"] > 1 for r in paths)
    # Both engines' server prefill against their own generate run.
    ratios = report["prefill_vs_generate"]
    assert set(ratios) == {"lily", "mlx"} and all(r["ratio"] > 0 for r in ratios.values())
    assert all(report["generate_check"][e]["measured"]["prompt_tokens"] > 0 for e in ("lily", "mlx"))
    # The first request of the prefill length is kept beside the measured second.
    assert all(report["engines"][e]["prefill_single"]["first_ttft_s"] > 0 for e in ("lily", "mlx"))
    assert all(r["server_first_ttft_s"] == report["engines"][e]["prefill_single"]["first_ttft_s"]
               for e, r in ratios.items())
    # One stream's decode against generate's, per-stream scaling, lily against
    # stock, and each server's peak memory as its process reported it.
    decode = report["decode_vs_generate"]
    assert set(decode) == {"lily", "mlx"} and all(d["ratio"] > 0 for d in decode.values())
    # ... taken in pairs: the first prompt through the server, then through generate, three times.
    for e in ("lily", "mlx"):
        pairs = report["engines"][e]["decode_pairs"]
        assert len(pairs) == 3 and all(p["server_decode_tps"] > 0 and p["generate_decode_tps"] > 0 for p in pairs)
        # Both sides timed from the first piece of text to the last; mlx-lm's
        # own figure for the generate side kept beside it.
        assert all(p["generate_generation_tps"] > 0 for p in pairs)
        # ... each run --decode-pair-tokens long on both sides.
        assert all(p["server_tokens"] == 9 and p["generate_tokens"] == 9 for p in pairs)
        assert decode[e]["pairs"] == 3 and decode[e]["ratios"] == [p["ratio"] for p in pairs]
    scaling = report["batch_scaling"]
    assert all(scaling[e]["3"]["per_stream_vs_one"] > 0 for e in ("lily", "mlx"))
    assert scaling["aggregate_lily_vs_stock"]["3"] > 0
    for e in ("lily", "mlx"):
        engine = report["engines"][e]
        assert 0 < engine["waves"]["1"]["peak_memory_gb_after"] <= engine["waves"]["3"]["peak_memory_gb_after"]
        assert engine["peak_memory_gb"] >= engine["waves"]["3"]["peak_memory_gb_after"]
    # Each server's decode steps split into parts that add up to a token, the
    # one-stream wave's and each batch size's, at least one batch of streams.
    from bench.serve_split import PARTS

    for e in ("lily", "mlx"):
        engine = report["engines"][e]
        one, by_batch = engine["waves"]["1"]["host_split_ms"], engine["host_split_ms_by_batch"]
        # (how the three streams overlap, and so the batch sizes, depends on timing)
        assert one["steps"] >= 3 * 4 and max(int(b) for b in by_batch) > 1
        for split in (one, *by_batch.values()):
            assert all(split[p] >= 0 for p in PARTS if p != "rest") and split["token"] > 0
        # The three-stream wave's prompts, prefilled in the server's calls
        # (however its admission grouped them), each call timed.
        calls = engine["waves"]["3"]["prefill_split"]
        # (each prompt but its last token, which the first decode step takes)
        assert sum(c["rows"] for c in calls) == 3 and all(c["tokens"] >= 23 * c["rows"] for c in calls)
        # ... and only those (the generator's calls with no prompt, one a step, are not kept).
        assert 1 <= len(calls) <= 3 and all(c["rows"] > 0 for c in calls)
        assert all(c["ms"] >= c["wait_ms"] >= 0 and c["launch_ms"] >= 0 for c in calls)
    assert "| lily | 1 (one-stream wave) |" in md_file.read_text()
    # mlx_lm.generate's own loop, split the same way in the generate check.
    for e in ("lily", "mlx"):
        gs = report["generate_check"][e]["host_split_ms"]
        assert gs["steps"] >= 1 and all(gs[p] >= 0 for p in ("build", "launch", "other")) and gs["token"] > 0
    assert "`mlx_lm.generate`'s own decode loop, lily" in md_file.read_text()
    # The generate check counts lily's batched decode step; on the CPU there
    # are no kernels, so no batched step, and the report says why.
    assert "kernels only" in report["generate_check"]["lily"]["batch_counts"]["error"]
    assert "batch_counts" not in report["generate_check"]["mlx"]
    table = md_file.read_text()
    assert "Decode, one stream, lily:" in table and "median of 3 pairs" in table and "Peak memory of the lily server:" in table
    assert "| 3 | lily |" in table and "| 3 | mlx |" in table and "lily / stock" in table
    assert "Prefill, one request, lily:" in table and "Prefill, one request, mlx:" in table
    assert capsys.readouterr().out.strip() == table.strip()
    # What the lily server's log said about its start (on this CPU: no priming, no builds mid-request).
    lily = report["engines"]["lily"]
    assert lily["first_uses_in_traces"] == [] and "primed_s" in lily
    assert "first_uses_in_traces" not in report["engines"]["mlx"]
    # ... and per timed wave: nothing built inside one, so the report flags none.
    for e in ("lily", "mlx"):
        assert all(w["first_uses_in_wave"] == 0 for w in report["engines"][e]["waves"].values())
    assert "first met inside this wave" not in table


def test_a_waves_prefill_calls_are_read_from_the_servers_progress_lines():
    """Rows whose partial progress lines come together were one call; a
    prompt's last token (a/a) is its first decode step, not a call."""
    log = "\n".join([
        "2026-12-04 21:35:50,358 - INFO - Prompt processing progress: 257/258",
        "2026-12-04 21:35:50,359 - INFO - Prompt processing progress: 258/259",
        "127.0.0.1 - - [04/Dec/2026 21:35:50] \"POST /v1/completions HTTP/1.1\" 200 -",
        "2026-12-04 21:35:50,646 - INFO - Prompt processing progress: 257/258",
        "2026-12-04 21:35:50,683 - INFO - Prompt processing progress: 259/259",
        "2026-12-04 21:35:51,060 - INFO - Prompt processing progress: 2048/4100",
        "2026-12-04 21:35:51,061 - INFO - Prompt processing progress: 255/256",
        "2026-12-04 21:35:51,062 - INFO - Prompt processing progress: 258/259",
        "2026-12-04 21:35:51,400 - INFO - Prompt processing progress: 4096/4100",
    ])
    assert serve.prefill_calls(log) == [2, 1, 3, 1]
    assert serve.prefill_calls("") == []


def test_the_server_log_says_how_long_priming_took_and_what_was_built_after_it():
    from bench.common import REPO_ROOT

    log = (REPO_ROOT / "bench/results/2026-12-02-nvidia-h200-3d92dbbb72/serve-lily/server-lily.log").read_text()
    facts = serve.server_log_facts(log)
    assert facts["primed_s"] == 8.9 and len(facts["first_uses_in_traces"]) == 10
    assert all(f.startswith("quantized_matvec") for f in facts["first_uses_in_traces"])
    before = "[mlx-lily] kernel moe_decode_route (T=bfloat16) first met inside a compiled step (batch True): checked\n"
    text = before + "[mlx-lily] primed in 12.5s\n" + before.replace("moe_decode_route", "attention_decode")
    assert serve.server_log_facts(text) == {"primed_s": 12.5, "first_uses_in_traces": ["attention_decode (T=bfloat16)"]}
    assert serve.server_log_facts("") == {"primed_s": None, "first_uses_in_traces": []}
    report = {"settings": {"shape": "demo", "prompt_tokens": 8, "max_tokens": 4}, "machine": {},
              "software": {"mlx": "", "mlx_lm": "", "git_revision": ""}, "engines": {"lily": dict(facts, waves={})}}
    assert ("primed its kernels in 8.9 s; kernel instances first met inside a compiled step after that: 10 "
            "(quantized_matvec x2, quantized_matvec_tiles x8).") in serve.markdown(report)


def test_a_wave_that_built_kernels_is_flagged(tmp_path):
    """The kernels a lily server built inside a timed wave are counted from
    its log as the wave ran (``Server.log_size`` / ``built_since``), and the
    report says the wave's figures are not the server's steady state."""
    from types import SimpleNamespace

    log = tmp_path / "server-lily.log"
    log.write_text("[mlx-lily] primed in 3.0s\n")
    server = SimpleNamespace(log_path=log)
    at = serve.Server.log_size(server)
    line = "[mlx-lily] kernel moe_decode_down (T=bfloat16) first met inside a compiled step (batch True): checked\n"
    with open(log, "a") as f:
        f.write("a request\n" + line + line.replace("down", "combine"))
    server.log_since = lambda at: serve.Server.log_since(server, at)
    assert serve.Server.built_since(server, at) == 2
    assert serve.Server.log_since(SimpleNamespace(log_path=tmp_path / "absent.log"), 0) == ""
    report = {"settings": {"shape": "demo", "prompt_tokens": 8, "max_tokens": 4}, "machine": {},
              "software": {"mlx": "", "mlx_lm": "", "git_revision": ""},
              "engines": {"lily": {"waves": {}}}}
    for n, built in (("1", 0), ("16", 2)):
        report["engines"]["lily"]["waves"][n] = {
            "aggregate_tps": 100.0, "ttft_median_s": 0.5, "ttft_max_s": 0.6, "decode_tps_median": 30.0,
            "decode_tps_min": 29.0, "same_as_single": "16/16", "first_uses_in_wave": built}
    text = serve.markdown(report)
    assert ("lily, 16 streams: 2 kernel instances first met inside this wave (built mid-wave): "
            "not the server's steady state.") in text
    assert "lily, 1 stream" not in text


def test_conditioned_random_checkpoints_for_the_greedy_check(tmp_path):
    # On a chaotic random model a batch of four rounds differently from a
    # batch of one and the greedy text diverges for stock as for lily (H200,
    # 7bb150d89b: 0/4 for both); --conditioned builds the model that does not.
    with pytest.raises(SystemExit):
        serve.parse_args(["--model", "some/checkpoint", "--conditioned"])
    args = serve.parse_args(["--shape", "demo", "--conditioned", "--checkpoint-dir", str(tmp_path)])
    path = serve.resolve_model(args)
    assert path.endswith("demo-conditioned-seed0")
    plain = serve.resolve_model(serve.parse_args(["--shape", "demo", "--checkpoint-dir", str(tmp_path)]))
    assert plain.endswith("demo-seed0")
    weights = lambda p: sorted((tmp_path / p).glob("*.safetensors"))  # noqa: E731
    assert weights(path) and weights(plain)
    assert (tmp_path / path / "model.safetensors").read_bytes() != (tmp_path / plain / "model.safetensors").read_bytes()


def test_the_report_counts_only_stock_paths_as_stock():
    # The compiled decode segments record their own path name; the report
    # counted them as stock (H200, 2ad7608e93: "3 on stock").
    report = {
        "settings": {"shape": "demo", "model": None, "prompt_tokens": 8, "max_tokens": 2},
        "machine": {}, "software": {"mlx": "x", "mlx_lm": "y", "git_revision": "z"},
        "engines": {"lily": {"layer_paths": [
            {"layer": "MoE", "path": "lily", "batch": 1, "step": "prefill"},
            {"layer": "MoE", "path": "lily decode segments", "batch": 1, "step": "decode"},
            {"layer": "MoE", "path": "lily fused decode", "batch": 1, "step": "decode"},
        ]}},
    }
    assert "3 kinds of call, all on lily" in serve.markdown(report)
    # A prefill check that did not run says why.
    report["generate_check"] = {"mlx": {"skipped": "time budget"}, "lily": {"error": ["OSError: no"]}}
    text = serve.markdown(report)
    assert "Prefill check, mlx: time budget." in text and "Prefill check, lily: error: OSError: no." in text
    report["engines"]["lily"]["layer_paths"].append({"layer": "MoE", "path": "stock", "batch": 4, "step": "decode"})
    assert "1 on stock" in serve.markdown(report)


def test_generate_check_measures_only_when_told(demo_checkpoint, tmp_path):
    # It warms up beside the server, then waits: its measured run must not
    # share the GPU with the server's timed waves.
    check = serve.GenerateCheck(str(demo_checkpoint), "Prefill. river stone light", 2, tmp_path, "lily")
    try:
        assert check.wait_ready(120)
        time.sleep(1.0)
        assert check.proc.poll() is None and not check.result.exists()
        result = check.finish(30, 60)
    finally:
        check.stop()
    assert result["measured"]["prompt_tokens"] == result["warmup"]["prompt_tokens"] > 0
    assert result["measured"]["prompt_tps"] > 0
    assert not list(tmp_path.glob("generate-lily*.json"))  # its files are cleaned up


def test_the_generate_split_times_each_token_and_unwraps():
    import mlx.core as mx

    from bench.serve_split import GenerateSplit

    class Model:
        def __call__(self, x):
            time.sleep(0.002)
            return x + 1

    model, base_call, base_async = Model(), Model.__call__, mx.async_eval
    with GenerateSplit(model) as split:
        y = mx.array([0])
        model(y)  # a prompt chunk: evaluated, not launched
        mx.eval(y)
        for _ in range(GenerateSplit.SKIP + 1 + 6):
            y = model(y)
            mx.async_eval(y)
            time.sleep(0.001)  # the wait and the detokenizer
    assert Model.__call__ is base_call and mx.async_eval is base_async
    got = split.summary()
    assert got["steps"] == 6 and got["build"] >= 0.002e3 * 0.9 and got["other"] >= 0.001e3 * 0.9
    assert got["token"] >= got["build"] + got["other"] and got["launch"] >= 0


def test_server_args_reach_both_servers_command_lines(tmp_path):
    args = serve.parse_args(["--server-args", "--prompt-concurrency 16 --decode-concurrency 16"])
    assert args.server_args == ["--prompt-concurrency", "16", "--decode-concurrency", "16"]
    for engine in ("lily", "mlx"):
        cmd = serve.server_command("M", engine, 1234, 8, tmp_path / "peak.json", args.server_args)
        assert cmd[cmd.index("--backend") + 1] == engine and cmd[cmd.index("--port") + 1] == "1234"
        assert cmd[cmd.index("--prompt-cache-size") + 1] == "0"
        assert cmd[-4:] == ["--prompt-concurrency", "16", "--decode-concurrency", "16"]
    assert serve.parse_args([]).server_args == []


def test_each_stream_records_when_its_connection_was_accepted():
    """``connect_s``: from sending to the server's socket queuing the
    connection; a wave whose slowest connection took SLOW_CONNECT_S or more
    (a full listening queue: the connection was retried) is flagged."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Completions(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            chunks = [{"choices": [{"text": "a"}]}, {"choices": [{"text": "b"}]},
                      {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}}]
            for chunk in chunks:
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, *a):
            pass

    httpd = ThreadingHTTPServer((serve.HOST, 0), Completions)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        out = serve.wave(httpd.server_address[1], ["x", "y"], 2, 10.0)
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert not out["errors"] and out["completion_tokens"] == 4
    for s in out["streams"]:
        assert s["text"] == "ab" and 0 <= s["connect_s"] <= s["ttft_s"]
    assert out["connect_max_s"] == max(s["connect_s"] for s in out["streams"])
    report = {"settings": {"shape": "demo", "prompt_tokens": 8, "max_tokens": 4}, "machine": {},
              "software": {"mlx": "", "mlx_lm": "", "git_revision": ""}, "engines": {"lily": {"waves": {}}}}
    for n, slow in (("8", 0.01), ("16", 1.02)):
        report["engines"]["lily"]["waves"][n] = {
            "aggregate_tps": 100.0, "ttft_median_s": 0.5, "ttft_max_s": 1.6, "decode_tps_median": 30.0,
            "decode_tps_min": 29.0, "same_as_single": "16/16", "connect_max_s": slow,
            "streams": [{"connect_s": 0.01}, {"connect_s": slow}, {"connect_s": slow}]}
    text = serve.markdown(report)
    assert ("lily, 16 streams: 2 connections took 0.5 s or more to be accepted (the slowest 1.02 s: the "
            "server's listening queue overflowed, and those requests arrived late).") in text
    assert "lily, 8 streams: " not in text


def test_generate_is_timed_as_the_servers_client_times_a_stream():
    from types import SimpleNamespace

    # 32 tokens 10 ms apart, each with text: 31 intervals for 31 tokens after
    # the first, where mlx-lm's generation_tps counts 32 over them.
    ticks = iter(0.010 * i for i in range(32))
    responses = [SimpleNamespace(text="a", prompt_tokens=8, prompt_tps=1.0, generation_tokens=n + 1,
                                 generation_tps=(n + 1) / (0.010 * n) if n else 0.0) for n in range(32)]
    figures = serve.generation_figures(responses, clock=lambda: next(ticks))
    assert figures["decode_tps"] == pytest.approx(100.0)
    assert figures["generation_tps"] == pytest.approx(32 / 0.31)
    # A token without text (part of a character) moves neither end; one at
    # either end moves that end to the token with text, as on the client.
    ticks = iter([0.0, 0.2])
    responses = [SimpleNamespace(text=t, prompt_tokens=8, prompt_tps=1.0, generation_tokens=n + 1,
                                 generation_tps=1.0) for n, t in enumerate(["", "a", "", "b", ""])]
    assert serve.generation_figures(responses, clock=lambda: next(ticks))["decode_tps"] == pytest.approx(4 / 0.2)
    # Too little to time: one token, or one piece of text.
    assert serve.text_decode_tps(1, 0.0, 1.0) is None
    assert serve.text_decode_tps(5, 0.3, 0.3) is None and serve.text_decode_tps(5, None, None) is None


def test_a_spent_budget_still_runs_each_engines_largest_wave(tmp_path, monkeypatch):
    """Past --budget-s the waves stop, but for the largest: the aggregate
    against stock's that the report leads with (taking seconds) is never the
    part a slow server start leaves out."""
    ran = []
    now = [0.0]  # the clock: 0 until the budget is spent, then 100

    class FakeServer:
        port, startup_s, cmd = 0, 1.0, ["python", "-m", "mlx_lm.server"]
        log_path = tmp_path / "no-log"
        paths_file = None

        def __init__(self, *args):
            pass

        def log_size(self):
            return 0

        def built_since(self, at):
            return []

        def log_since(self, at):
            return ""

        def prefills_between(self, began, ended):
            return []

        def peak_memory_gb(self):
            return 1.0

        def host_split(self):
            return {}

        def stop(self):
            pass

    def fake_wave(port, prompts, max_tokens, timeout_s):
        ran.append(len(prompts))
        return {"streams": [], "aggregate_tps": 1.0, "ttft_median_s": 0.1, "errors": []}

    def spending(part):
        def run(*args):
            now[0] = 100.0
            return part(*args)
        return run

    monkeypatch.setattr(serve, "Server", FakeServer)
    monkeypatch.setattr(serve, "singles", lambda *a: {"streams": [], "ttft_median_s": 0.1})
    monkeypatch.setattr(serve, "stream", lambda *a: {"prompt_tokens": 8, "ttft_s": 0.1})
    monkeypatch.setattr(serve, "check_greedy", lambda w, alone: w.update(same_as_single="0/0"))
    monkeypatch.setattr(serve.time, "perf_counter", lambda: now[0])
    args = serve.parse_args(["--concurrency", "1,4,8,16", "--out", str(tmp_path)])
    args.prefill_prompt = "Prefill."

    # Spent in the warmup: no wave is timed (the largest is no exception).
    monkeypatch.setattr(serve, "wave", spending(fake_wave))
    result = serve.run_engine("mlx", "model", ["p"] * 16, args, tmp_path, deadline=50.0)
    assert ran == [1, 4, 8, 16] and result["waves"] == {}
    assert result["skipped"] == ["all waves (time budget spent in startup and warmup)"]

    # Spent in the single-stream runs: the prefill check and the waves of 4
    # and 8 streams are skipped, the 16-stream wave runs.
    ran.clear()
    now[0] = 0.0
    monkeypatch.setattr(serve, "wave", fake_wave)
    monkeypatch.setattr(serve, "singles", spending(lambda *a: {"streams": [], "ttft_median_s": 0.1}))
    result = serve.run_engine("mlx", "model", ["p"] * 16, args, tmp_path, deadline=50.0)
    assert ran == [1, 4, 8, 16, 16]
    assert result["skipped"] == ["prefill check (time budget)", "4 streams (time budget)", "8 streams (time budget)"]
    assert set(result["waves"]) == {"1", "16"}
