"""What the server's per-token log-probability read costs, each way lily can make it.

    python3 -m bench.diagnostics.serving.logprob_reads [--vocab 248320] [--batch 1,16] [--steps 100] [--out DIR]

``mlx_lm.server`` reads ``r.logprobs[r.token].item()`` for every streamed
token. For a lily model each row is a ``RowLogprobs`` (mlx_lily/served_logprobs.py),
read on the host from the evaluated row; on an H100 that read took about 0.09
ms a token inside the server (py-spy), where on a CPU it takes microseconds.
``MLX_LILY_STEP_PICKS=1`` instead queues, behind each step, the log-probs of
the tokens it sampled (``StepPicks``: one small array for all rows, read once).

This makes steps as the server's generator does at the last layer (a bf16
[B, 2048] x [2048, vocab] product, log-softmax in float32, argmax, the rows
kept as ``list(logprobs)``), and times per step, for B rows:

* ``host read``: each row's ``RowLogprobs(row)[token].item()``;
* ``picks``: making ``StepPicks`` while the step is in flight (what the
  generator adds each step), then each row's read of its token from them.

Each read is made after its step is evaluated, as the server's are. Prints a
table (median and 90th percentile microseconds a step) and writes
``logprob_reads.txt`` under --out."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable, List

import mlx.core as mx

from bench.common import write_report

HIDDEN = 2048


def make_step(weight: mx.array, batch: int, seed: int):
    """One step's rows (as mlx-lm keeps them) and sampled tokens, lazy."""
    x = mx.random.normal((batch, HIDDEN), key=mx.random.key(seed)).astype(weight.dtype)
    logits = (x @ weight).astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return list(logprobs), mx.argmax(logprobs, axis=-1)


def time_reads(weight: mx.array, batch: int, steps: int, picks: bool) -> tuple:
    """(µs a step making the picks, µs a step reading every row's token),
    each a list over ``steps`` steps."""
    from mlx_lily.served_logprobs import RowLogprobs, StepPicks

    making: List[float] = []
    reading: List[float] = []
    for s in range(steps):
        rows, tokens = make_step(weight, batch, s)
        mx.async_eval(rows, tokens)
        made = None
        if picks:
            start = time.perf_counter()
            made = StepPicks.of_step(rows, tokens)
            making.append(1e6 * (time.perf_counter() - start))
        mx.eval(rows, tokens)
        ids = tokens.tolist()
        start = time.perf_counter()
        values = [RowLogprobs(rows[i], made)[ids[i]].item() for i in range(batch)]
        reading.append(1e6 * (time.perf_counter() - start))
        expected = [rows[i][ids[i]].item() for i in range(batch)]
        if values != expected:
            raise AssertionError(f"a read gave {values}, the rows hold {expected}")
    return making, reading


def summary(values: List[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{statistics.median(ordered):.1f} / {ordered[int(0.9 * (len(ordered) - 1))]:.1f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=248320, help="row length (default: Qwen3.6's vocabulary)")
    p.add_argument("--batch", default="1,16", help="rows a step, comma-separated (default 1,16)")
    p.add_argument("--steps", type=int, default=100, help="steps timed a row of the table (default 100)")
    p.add_argument("--out", help="also write DIR/logprob_reads.txt")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",") if b.strip()]
    if not batches or min(batches) < 1 or args.steps < 1 or args.vocab < 2:
        p.error("--batch takes positive row counts, --steps at least 1, --vocab at least 2")

    weight = mx.random.normal((HIDDEN, args.vocab), key=mx.random.key(0)).astype(mx.bfloat16)
    mx.eval(weight)
    lines = [f"The server's log-probability read a step, µs (median / 90th percentile over {args.steps} steps; "
             f"vocabulary {args.vocab}; device {mx.default_device()})", "",
             "| rows | host read: reads | picks: making them | picks: reads | picks: both |",
             "|---:|---:|---:|---:|---:|"]
    for batch in batches:
        time_reads(weight, batch, 5, True)  # builds and first uses
        _, host = time_reads(weight, batch, args.steps, False)
        making, reads = time_reads(weight, batch, args.steps, True)
        both = [m + r for m, r in zip(making, reads)]
        lines.append(f"| {batch} | {summary(host)} | {summary(making)} | {summary(reads)} | {summary(both)} |")
    write_report(args.out, "logprob_reads.txt", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
