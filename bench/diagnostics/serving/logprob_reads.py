"""What the server's per-token log-probability read costs, each way lily can make it.

    python3 -m bench.diagnostics.serving.logprob_reads [--vocab 248320] [--batch 1,16] [--steps 50]
        [--rounds 3] [--out DIR]

``mlx_lm.server`` reads ``r.logprobs[r.token].item()`` for every streamed
token. For a lily model each row is a ``RowLogprobs`` (mlx_lily/served_logprobs.py),
read on the host from the evaluated row; on an H100 that read, with the array
it answers, took about 0.09 ms a token inside the server (py-spy). With
``MLX_LILY_STEP_PICKS=1`` lily instead queues, behind each step, the
log-probs of the tokens it sampled (``StepPicks``: one small array for all
rows, read once).

This runs steps as the server's generator ends them (a bf16 [B, 2048] x
[2048, vocab] product, the log-softmax in bf16 as mlx-lm takes it of lily's
bf16 logits, argmax, the rows kept as ``list(logprobs)``), pipelined as the
generator runs: step s + 1 is queued (and, in the picks arm, its picks behind
it) before step s's rows are read. Per step, for B rows, two arms alternated
over ``--rounds``:

* ``host read``: each row's ``RowLogprobs(row)[token].item()``;
* ``picks``: ``StepPicks`` made behind each step, each row's read of its
  token from them.

Columns: the host's µs making the picks, the µs reading every row's value,
and the wall µs a step in all (the GPU's work, the picks' included, and the
host's). Every value is checked against its row. Prints a table (median and
90th percentile) and writes ``logprob_reads.txt`` under --out."""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Dict, List

import mlx.core as mx

from bench.common import write_report

HIDDEN = 2048
ARMS = ("host read", "picks")


def make_step(weight: mx.array, batch: int, seed: int):
    """One step's rows (as mlx-lm keeps them) and sampled tokens, lazy."""
    x = mx.random.normal((batch, HIDDEN), key=mx.random.key(seed)).astype(weight.dtype)
    logits = x @ weight
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return list(logprobs), mx.argmax(logprobs, axis=-1)


def run_arm(weight: mx.array, batch: int, steps: int, picks: bool, seed: int = 0) -> Dict[str, List[float]]:
    """{"making", "reading", "step"}: µs per step over ``steps`` steps."""
    from mlx_lily import served_logprobs as sl

    def queue(s):
        rows, tokens = make_step(weight, batch, seed + s)
        mx.async_eval(rows, tokens)
        start = time.perf_counter()
        made = sl.StepPicks.of_step(rows, tokens) if picks else None
        spent = 1e6 * (time.perf_counter() - start)
        if picks and made is None:
            raise RuntimeError("StepPicks.of_step took no picks for these rows")
        return rows, tokens, made, spent

    out: Dict[str, List[float]] = {"making": [], "reading": [], "step": []}
    current = queue(0)
    last = time.perf_counter()
    for s in range(1, steps + 1):
        following = queue(s)  # in flight while this step's rows are read, as in the server
        rows, tokens, made, spent = current
        mx.eval(rows, tokens)
        ids = tokens.tolist()
        start = time.perf_counter()
        values = [sl.RowLogprobs(rows[i], made)[ids[i]].item() for i in range(batch)]
        out["reading"].append(1e6 * (time.perf_counter() - start))
        if picks:
            out["making"].append(spent)
            if sl._picks_failed:
                raise RuntimeError("a picks read failed: the picks arm read the rows instead")
        expected = [mx.array.__getitem__(rows[i], ids[i]).item() for i in range(batch)]
        if values != expected:
            raise AssertionError(f"a read gave {values}, the rows hold {expected}")
        now = time.perf_counter()
        out["step"].append(1e6 * (now - last))
        last = now
        current = following
    mx.eval(current[0], current[1])
    return out


def summary(values: List[float]) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{statistics.median(ordered):.1f} / {ordered[int(0.9 * (len(ordered) - 1))]:.1f}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=248320, help="row length (default: Qwen3.6's vocabulary)")
    p.add_argument("--batch", default="1,16", help="rows a step, comma-separated (default 1,16)")
    p.add_argument("--steps", type=int, default=50, help="steps an arm runs in each round (default 50)")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the two arms alternated in each (default 3)")
    p.add_argument("--out", help="also write DIR/logprob_reads.txt")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batch.split(",") if b.strip()]
    if not batches or min(batches) < 1 or args.steps < 1 or args.rounds < 1 or args.vocab < 2:
        p.error("--batch takes positive row counts; --steps and --rounds at least 1; --vocab at least 2")

    weight = mx.random.normal((HIDDEN, args.vocab), key=mx.random.key(0)).astype(mx.bfloat16)
    mx.eval(weight)
    lines = [f"The server's log-probability read, µs a step (median / 90th percentile over {args.rounds} rounds "
             f"of {args.steps} steps an arm, alternated; vocabulary {args.vocab}, bf16 rows; device "
             f"{mx.default_device()})", "",
             "| rows | arm | making picks | reading the rows' values | a step in all |",
             "|---:|---|---:|---:|---:|"]
    for batch in batches:
        for arm in ARMS:
            run_arm(weight, batch, 3, arm == "picks")  # builds and first uses
        got = {arm: {"making": [], "reading": [], "step": []} for arm in ARMS}
        for r in range(args.rounds):
            for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
                for key, values in run_arm(weight, batch, args.steps, arm == "picks", seed=1000 * r).items():
                    got[arm][key] += values
        for arm in ARMS:
            g = got[arm]
            lines.append(f"| {batch} | {arm} | {summary(g['making'])} | {summary(g['reading'])} | {summary(g['step'])} |")
    write_report(args.out, "logprob_reads.txt", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
