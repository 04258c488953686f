"""How long a request that arrives while the server decodes waits for its first token.

    python3 -m bench.diagnostics.serving.admission [--model M | --shape S] [--reps 8] [--out DIR]

mlx-lm's server reads its request queue between rounds of batch steps, each
round half a second long; with a lily model it ends a round once a request
waits (``mlx_lily/server_admission.py``, ``MLX_LILY_EARLY_ADMISSION``). This
starts one lily server per setting (on, then off) and, in each, ``--reps``
times: a long request, and once it is decoding (its first token out) and a
delay later, a short one. The delays spread evenly over one round, so
without early admission the short request's wait for the round's end
averages a quarter second. Per setting: the short requests' times to first
token (the first repetition, which builds what the server had not met yet,
is left out). Prints a table and writes ``admission.json`` to DIR.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List

from bench.common import log, write_json, write_report
from bench.serve import HOST, Server, sse_chunks, stream
from mlx_lily.server_admission import ENV

ROUND_S = 0.5  # mlx-lm's TimeBudget
LONG_PROMPT = "The long request decodes while the short one arrives. " * 4
SHORT_PROMPT = "A short request. " * 4


def _long_request(port: int, max_tokens: int, decoding: threading.Event, timeout_s: float) -> None:
    """A streamed completion of ``max_tokens``; ``decoding`` is set at its first token."""
    body = {"prompt": LONG_PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    conn = http.client.HTTPConnection(HOST, port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(body).encode(),
                     headers={"Content-Type": "application/json"})
        for chunk in sse_chunks(conn.getresponse()):
            if any(c.get("text") for c in chunk.get("choices") or []):
                decoding.set()
    finally:
        decoding.set()  # never leave the caller waiting
        conn.close()


def measure(port: int, reps: int, long_tokens: int, timeout_s: float) -> Dict[str, Any]:
    """The short requests' times to first token, one per repetition after the first."""
    ttfts: List[float] = []
    for rep in range(reps + 1):
        decoding = threading.Event()
        long = threading.Thread(target=_long_request, args=(port, long_tokens, decoding, timeout_s), daemon=True)
        long.start()
        decoding.wait(timeout_s)
        time.sleep(ROUND_S * (rep % reps) / reps)
        short = stream(port, SHORT_PROMPT, 2, timeout_s)
        long.join(timeout_s)
        if rep:
            ttfts.append(short["ttft_s"])
    return {"ttft_s": [round(t, 4) for t in ttfts], "ttft_median_s": round(statistics.median(ttfts), 4),
            "ttft_max_s": round(max(ttfts), 4)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="a checkpoint path or hub id")
    src.add_argument("--shape", default="demo", help="a random checkpoint's shape (default demo)")
    p.add_argument("--reps", type=int, default=8, help="short requests timed per setting (default 8)")
    p.add_argument("--long-tokens", type=int, default=256, help="tokens of the long request (default 256)")
    p.add_argument("--timeout-s", type=float, default=600, help="server start and request limit")
    p.add_argument("--out", help="also write DIR/admission.md and DIR/admission.json")
    args = p.parse_args(argv)
    if args.reps < 1:
        p.error("--reps must be at least 1")
    model = args.model
    if model is None:
        from mlx_lily.random_checkpoints import make_checkpoint

        model = str(make_checkpoint(None, shape=args.shape))
    held = os.environ.get(ENV)
    settings: Dict[str, Dict[str, Any]] = {}
    try:
        for value in ("1", "0"):
            os.environ[ENV] = value
            logs = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="admission-"))
            logs.mkdir(parents=True, exist_ok=True)
            log(f"{ENV}={value}: starting the server")
            server = Server(model, "lily", logs, args.long_tokens, args.timeout_s)
            try:
                settings[value] = measure(server.port, args.reps, args.long_tokens, args.timeout_s)
            finally:
                server.stop()
            (logs / "server-lily.log").rename(logs / f"server-lily-admission-{value}.log")
    finally:
        if held is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = held
    lines = [f"A short request's time to first token while a long one decodes ({model}; {args.reps} "
             f"requests a setting, arriving 0 to {ROUND_S} s after the long one's first token)", "",
             f"| {ENV} | median s | max s | each |", "|---|---:|---:|---|"]
    for value, r in settings.items():
        lines.append(f"| {value} | {r['ttft_median_s']:.3f} | {r['ttft_max_s']:.3f} | "
                     + ", ".join(f"{t:.3f}" for t in r["ttft_s"]) + " |")
    write_report(args.out, "admission.md", "\n".join(lines) + "\n")
    write_json(args.out, "admission.json", {"model": model, "reps": args.reps, "long_tokens": args.long_tokens,
                                            "round_s": ROUND_S, "settings": settings})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
