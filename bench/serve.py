"""The load benchmark: concurrent streaming requests against ``mlx_lm.server``.

``python -m bench --serve --help``. For each engine (``--backend lily`` and
``--backend mlx``, on the same checkpoint) one ``mlx_lm.server`` (started as
``python -m mlx_lily serve --backend ENGINE``: mlx-lm's server main, no
startup hook needed) runs on loopback (a free
port on 127.0.0.1) and gets, after a warmup (every wave below run once
first, untimed):

* each prompt alone, one after another (the single-request runs; their
  figures are the "1 stream" row);
* for each concurrency N > 1 (default 4 and 16), N streaming requests sent at
  once, prompt i to stream i.

Per stream: time to first token (TTFT: request sent to first text received),
decode speed (tokens after the first / time from the first to the last), and
whether its greedy text equals the single-request run of the same prompt.
Per wave: aggregate tokens/s (all streams' generated tokens / wall time from
the first request sent to the last stream done). Then one request's prefill
under the server (prompt tokens / TTFT of the single runs, median) against
``mlx_lm.generate``'s (``stream_generate``'s prompt tokens/s, same engine,
warmed up, same prompt) in a process of its own: it loads and warms up while
the server starts, and its measured run waits until the server has stopped
(``--generate-check-after``: the process starts only then).

One stream's decode under the server against ``mlx_lm.generate``'s is taken
in pairs (``--decode-pairs``): the first prompt served alone, then the same
prompt decoded by the generate check's process (warmed up beside the
server), one after the other, a few times, each run ``--decode-pair-tokens``
long. Each pair's ratio compares two runs seconds apart, so a host whose
speed drifts by minutes (the H200's) moves both; the report gives each pair
and their median.

``--multi-turn`` runs instead an agent-style conversation over a growing
history through the server's prompt cache and batch generator, in this
process: prompt-prefix reuse, TTFT against a cold request, bitwise outputs,
checkpoint memory (``bench/multi_turn.py``; the JSON's ``multi_turn`` section).

Bounded: ``--budget-s`` stops starting new waves once spent, but for the
largest (``wave_due``; what was skipped is recorded), every request has a
timeout, every server is stopped. The lily server records the path its
layers took (``MLX_LILY_TRACE_PATHS``) and the report includes it.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import http.client
import json
import os
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Union

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import multi_turn  # noqa: E402
from bench.common import REPO_ROOT, file_stem, log, machine_info, now_iso, software_info  # noqa: E402

HOST = "127.0.0.1"
ENGINES = ("lily", "mlx")
# Words the prompts are drawn from (any text does: the weights are random or
# the checkpoint is real; only the token count matters).
WORDS = (
    "river stone light window garden paper winter morning silver candle forest "
    "harbor engine signal orange market letter bridge thunder meadow pocket "
    "lantern compass violin desert mirror ladder island feather velvet canyon"
).split()

EXAMPLES = """\
examples:
  python -m bench --serve                                   # demo shape, CPU-sized
  python -m bench --serve --model PATH --prompt-tokens 512 --max-tokens 32
  python -m bench --serve --shape qwen3.6-35b-a3b --checkpoint-dir /tmp/ckpt
  python -m bench --serve --multi-turn --history-tokens 600 --prefill-step-size 64   # CPU-sized

outputs go to --out as serve-<date>-<host>-<chip>-<git rev>.{json,md};
server logs and lily's recorded layer paths beside them.
"""


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench --serve", description=__doc__.split("\n\n")[0],
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="a checkpoint path or hub id")
    src.add_argument("--shape", default=None, help="a random checkpoint's shape (default demo)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random checkpoint")
    p.add_argument("--conditioned", action="store_true",
                   help="a well-conditioned random checkpoint (as in trained models; see bench/README.md): "
                        "its greedy text does not flip on rounding, so 'greedy = single' is a real check")
    p.add_argument("--checkpoint-dir", help="where to write the random checkpoint (default: the cache)")
    p.add_argument("--concurrency", default="1,4,16", help="stream counts (default 1,4,16)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="prompt length, about (default 256)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per stream (default 32)")
    p.add_argument("--prefill-tokens", type=int, default=None,
                   help="prompt length of the one-request prefill check (default: --prompt-tokens)")
    p.add_argument("--engines", default="lily,mlx", help="backends to serve (default lily,mlx)")
    p.add_argument("--budget-s", type=float, default=420, help="no new wave after this (default 420)")
    p.add_argument("--server-timeout-s", type=float, default=600, help="server start limit")
    p.add_argument("--request-timeout-s", type=float, default=300, help="per-request limit")
    p.add_argument("--no-generate-check", action="store_true", help="skip the prefill vs generate check")
    p.add_argument("--decode-pairs", type=int, default=3,
                   help="one-stream decode under the server and under mlx_lm.generate, alternated this many "
                        "times on the first prompt (needs the generate check beside the server; 0: off; default 3)")
    p.add_argument("--decode-pair-tokens", type=int, default=128,
                   help="tokens each run of a decode pair generates (default 128: a run of --max-tokens 32 "
                        "spans about 0.2 s on the H200, where one late step moves its rate by several percent)")
    p.add_argument("--count-rows", type=int, default=8,
                   help="the generate check also counts kernels and bytes of one decode step of this many "
                        "streams on the server's caches (bench/batch_counts.py; 0: off; default 8)")
    p.add_argument("--generate-check-after", action="store_true",
                   help="start the generate check's process after the server stops, not beside it "
                        "(one copy of the model in memory at a time; slower)")
    p.add_argument("--server-args", default="",
                   help="more mlx_lm.server flags for both servers, as one string "
                        "(e.g. \"--prompt-concurrency 16\"; recorded in the JSON)")
    p.add_argument("--out", default=str(REPO_ROOT / "bench" / "out"), help="output folder")
    p.add_argument("--generate-worker", nargs=2, metavar=("SPEC", "OUT"), help=argparse.SUPPRESS)
    multi_turn.add_arguments(p)
    args = p.parse_args(argv)
    args.concurrency = sorted({int(c) for c in args.concurrency.split(",") if c.strip()})
    args.server_args = shlex.split(args.server_args)
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if args.decode_pairs < 0:
        p.error(f"--decode-pairs {args.decode_pairs}: 0 or more")
    if args.decode_pair_tokens < 2:
        p.error(f"--decode-pair-tokens {args.decode_pair_tokens}: 2 or more (a rate needs two tokens)")
    if not args.concurrency or min(args.concurrency) < 1:
        p.error("--concurrency: positive stream counts, e.g. 1,4,16")
    if any(e not in ENGINES for e in args.engines):
        p.error(f"--engines: a subset of {','.join(ENGINES)}")
    if args.model and args.conditioned:
        p.error("--conditioned applies to random checkpoints (--shape), not --model")
    return args


# ----------------------------------------------------------------- prompts


def make_prompts(tokenizer, count: int, n_tokens: int) -> List[str]:
    """count distinct prompts of about n_tokens tokens each (at least)."""
    prompts = []
    for i in range(count):
        rng = random.Random(1000 + i)
        words = [f"Request {i}:"]
        while len(tokenizer.encode(" ".join(words))) < n_tokens:
            words.extend(rng.choice(WORDS) for _ in range(8))
        while len(words) > 2 and len(tokenizer.encode(" ".join(words[:-1]))) >= n_tokens:
            words.pop()
        prompts.append(" ".join(words))
    return prompts


# ------------------------------------------------------------------ server


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def server_command(model: str, engine: str, port: int, max_tokens: int, peak_file: Path,
                   extra: Iterable[str] = ()) -> List[str]:
    """The server's command line: mlx_lm.server's main through
    ``bench.serve_process``, no prompt-cache reuse (every request prefills
    its whole prompt), then ``extra`` (``--server-args``), the same for
    both engines."""
    return [
        sys.executable, "-m", "bench.serve_process", str(peak_file),
        "serve", "--model", model, "--backend", engine,
        "--host", HOST, "--port", str(port),
        "--prompt-cache-size", "0", "--max-tokens", str(max_tokens), *extra,
    ]


class Server:
    """``mlx_lm.server --backend ENGINE`` on a free loopback port."""

    def __init__(self, model: str, engine: str, out: Path, max_tokens: int, timeout_s: float,
                 extra: Iterable[str] = ()):
        self.engine, self.port = engine, free_port()
        self.log_path = out / f"server-{engine}.log"
        env = {k: v for k, v in os.environ.items() if k != "MLX_LM_BACKEND"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        self.paths_file = None
        if engine == "lily":
            self.paths_file = out / "paths-lily.jsonl"
            self.paths_file.unlink(missing_ok=True)
            env["MLX_LILY_TRACE_PATHS"] = str(self.paths_file)
        # mlx_lm.server's own main through lily's entry point, which takes
        # --backend without the startup hook (a checkout on PYTHONPATH has none).
        # bench.serve_process also writes the server's peak memory (peak_memory_gb()).
        self.peak_file = out / f"peak-{engine}.json"
        self.peak_file.unlink(missing_ok=True)
        # ... and where the decode steps' time goes (bench.serve_split).
        self.split_file = out / f"split-{engine}.json"
        self.split_file.unlink(missing_ok=True)
        env["LILY_BENCH_SERVER_SPLIT"] = str(self.split_file)
        self.cmd = server_command(model, engine, self.port, max_tokens, self.peak_file, extra)
        start = time.perf_counter()
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        try:
            self._wait_up(timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - start

    def _wait_up(self, timeout_s: float) -> None:
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.engine} server exited early; see {self.log_path}")
            # /health, not /v1/models: where no Hugging Face cache folder
            # exists, the models list leaves a traceback in the server's log.
            try:
                conn = http.client.HTTPConnection(HOST, self.port, timeout=5)
                conn.request("GET", "/health")
                ok = conn.getresponse().status == 200
                conn.close()
                if ok:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.engine} server not up within {timeout_s:.0f} s; see {self.log_path}")

    def log_size(self) -> int:
        """Bytes of the server's log so far (where ``log_since`` reads on)."""
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def built_since(self, at: int) -> int:
        """Kernel instances the server's log says were first met inside a
        compiled step from byte ``at`` on (built mid-request)."""
        return len(_FIRST_USE.findall(self.log_since(at)))

    def log_since(self, at: int) -> str:
        """The server's log from byte ``at`` on."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(at)
                return f.read().decode(errors="replace")
        except OSError:
            return ""

    def peak_memory_gb(self) -> Optional[float]:
        """The server process's MLX peak memory so far (GiB), as its watcher
        last wrote it (within a second), or None."""
        time.sleep(1.2)  # the watcher's next write covers what just ran
        try:
            return round(json.loads(self.peak_file.read_text())["peak_memory_gb"], 3)
        except (OSError, ValueError, KeyError):
            return None

    def host_split(self) -> Dict[str, Any]:
        """{B: {part: median ms}} of the server's decode steps so far, as its
        watcher last wrote them (bench.serve_split), or {}."""
        return self._split().get("ms_by_batch", {})

    def prefills_between(self, begin: float, end: float) -> List[Dict[str, Any]]:
        """The server's prompt-processing calls that began between the wall
        clock times ``begin`` and ``end`` (bench.serve_split: rows, tokens,
        ms, of them ms in eval and in async_eval)."""
        return [{k: v for k, v in p.items() if k != "at"} for p in self._split().get("prefills", [])
                if begin <= p.get("at", 0.0) <= end]

    def _split(self) -> Dict[str, Any]:
        """The split file once the watcher has written it again (once a second)."""
        time.sleep(1.2)
        try:
            return json.loads(self.split_file.read_text())
        except (OSError, ValueError):
            return {}

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def sse_data(lines: Iterable[Union[bytes, str]]) -> Iterator[str]:
    """The data of each event of a server-sent event stream (lines as bytes
    or text), in order; the OpenAI API's end mark ``[DONE]`` included."""
    for raw in lines:
        line = (raw.decode() if isinstance(raw, bytes) else raw).strip()
        if line.startswith("data: "):
            yield line[len("data: "):]


def sse_chunks(lines: Iterable[Union[bytes, str]]) -> Iterator[Dict[str, Any]]:
    """The JSON chunks of a streamed OpenAI API response, up to its ``[DONE]``."""
    for data in sse_data(lines):
        if data == "[DONE]":
            return
        yield json.loads(data)


# A connection accepted this late was retried: the server's listening queue
# was full when it first arrived (Linux retries a dropped connection after 1 s).
SLOW_CONNECT_S = 0.5


def text_decode_tps(tokens: int, first: Optional[float], last: Optional[float]) -> Optional[float]:
    """Decode tok/s as a streaming client sees it: the tokens after the
    first over the time from the first piece of text to the last. The
    server's streams and the generate check's runs are both timed this way
    (the same detokenizer, so the same tokens carry text on both sides).
    mlx-lm's own ``generation_tps`` counts every token, the first included,
    over the time after the first: at 32 tokens it reads 32/31 = 3.2% above
    this figure for the same run."""
    if tokens < 2 or first is None or last is None or last <= first:
        return None
    return (tokens - 1) / (last - first)


def stream(port: int, prompt: str, max_tokens: int, timeout_s: float) -> Dict[str, Any]:
    """One streaming text completion, greedy; its timings and text."""
    body = {
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    # Connected once the handshake is done: a first attempt that a full
    # listening queue dropped shows here, retried a second later. (A lower
    # bound: a handshake completed while the queue was full may be dropped
    # after connect() returned, and its delay then lands in the first token.)
    conn.connect()
    connected = time.perf_counter()
    conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    if response.status != 200:
        raise RuntimeError(f"HTTP {response.status}: {response.read()[:200]!r}")
    first = last = None
    text, usage = [], {}
    for chunk in sse_chunks(response):
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices") or []:
            piece = choice.get("text") or ""
            if piece:
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
                text.append(piece)
    done = time.perf_counter()
    conn.close()
    tokens = int(usage.get("completion_tokens", 0))
    return {
        "text": "".join(text),
        "prompt_tokens": int(usage.get("prompt_tokens", 0)),
        "completion_tokens": tokens,
        "ttft_s": (first - sent) if first is not None else None,
        "connect_s": connected - sent,
        "decode_tps": text_decode_tps(tokens, first, last),
        "sent": sent,
        "done": done,
    }


def wave(port: int, prompts: List[str], max_tokens: int, timeout_s: float) -> Dict[str, Any]:
    """All prompts at once, one stream each."""
    results: List[Optional[Dict[str, Any]]] = [None] * len(prompts)
    errors: List[str] = []
    barrier = threading.Barrier(len(prompts))

    def client(i: int) -> None:
        try:
            barrier.wait()
            results[i] = stream(port, prompts[i], max_tokens, timeout_s)
        except Exception as exc:  # recorded; the wave reports it
            errors.append(f"stream {i}: {exc}")

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 30)
    streams = [r for r in results if r is not None]
    if len(streams) < len(prompts) and not errors:
        errors.append("a stream did not finish in time")
    return summarize(streams, errors, concurrent=True)


def summarize(streams: List[Dict[str, Any]], errors: List[str], concurrent: bool) -> Dict[str, Any]:
    def median(key):
        values = [s[key] for s in streams if s.get(key) is not None]
        return statistics.median(values) if values else None

    tokens = sum(s["completion_tokens"] for s in streams)
    if concurrent and streams:
        wall = max(s["done"] for s in streams) - min(s["sent"] for s in streams)
        aggregate = tokens / wall if wall > 0 else None
    else:  # single runs: one stream at a time, so each stream's own rate
        wall = sum(s["done"] - s["sent"] for s in streams)
        aggregate = median("stream_tps")
    ttfts = [s["ttft_s"] for s in streams if s.get("ttft_s") is not None]
    decode = [s["decode_tps"] for s in streams if s.get("decode_tps") is not None]
    return {
        "streams": [{k: v for k, v in s.items() if k not in ("sent", "done")} for s in streams],
        "errors": errors,
        "wall_s": wall,
        "completion_tokens": tokens,
        "aggregate_tps": aggregate,
        "ttft_median_s": statistics.median(ttfts) if ttfts else None,
        "ttft_max_s": max(ttfts) if ttfts else None,
        "connect_max_s": max((s["connect_s"] for s in streams if s.get("connect_s") is not None), default=None),
        "decode_tps_median": statistics.median(decode) if decode else None,
        "decode_tps_min": min(decode) if decode else None,
        "prompt_tokens_median": median("prompt_tokens"),
    }


def singles(port: int, prompts: List[str], max_tokens: int, timeout_s: float) -> Dict[str, Any]:
    """Each prompt alone, one after another."""
    streams, errors = [], []
    for i, prompt in enumerate(prompts):
        try:
            s = stream(port, prompt, max_tokens, timeout_s)
        except Exception as exc:
            errors.append(f"prompt {i}: {exc}")
            continue
        span = s["done"] - s["sent"]
        s["stream_tps"] = s["completion_tokens"] / span if span > 0 else None
        s["prefill_tps"] = s["prompt_tokens"] / s["ttft_s"] if s.get("ttft_s") else None
        streams.append(s)
    out = summarize(streams, errors, concurrent=False)
    prefill = [s["prefill_tps"] for s in streams if s.get("prefill_tps")]
    out["prefill_tps_median"] = statistics.median(prefill) if prefill else None
    return out


def decode_pairs(port: int, check: "GenerateCheck", prompt: str, args, deadline: float) -> List[Dict[str, Any]]:
    """``--decode-pairs`` times: ``prompt`` alone through the server, then
    through the generate check's ``mlx_lm.stream_generate``; each pair's
    decode tok/s and ratio (the GPU serves one of them at a time)."""
    pairs = []
    try:  # the server's first decode to that length, untimed (the generate check warmed up to it too)
        stream(port, prompt, args.decode_pair_tokens, args.request_timeout_s)
    except Exception as exc:  # recorded; the other figures stand
        return [{"error": f"warm-up: {str(exc)[:300]}"}]
    for i in range(args.decode_pairs):
        if time.perf_counter() > deadline:
            break
        try:
            served = stream(port, prompt, args.decode_pair_tokens, args.request_timeout_s)
            generated = check.decode_run(i, args.request_timeout_s)
        except Exception as exc:  # recorded; the other figures stand
            pairs.append({"error": str(exc)[:300]})
            break
        s_tps, g_tps = served.get("decode_tps"), generated.get("decode_tps")
        pairs.append({"server_decode_tps": s_tps, "generate_decode_tps": g_tps,
                      "ratio": s_tps / g_tps if s_tps and g_tps else None,
                      "generate_generation_tps": generated.get("generation_tps"),
                      "server_tokens": served.get("completion_tokens"),
                      "generate_tokens": generated.get("generation_tokens")})
        log(f"decode pair {i + 1}: server {s_tps} tok/s, generate {g_tps} tok/s")
    return pairs


def check_greedy(result: Dict[str, Any], alone: Dict[str, Any]) -> None:
    """Mark each stream's text against its prompt's single-request text."""
    reference = [s["text"] for s in alone["streams"]]
    same = []
    for i, s in enumerate(result["streams"]):
        want = reference[i] if i < len(reference) else None
        s["same_as_single"] = want is not None and s["text"] == want
        if want is not None and s["text"] != want:
            s["first_difference_at_char"] = next(
                (j for j, (a, b) in enumerate(zip(s["text"], want)) if a != b), min(len(s["text"]), len(want))
            )
        same.append(s["same_as_single"])
    result["same_as_single"] = f"{sum(same)}/{len(same)}"


# --------------------------------------------------------- generate check


def generation_figures(responses: Iterable[Any], clock: Callable[[], float] = time.perf_counter) -> Dict[str, Any]:
    """A ``stream_generate`` run's figures: mlx-lm's own (prompt tok/s,
    ``generation_tps``) and ``decode_tps``, timed as the server's client
    times a stream (``text_decode_tps``: the first and the last response
    that carries text)."""
    last = first_text = last_text = None
    for last in responses:
        if last.text:
            last_text = clock()
            first_text = last_text if first_text is None else first_text
    return {"prompt_tokens": last.prompt_tokens, "prompt_tps": last.prompt_tps,
            "generation_tokens": last.generation_tokens, "generation_tps": last.generation_tps,
            "decode_tps": text_decode_tps(last.generation_tokens, first_text, last_text)}


def generate_worker(spec_path: str, out_path: str) -> int:
    """One engine's prefill through mlx_lm.stream_generate (what
    mlx_lm.generate runs) in this fresh process: a warmup run, then, once the
    ``go`` file of the spec exists, the measured run. Until then, each
    ``pair-N`` file it finds asks for one decode run of the spec's
    ``decode_prompt``, answered in ``pair-N.json`` (the server's decode pairs)."""
    import mlx_lily
    from mlx_lm import stream_generate

    spec = json.loads(Path(spec_path).read_text())

    def run(prompt: str, max_tokens: int = spec["max_tokens"]) -> Dict[str, Any]:
        return generation_figures(stream_generate(model, tokenizer, prompt, max_tokens=max_tokens))

    decode_tokens = spec.get("decode_tokens") or spec["max_tokens"]

    model, tokenizer = mlx_lily.load(spec["model"], backend=spec.get("engine", "lily"))
    warmup = run(spec["prompt"])
    if spec.get("decode_prompt"):
        run(spec["decode_prompt"], decode_tokens)  # that prompt's length warmed up too
    Path(spec["ready"]).write_text(json.dumps(warmup))
    go, parent = Path(spec["go"]), os.getppid()
    answered = set()
    while not go.exists():
        if os.getppid() != parent:  # the bench is gone: nobody wants the figure
            return 1
        for ask in sorted(Path(spec["go"]).parent.glob(f"{Path(spec['go']).stem}.pair-*")):
            if ask.suffix != ".json" and ask.name not in answered:
                answered.add(ask.name)
                result = run(spec["decode_prompt"], decode_tokens)
                tmp = ask.with_name(ask.name + ".tmp")
                tmp.write_text(json.dumps(result))
                os.replace(tmp, ask.with_name(ask.name + ".json"))
        time.sleep(0.01)
    from bench.serve_split import GenerateSplit

    with GenerateSplit(model) as split:
        measured = run(spec["prompt"])
    result = {"warmup": warmup, "measured": measured, "host_split_ms": split.summary()}
    if spec.get("count_rows"):
        result["batch_counts"] = batched_step_counts(model, tokenizer, spec["prompt"], spec["count_rows"])
    Path(out_path).write_text(json.dumps(result))
    return 0


def batched_step_counts(model, tokenizer, prompt: str, rows: int) -> Dict[str, Any]:
    """Kernels and bytes of one decode step of ``rows`` streams on the
    server's batch caches (each row a prefix of the prompt of its own length,
    merged as the server merges requests' caches), against the union they
    must read (bench/batch_counts.py); the error, where counting failed."""
    try:
        import mlx.core as mx
        from mlx_lm.generate import _merge_caches
        from mlx_lm.models.cache import make_prompt_cache

        from bench.batch_counts import batch_decode_step_counts

        ids = tokenizer.encode(prompt)
        caches = []
        for r in range(rows):
            cache = make_prompt_cache(model)
            mx.eval(model(mx.array(ids[: max(8, len(ids) * (r + 1) // rows)])[None], cache=cache))
            caches.append(cache)
        return batch_decode_step_counts(model, _merge_caches(caches), [ids[r] for r in range(rows)])
    except Exception as exc:  # noqa: BLE001 - the figure is extra; the check's other figures stand
        return {"error": f"{type(exc).__name__}: {exc}"[:400]}


class GenerateCheck:
    """The prefill of one engine through ``mlx_lm.generate``, for its server's
    ratio, in a process of its own started beside the server: it loads and
    warms up while the server starts (on CUDA both build their kernels then,
    which takes minutes), and makes its measured run only when told to, after
    the server has stopped, so that no timing shares the GPU."""

    def __init__(self, model: str, prompt: str, max_tokens: int, out: Path, engine: str, count_rows: int = 0,
                 decode_prompt: str = "", decode_tokens: int = 0):
        self.engine = engine
        self.spec = out / f"generate-{engine}-spec.json"
        self.ready, self.go = out / f"generate-{engine}.ready", out / f"generate-{engine}.go"
        self.result, self.log_path = out / f"generate-{engine}-result.json", out / f"generate-{engine}.log"
        for f in (self.ready, self.go, self.result):
            f.unlink(missing_ok=True)
        self.spec.write_text(json.dumps({
            "model": model, "prompt": prompt, "max_tokens": max_tokens, "engine": engine,
            "decode_prompt": decode_prompt, "decode_tokens": decode_tokens,
            # Counting traces lily's batched step; stock's layer code cannot be exported.
            "ready": str(self.ready), "go": str(self.go), "count_rows": count_rows if engine == "lily" else 0,
        }))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.serve", "--generate-worker", str(self.spec), str(self.result)],
            cwd=REPO_ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout_s: float) -> bool:
        """Until its warmup run is done (or it failed, or timeout_s passed)."""
        deadline = time.perf_counter() + timeout_s
        while not self.ready.exists() and self.proc.poll() is None and time.perf_counter() < deadline:
            time.sleep(0.2)
        return self.ready.exists()

    def decode_run(self, index: int, timeout_s: float) -> Dict[str, Any]:
        """One decode run of the decode prompt, now (the worker is ready)."""
        ask = self.go.with_name(f"{self.go.stem}.pair-{index}")
        answer = ask.with_name(ask.name + ".json")
        ask.touch()
        deadline = time.perf_counter() + timeout_s
        try:
            while not answer.exists():
                if self.proc.poll() is not None:
                    raise RuntimeError(self._why(f"generate check exited ({self.proc.returncode})"))
                if time.perf_counter() > deadline:
                    raise RuntimeError("generate check's decode run not done in time")
                time.sleep(0.01)
            return json.loads(answer.read_text())
        finally:
            ask.unlink(missing_ok=True)
            answer.unlink(missing_ok=True)

    def finish(self, ready_timeout_s: float, run_timeout_s: float) -> Dict[str, Any]:
        """Its measured run, now; the figures, or what went wrong."""
        try:
            if not self.wait_ready(ready_timeout_s):
                return {"error": [self._why("not ready in time")]}
            self.go.touch()
            self.proc.wait(timeout=run_timeout_s)
            if self.proc.returncode != 0 or not self.result.exists():
                return {"error": [self._why(f"exit code {self.proc.returncode}")]}
            return json.loads(self.result.read_text())
        except subprocess.TimeoutExpired:
            return {"error": ["measured run not done in time"]}
        finally:
            self.stop()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
        for f in (self.spec, self.ready, self.go, self.result):
            f.unlink(missing_ok=True)

    def _why(self, fallback: str) -> str:
        self._log.flush()
        lines = [l for l in self.log_path.read_text().splitlines() if l.strip()]
        return lines[-1] if lines else fallback


# ------------------------------------------------------------------- main


def resolve_model(args: argparse.Namespace) -> str:
    if args.model:
        return args.model
    from mlx_lily.random_checkpoints import make_checkpoint

    shape = args.shape or "demo"
    kind = "-conditioned" if args.conditioned else ""
    path = Path(args.checkpoint_dir) / f"{shape}{kind}-seed{args.seed}" if args.checkpoint_dir else None
    log(f"checkpoint: random {shape}{kind} (seed {args.seed}), written once")
    return str(make_checkpoint(path, shape=shape, seed=args.seed, quiet=False, conditioned=args.conditioned))


def run_engine(
    engine: str, model: str, prompts: List[str], args, out: Path, deadline: float,
    check: Optional[GenerateCheck] = None,
) -> Dict[str, Any]:
    result: Dict[str, Any] = {"engine": engine, "waves": {}, "skipped": []}
    log(f"{engine}: starting mlx_lm.server --backend {engine}")
    server = Server(model, engine, out, args.max_tokens, args.server_timeout_s, args.server_args)
    result["startup_s"] = server.startup_s
    result["server_command"] = " ".join(server.cmd[1:])
    try:
        # Warmup: every concurrency once, as the measured wave will run it
        # (the same prompts and tokens), so that the batch sizes its streams
        # make as they arrive and finish are traced before anything is timed.
        # With a few tokens a stream, a 16-stream wave met batch sizes (5, 13)
        # the warmup had not, and their traces (2 to 7 s) fell in the
        # measurement where the server had not primed its steps.
        t0 = time.perf_counter()
        for n in args.concurrency:
            wave(server.port, prompts[:n], args.max_tokens, args.request_timeout_s)
        result["warmup_s"] = time.perf_counter() - t0
        log(f"{engine}: up in {server.startup_s:.0f} s, warmed up in {result['warmup_s']:.0f} s")
        n_max = max(args.concurrency)
        if check is not None:
            # Its warmup shares the GPU with nothing timed.
            t0 = time.perf_counter()
            check.wait_ready(max(0.0, deadline - t0))
            result["waited_for_generate_check_s"] = time.perf_counter() - t0
        if time.perf_counter() > deadline:
            result["skipped"].append("all waves (time budget spent in startup and warmup)")
            return result
        at = server.log_size()
        alone = singles(server.port, prompts[:n_max], args.max_tokens, args.request_timeout_s)
        alone["first_uses_in_wave"] = server.built_since(at)
        alone["peak_memory_gb_after"] = server.peak_memory_gb()
        alone["host_split_ms"] = server.host_split().get("1")
        result["waves"]["1"] = alone
        log(f"{engine}: {len(alone['streams'])} single runs, TTFT median {alone['ttft_median_s']}")
        if check is not None and args.decode_pairs and check.ready.exists():
            result["decode_pairs"] = decode_pairs(server.port, check, prompts[0], args, deadline)
        # One request's prefill at --prefill-tokens: once to warm that shape up,
        # once measured.
        if time.perf_counter() > deadline:
            result["skipped"].append("prefill check (time budget)")
        else:
            first, one = (stream(server.port, args.prefill_prompt, 2, args.request_timeout_s) for _ in range(2))
            result["prefill_single"] = {
                "prompt_tokens": one["prompt_tokens"], "ttft_s": one["ttft_s"],
                "prefill_tps": one["prompt_tokens"] / one["ttft_s"] if one["ttft_s"] else None,
                # The first request of a length no earlier request had: what
                # building anything at first use (not primed) costs a user.
                "first_ttft_s": first["ttft_s"],
            }
        for n in args.concurrency:
            if n == 1:
                continue
            if not wave_due(n, n_max, time.perf_counter(), deadline):
                result["skipped"].append(f"{n} streams (time budget)")
                continue
            at, began = server.log_size(), time.time()
            w = wave(server.port, prompts[:n], args.max_tokens, args.request_timeout_s)
            # Where the wave's prefill time went inside the server: its calls.
            w["prefill_split"] = server.prefills_between(began, time.time())
            # Kernels built inside the timed wave: its figures are then not
            # the server's steady state (the report says so).
            w["first_uses_in_wave"] = server.built_since(at)
            w["prefill_calls"] = prefill_calls(server.log_since(at))
            check_greedy(w, alone)
            w["peak_memory_gb_after"] = server.peak_memory_gb()  # the server's peak so far
            result["waves"][str(n)] = w
            log(f"{engine}: {n} streams, {w['aggregate_tps']} tok/s aggregate, same as single {w['same_as_single']}")
        result["peak_memory_gb"] = server.peak_memory_gb()
        result["host_split_ms_by_batch"] = server.host_split()
    finally:
        server.stop()
        if engine == "lily" and server.log_path.exists():
            result.update(server_log_facts(server.log_path.read_text(errors="replace")))
        if server.paths_file is not None and server.paths_file.exists():
            result["layer_paths"] = [json.loads(l) for l in server.paths_file.read_text().splitlines()]
    return result


def wave_due(n: int, n_max: int, now: float, deadline: float) -> bool:
    """Whether the wave of ``n`` streams runs, once an engine's waves have
    begun (a budget spent in its start and warmup skips them all): every wave
    before the budget's deadline, and the largest after it too. That wave's
    aggregate against stock's is the report's headline, and it takes seconds
    where a server's start and warmup take minutes."""
    return now <= deadline or n == n_max


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.generate_worker:
        return generate_worker(*args.generate_worker)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    deadline = started + args.budget_s
    model = resolve_model(args)
    if args.multi_turn:
        return main_multi_turn(model, args, out, started)

    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(Path(model)) if Path(model).exists() else None
    if tokenizer is None:
        from mlx_lm.utils import hf_repo_to_path

        tokenizer = load_tokenizer(hf_repo_to_path(model))
    prompts = make_prompts(tokenizer, max(args.concurrency), args.prompt_tokens)
    # The prefill check's prompt: its own text, so no stream shares its start.
    args.prefill_prompt = "Prefill. " + make_prompts(
        tokenizer, 1, args.prefill_tokens or args.prompt_tokens
    )[0]

    report = report_head(model, args)
    report["settings"].update({
        "concurrency": args.concurrency,
        "prompt_tokens": args.prompt_tokens,
        "max_tokens": args.max_tokens,
        "decode_pair_tokens": args.decode_pair_tokens if args.decode_pairs else None,
        "prefill_tokens": args.prefill_tokens or args.prompt_tokens,
        "budget_s": args.budget_s,
        "sampling": "greedy (temperature 0)",
        "server_flags": "--prompt-cache-size 0 (every request prefills)"
                        + (f", {' '.join(args.server_args)}" if args.server_args else "") + ", other flags default",
    })
    report["engines"] = {}
    # Each engine's prefill through generate, for its server's ratio: the
    # server's own per-request costs (HTTP, the batch generator's first step)
    # weigh on both engines, and stock's ratio shows how much.
    report["generate_check"] = {}
    for engine in args.engines:
        check, beside = None, not args.no_generate_check and not args.generate_check_after
        if beside:
            log(f"prefill check: mlx_lm stream_generate with {engine}, warming up beside the server")
            check = GenerateCheck(model, args.prefill_prompt, args.max_tokens, out, engine, args.count_rows,
                                  decode_prompt=prompts[0] if args.decode_pairs else "",
                                  decode_tokens=args.decode_pair_tokens)
        try:
            report["engines"][engine] = run_engine(engine, model, prompts, args, out, deadline, check)
        except Exception as exc:  # recorded; the other engine still runs
            report["engines"][engine] = {"engine": engine, "error": str(exc)}
            log(f"{engine}: failed: {exc}")
        if args.generate_check_after and not args.no_generate_check:
            if time.perf_counter() > deadline:
                report["generate_check"][engine] = {"skipped": "time budget"}
                continue
            log(f"prefill check: mlx_lm stream_generate with {engine}")
            check = GenerateCheck(model, args.prefill_prompt, args.max_tokens, out, engine, args.count_rows)
        if check is not None:
            # The server has stopped: the measured run has the GPU to itself.
            ready_s = max(args.server_timeout_s if args.generate_check_after else 30.0,
                          deadline - time.perf_counter())
            report["generate_check"][engine] = check.finish(ready_s, args.request_timeout_s)
    report["prefill_vs_generate"] = {e: r for e in args.engines if (r := prefill_ratio(report, e))}
    report["decode_vs_generate"] = {e: r for e in args.engines if (r := decode_ratio(report, e))}
    report["batch_scaling"] = batch_scaling(report)
    report["elapsed_s"] = time.perf_counter() - started

    stem = file_stem("serve", report["machine"], report["software"]["git_revision"])
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2, default=str))
    table = markdown(report)
    (out / f"{stem}.md").write_text(table)
    print(table)
    log(f"wrote {out / stem}.json and .md in {report['elapsed_s']:.0f} s")
    return 0


def report_head(model: str, args) -> Dict[str, Any]:
    """The serve JSON's head: kind, time, machine, software, the run's model settings."""
    return {
        "kind": "serve",
        "started": now_iso(),
        "machine": machine_info(),
        "software": software_info(),
        "settings": {
            "model": model if args.model else None,
            "shape": None if args.model else (args.shape or "demo"),
            "seed": args.seed,
            "conditioned": bool(args.conditioned),
            "engines": args.engines,
        },
    }


def main_multi_turn(model: str, args, out: Path, started: float) -> int:
    """``--multi-turn``: only the conversation (bench/multi_turn.py), in this process."""
    report = report_head(model, args)
    report["multi_turn"] = multi_turn.run(model, args)
    report["elapsed_s"] = time.perf_counter() - started
    stem = file_stem("serve-multi-turn", report["machine"], report["software"]["git_revision"])
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2, default=str))
    table = multi_turn.markdown(report["multi_turn"])
    (out / f"{stem}.md").write_text(table)
    print(table)
    log(f"wrote {out / stem}.json and .md in {report['elapsed_s']:.0f} s")
    return 0


def prefill_ratio(report: Dict[str, Any], engine: str) -> Optional[Dict[str, Any]]:
    first = report["engines"].get(engine, {}).get("prefill_single")
    gen = (report.get("generate_check") or {}).get(engine, {}).get("measured")
    if not first or not gen or not first.get("prefill_tps"):
        return None
    server_tps = first["prefill_tps"]
    return {
        "server_prefill_tps": server_tps,
        "server_prompt_tokens": first["prompt_tokens"],
        "server_first_ttft_s": first.get("first_ttft_s"),
        "server_ttft_s": first["ttft_s"],
        "generate_prefill_tps": gen["prompt_tps"],
        "generate_prompt_tokens": gen["prompt_tokens"],
        "ratio": server_tps / gen["prompt_tps"],
        "note": "server: prompt tokens / time to first text of one request alone, second of two "
        "(includes HTTP, queueing and the batch generator's first decode step); "
        "generate: stream_generate's prompt_tps, second of two runs, same prompt",
    }


def decode_ratio(report: Dict[str, Any], engine: str) -> Optional[Dict[str, Any]]:
    """One stream's decode under the server against mlx_lm.generate's decode
    of the same engine: the median of the decode pairs' ratios where there
    are pairs, else the one-stream wave against the generate check's
    measured run (--max-tokens tokens, run after the server stopped)."""
    pairs = [p for p in report["engines"].get(engine, {}).get("decode_pairs") or [] if p.get("ratio")]
    if pairs:
        return {"server_decode_tps": statistics.median(p["server_decode_tps"] for p in pairs),
                "generate_decode_tps": statistics.median(p["generate_decode_tps"] for p in pairs),
                "ratio": statistics.median(p["ratio"] for p in pairs), "pairs": len(pairs),
                "ratios": [p["ratio"] for p in pairs]}
    one = report["engines"].get(engine, {}).get("waves", {}).get("1")
    gen = (report.get("generate_check") or {}).get(engine, {}).get("measured")
    if not one or not gen or not one.get("decode_tps_median") or not gen.get("decode_tps"):
        return None
    return {"server_decode_tps": one["decode_tps_median"], "generate_decode_tps": gen["decode_tps"],
            "ratio": one["decode_tps_median"] / gen["decode_tps"]}


def batch_scaling(report: Dict[str, Any]) -> Dict[str, Any]:
    """Per engine and concurrency: per-stream decode against the engine's one
    stream, and lily's aggregate against stock's at the same concurrency."""
    out: Dict[str, Any] = {}
    for name, e in report["engines"].items():
        waves = e.get("waves", {})
        one = (waves.get("1") or {}).get("decode_tps_median")
        out[name] = {
            n: {"per_stream_vs_one": (w["decode_tps_median"] / one) if one and w.get("decode_tps_median") else None,
                "peak_memory_gb_after": w.get("peak_memory_gb_after")}
            for n, w in waves.items() if n != "1"
        }
    lily, stock = (report["engines"].get(k, {}).get("waves", {}) for k in ENGINES)
    out["aggregate_lily_vs_stock"] = {
        n: lily[n]["aggregate_tps"] / stock[n]["aggregate_tps"]
        for n in lily if n in stock and lily[n].get("aggregate_tps") and stock[n].get("aggregate_tps")
    }
    return out


def _fmt(x: Any, digits: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.{digits}f}"
    return str(x)


def split_table(report: Dict[str, Any]) -> List[str]:
    """The servers' decode steps by part (bench.serve_split): the one-stream
    wave's, then each batch size's over the whole run."""
    from .serve_split import PARTS

    rows = []
    for name, e in report["engines"].items():
        one = e.get("waves", {}).get("1", {}).get("host_split_ms")
        if one:
            rows.append((name, "1 (one-stream wave)", one))
        for b, split in (e.get("host_split_ms_by_batch") or {}).items():
            rows.append((name, b, split))
    if not rows:
        return []
    lines = ["", "Decode steps inside each server, median ms per step (bench/serve_split.py; `server`: the "
             "server's loop between two steps):", "",
             "| engine | B | " + " | ".join(PARTS) + " | token | steps |",
             "|---|---|" + "---:|" * (len(PARTS) + 2)]
    for name, b, split in rows:
        lines.append(f"| {name} | {b} | " + " | ".join(_fmt(split.get(p), 2) for p in (*PARTS, "token"))
                     + f" | {split.get('steps', '-')} |")
    return lines + [""]


_PRIMED = re.compile(r"\[mlx-lily\] primed in ([0-9.]+)s")
_FIRST_USE = re.compile(r"\[mlx-lily\] kernel (.*) first met inside a compiled step")
# mlx-lm's server logs each prompt's progress after each prefill call, one
# line per row of the call, from the request's own thread.
_PROGRESS = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) - \w+ - Prompt processing progress: "
                       r"(\d+)/(\d+)", re.M)
# Rows whose partial progress lines lie within this of each other were in one
# call (a call's lines come within a few ms; calls are a prefill apart).
PREFILL_CALL_GAP_S = 0.02


def prefill_calls(text: str) -> List[int]:
    """The rows of each prefill call a server log shows, in order: its lines
    of partial progress (``a/b`` with a < b; a prompt's last token goes with
    its first decode step), grouped where they come within
    PREFILL_CALL_GAP_S of each other."""
    calls: List[int] = []
    last = None
    for m in _PROGRESS.finditer(text):
        done, total = int(m.group(3)), int(m.group(4))
        if done >= total:
            continue
        at = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() + int(m.group(2)) / 1e3
        if last is None or at - last > PREFILL_CALL_GAP_S:
            calls.append(0)
        calls[-1] += 1
        last = at
    return calls


def server_log_facts(text: str) -> Dict[str, Any]:
    """What a lily server's log says about its start: the seconds priming
    took, and each kernel instance first met inside a compiled step (built in
    the middle of a request) after it."""
    primed = _PRIMED.search(text)
    after = text[primed.end():] if primed else text
    return {
        "primed_s": float(primed.group(1)) if primed else None,
        "first_uses_in_traces": [m.group(1) for m in _FIRST_USE.finditer(after)],
    }


def markdown(report: Dict[str, Any]) -> str:
    s = report["settings"]
    acc = report["machine"].get("accelerator", {})
    lines = [
        f"# mlx_lm.server load: {s['shape'] or s['model']}{' (conditioned)' if s.get('conditioned') else ''}",
        "",
        f"{acc.get('name', '?')}, mlx {report['software']['mlx']}, mlx-lm {report['software']['mlx_lm']}, "
        f"revision {report['software']['git_revision']}; prompts of ~{s['prompt_tokens']} tokens, "
        f"{s['max_tokens']} tokens per stream, greedy.",
        "",
        "| streams | engine | aggregate tok/s | TTFT median s | TTFT max s | per-stream decode tok/s (median / min) | greedy = single |",
        "|---:|---|---:|---:|---:|---:|---:|",
    ]
    counts = sorted({int(n) for e in report["engines"].values() for n in e.get("waves", {})})
    for n in counts:
        for name, e in report["engines"].items():
            w = e.get("waves", {}).get(str(n))
            if w is None:
                continue
            same = "reference" if n == 1 else w.get("same_as_single", "-")
            lines.append(
                f"| {n} | {name} | {_fmt(w['aggregate_tps'])} | {_fmt(w['ttft_median_s'], 3)} | "
                f"{_fmt(w['ttft_max_s'], 3)} | {_fmt(w['decode_tps_median'])} / {_fmt(w['decode_tps_min'])} | {same} |"
            )
        both = [report["engines"].get(k, {}).get("waves", {}).get(str(n)) for k in ENGINES]
        if all(both) and both[0]["aggregate_tps"] and both[1]["aggregate_tps"]:
            lines.append(f"| {n} | lily / stock | {both[0]['aggregate_tps'] / both[1]['aggregate_tps']:.2f} | | | | |")
    lines += ["", "1 stream: each prompt alone, one after another (aggregate = median stream tokens/s)."]
    for name, p in (report.get("prefill_vs_generate") or {}).items():
        lines.append(
            f"Prefill, one request, {name}: server {p['server_prefill_tps']:,.0f} tok/s ({p['server_prompt_tokens']} tokens) "
            f"vs mlx_lm generate {p['generate_prefill_tps']:,.0f} tok/s: ratio {p['ratio']:.2f}"
            + (f" (TTFT {p['server_ttft_s']:.3f} s; the first request of that length {p['server_first_ttft_s']:.3f} s)."
               if p.get("server_first_ttft_s") is not None else ".")
        )
    for name, d in (report.get("decode_vs_generate") or {}).items():
        tokens = report["settings"].get("decode_pair_tokens")
        how = (f"median of {d['pairs']} pairs run one after the other"
               + (f", {tokens} tokens a run" if tokens else "") + ", ratios "
               + ", ".join(f"{r:.2f}" for r in d["ratios"]) if d.get("pairs")
               else "the one-stream wave against generate's run after the server stopped")
        lines.append(f"Decode, one stream, {name}: server {d['server_decode_tps']:.1f} tok/s vs mlx_lm generate "
                     f"{d['generate_decode_tps']:.1f} tok/s: ratio {d['ratio']:.2f} ({how}).")
    lines += split_table(report)
    for name, g in (report.get("generate_check") or {}).items():
        gs = g.get("host_split_ms")
        if gs:
            lines.append(f"`mlx_lm.generate`'s own decode loop, {name} (median ms per token over {gs['steps']}): "
                         f"build {gs['build']:.2f}, launch {gs['launch']:.2f}, other {gs['other']:.2f} "
                         f"(the wait for the token before, detokenizing), token {gs['token']:.2f}.")
    for name, e in report["engines"].items():
        if e.get("peak_memory_gb") is not None:
            lines.append(f"Peak memory of the {name} server: {e['peak_memory_gb']:.2f} GiB.")
    for name, g in (report.get("generate_check") or {}).items():
        if g.get("error") or g.get("skipped"):
            lines.append(f"Prefill check, {name}: {g.get('skipped') or 'error: ' + ' '.join(g['error'])}.")
        c = g.get("batch_counts")
        if c and c.get("error"):
            lines.append(f"Batched step counts, {name}: error: {c['error']}.")
        elif c:
            lines.append(
                f"One decode step of {c['rows']} streams on the server's caches, {name}: "
                f"{c['kernels_per_decode_step']} kernels, {c['bytes_per_decode_step'] / 1e6:,.1f} MB against "
                f"{c['bytes_rows_must_read'] / 1e6:,.1f} MB the rows must read (ratio {c['ratio_to_must_read']:.2f}; "
                f"experts per MoE layer, the rows' union: median {statistics.median(c['experts_union_per_layer'])})."
            )
    for name, e in report["engines"].items():
        if e.get("error"):
            lines.append(f"{name}: error: {e['error']}")
        if e.get("skipped"):
            lines.append(f"{name}: skipped: {', '.join(e['skipped'])}")
        for n, w in e.get("waves", {}).items():
            if w.get("errors"):
                lines.append(f"{name}, {n} streams: errors: {'; '.join(w['errors'][:3])}")
            if w.get("first_uses_in_wave"):
                lines.append(f"{name}, {n} stream{'s' if n != '1' else ''}: {w['first_uses_in_wave']} kernel "
                             "instances first met inside this wave (built mid-wave): not the server's steady state.")
            if len(w.get("prefill_calls") or []) > 1:
                lines.append(f"{name}, {n} streams: prompts prefilled in {len(w['prefill_calls'])} calls of "
                             f"{', '.join(str(r) for r in w['prefill_calls'])} rows.")
            if w.get("prefill_split"):
                lines.append(f"{name}, {n} streams: prefill calls inside the server (rows, tokens: ms, of them "
                             "in eval / in async_eval): " + "; ".join(
                                 f"{c['rows']}, {c['tokens']}: {c['ms']:.1f} ({c['wait_ms']:.1f} / {c['launch_ms']:.1f})"
                                 for c in w["prefill_split"]) + ".")
            if (w.get("connect_max_s") or 0.0) >= SLOW_CONNECT_S:
                slow = sum(1 for st in w.get("streams", []) if (st.get("connect_s") or 0.0) >= SLOW_CONNECT_S)
                lines.append(f"{name}, {n} streams: {slow} connection{'s' if slow != 1 else ''} took "
                             f"{SLOW_CONNECT_S} s or more to be accepted (the slowest {w['connect_max_s']:.2f} s: "
                             "the server's listening queue overflowed, and those requests arrived late).")
    lily = report["engines"].get("lily", {})
    if "first_uses_in_traces" in lily:
        met = lily["first_uses_in_traces"]
        primed = (f"primed its kernels in {lily['primed_s']:.1f} s" if lily.get("primed_s") is not None
                  else "did not prime (no kernels to build here, or MLX_LILY_PRIME=0)")
        lines.append(f"Lily's server {primed}; kernel instances first met inside a compiled step after that: {len(met)}"
                     + (" (" + ", ".join(f"{name} x{n}" for name, n in
                                         sorted(collections.Counter(m.split(" ")[0] for m in met).items())) + ")."
                        if met else "."))
    paths = report["engines"].get("lily", {}).get("layer_paths")
    if paths is not None:
        stock = [r for r in paths if r["path"] == "stock"]
        kinds = sorted({(r["layer"], r["step"], r["batch"]) for r in paths})
        lines.append(
            f"Lily's layer paths under the server: {len(paths)} kinds of call, "
            f"{'all on lily' if not stock else f'{len(stock)} on stock: {stock}'}; "
            f"batch sizes seen: {sorted({k[2] for k in kinds})}."
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
