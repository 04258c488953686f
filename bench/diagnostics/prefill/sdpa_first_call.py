"""What a prefill attention call of a shape not met before costs (a GPU run).

    python3 -m bench.diagnostics.prefill.sdpa_first_call [--out DIR]

On CUDA, lily's prefill attention is MLX's sdpa (``kernels/attention/
cuda_prefill.py``), for which MLX keeps state per shape (queries, keys): a
cuDNN execution plan where cuDNN takes the call, the matmuls' heuristics on
its unfused path. A prompt resumed from a prefix checkpoint ends in a call
whose shape is new (its own number of queries over the whole history's keys),
so whatever MLX builds there is part of that request's time to first token.
This times, at the real head shapes (16 query / 2 KV
heads of 256, bf16, causal), each call's first run and its second at the same
shape, synchronously, after an unrelated shape has warmed MLX up: the
difference is what a shape met for the first time costs. The shapes are those
of the 16K multi-turn bench's follow-ups (about 1,200 queries over 9K to 16K
keys) and of cold 2048-token chunks, and pairs that differ only in their
queries or only in their keys.

Prints a table and writes ``sdpa_first_call.json`` to DIR.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

from bench.common import write_json, write_report

HQ, HKV, D = 16, 2, 256
WARMUP_SHAPE = (512, 3000)
# (what the shape is, queries, keys)
SHAPES = (
    ("follow-up, turn 2", 1234, 9362),
    ("follow-up, turn 7", 1196, 15212),
    ("follow-up, turn 8", 1214, 16382),
    ("turn 8's keys, 18 fewer queries", 1196, 16382),
    ("turn 8's queries, 64 more keys", 1214, 16446),
    ("cold chunk at 8K", 2048, 8192),
    ("cold last chunk at 16K", 2046, 16382),
    ("64 queries at 4K", 64, 4096),
)
REPEATS = 3


def timed(q, k, v) -> float:
    from mlx_lily.kernels.attention.sdpa import attention_reference

    start = time.perf_counter()
    mx.eval(attention_reference(q, k, v, D**-0.5, "causal"))
    return time.perf_counter() - start


def inputs(queries: int, keys: int, seed: int):
    mx.random.seed(seed)
    q = mx.random.normal((1, HQ, queries, D)).astype(mx.bfloat16)
    k = mx.random.normal((1, HKV, keys, D)).astype(mx.bfloat16)
    v = mx.random.normal((1, HKV, keys, D)).astype(mx.bfloat16)
    mx.eval(q, k, v)
    return q, k, v


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args(argv)

    for _ in range(2):
        timed(*inputs(*WARMUP_SHAPE, seed=0))
    rows = []
    lines = ["Prefill attention calls through lily's CUDA path (MLX's causal sdpa, keys padded to a multiple",
             f"of 8), 16 query / 2 KV heads of {D}, bf16; ms, synchronous; later: median of {REPEATS} more runs",
             "", "| shape | queries | keys | first run | later | first - later |", "|---|---:|---:|---:|---:|---:|"]
    for seed, (what, queries, keys) in enumerate(SHAPES, start=1):
        q, k, v = inputs(queries, keys, seed)
        first = timed(q, k, v)
        later = statistics.median(timed(q, k, v) for _ in range(REPEATS))
        rows.append({"shape": what, "queries": queries, "keys": keys, "first_ms": 1e3 * first,
                     "later_ms": 1e3 * later, "first_extra_ms": 1e3 * (first - later)})
        lines.append(f"| {what} | {queries} | {keys} | {1e3 * first:.1f} | {1e3 * later:.1f} | "
                     f"{1e3 * (first - later):.1f} |")
    write_report(args.out, "sdpa_first_call.md", "\n".join(lines) + "\n")
    write_json(args.out, "sdpa_first_call.json", {"device": str(mx.default_device()), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
