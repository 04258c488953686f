"""The host's work to build a speculative round's parts, measured on any machine.

    python3 -m bench.diagnostics.decode.spec_host_cost [--layers 40] [--calls 20] [--rounds 7] [--out DIR]

On the H200 a speculative round (``mlx_lily.mtp_decode``) is bound by the
host: building the MTP head's drafts and the verification pass, then
launching their kernels, take longer than the GPU runs them (``bench --spec``
records the parts). This measures the building part without a GPU, as
``host_cost`` does for a decode step: every lily kernel op takes its kernel
path "on CUDA", each launch replaced by a stub that returns an output of the
right shape and dtype. The model has the real model's layer stack (40
layers, attention every 4th) at the demo shape's widths, with an MTP head.

Rows, each the median over rounds of the median call: one decode step (the
model's one-token call and the argmax: what a round is weighed against); the
verification pass over P = 2, 3, 4 positions as the loop builds it (the pass,
its logits, log-softmax and argmax; ``mtp_decode._verify``); the head's draft
over S = 1 and 2 verified positions (the head, its logits and argmax); a
round's 3 greedy drafts from 4 positions, step by step and as the loop now
makes them, in one call (``verify_step.head_drafts``). The
numbers are this machine's CPU; a faster host scales them down, not their
proportions.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Dict, List

import mlx.core as mx

from bench.common import write_report
from bench.diagnostics.decode.host_cost import stubbed_kernels

POSITIONS = (2, 3, 4)
DRAFT_POSITIONS = (1, 2)


def median_ms(build: Callable[[], Any], undo: Callable[[], None], calls: int) -> float:
    """Median milliseconds to build ``build()``'s graph; each result is
    evaluated (untimed), then ``undo()`` puts the caches back."""
    times: List[float] = []
    for _ in range(calls):
        start = time.perf_counter()
        out = build()
        times.append(time.perf_counter() - start)
        mx.eval(out)
        undo()
    return 1e3 * statistics.median(times)


def parts(model: Any, calls: int) -> Dict[str, Callable[[], float]]:
    """{row: a function measuring it once}, on caches prefilled here (the
    model's, made trimmable as the MTP loop makes them, and the head's)."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from mlx_lily import mtp, mtp_decode
    from mlx_lily.trimmable_cache import make_trimmable

    text = model.language_model.model
    head = mtp.head_of(model)
    embed = text.embed_tokens
    D = model.language_model.args.hidden_size
    prompt = mx.array([list(range(1, 65))])
    cache = make_prompt_cache(model)
    mx.eval(model(prompt, cache=cache))
    make_trimmable(cache, depth=2 * (max(POSITIONS) + 1))
    head_cache = [KVCache()]
    mx.eval(head(mx.zeros((1, 64, D), dtype=mx.bfloat16), embed(prompt + 1), head_cache))
    token = mx.array([[3]])

    def step():
        return mx.argmax(model(token, cache=cache)[:, -1], axis=-1)

    def back(n: int) -> Callable[[], None]:
        return lambda: [c.trim(n) for c in cache]

    def verify(P: int) -> Callable[[], Any]:
        ys = mx.array(list(range(3, 3 + P)), dtype=mx.uint32)

        def build():
            out, logits = mtp_decode._verify(model, ys, cache)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            return [out, logprobs, mx.argmax(logprobs, axis=-1)]
        return build

    def draft(S: int) -> Callable[[], Any]:
        hidden = mx.zeros((1, S, D), dtype=mx.bfloat16)
        after = mx.array([list(range(5, 5 + S))])

        def build():
            g = head(hidden, embed(after), head_cache)[:, -1:]
            return mx.argmax(mtp_decode._head_logits(model, g)[0], axis=-1)
        return build

    def drafts(S: int, k: int, chained: bool) -> Callable[[], Any]:
        """A round's k greedy drafts from S positions: the loop's head calls,
        logits and argmaxes one by one, or as the loop makes them now, one
        call (``mtp_decode._greedy_drafts``)."""
        hidden = mx.zeros((1, S, D), dtype=mx.bfloat16)
        after = mx.array(list(range(5, 5 + S)))

        def build():
            if chained:
                return mtp_decode._greedy_drafts(model, hidden, after, head_cache, k, cache)
            g = head(hidden, embed(after[None]), head_cache)[:, -1:]
            out = []
            for j in range(k):
                out.append(mx.argmax(mtp_decode._head_logits(model, g, cache)[0], axis=-1))
                if j + 1 < k:
                    g = head(g, embed(out[-1][None]), head_cache)
            return out
        return build

    def head_back(S: int) -> Callable[[], None]:
        return lambda: [c.trim(S) for c in head_cache]

    rows: Dict[str, Callable[[], float]] = {"decode step": lambda: median_ms(step, back(1), calls)}
    for P in POSITIONS:
        rows[f"verify pass, {P} positions"] = (lambda P=P: median_ms(verify(P), back(P), calls))
    for S in DRAFT_POSITIONS:
        rows[f"head's draft, {S} position{'s' if S > 1 else ''}"] = (
            lambda S=S: median_ms(draft(S), head_back(S), calls))
    for how, chained in (("step by step", False), ("one call", True)):
        rows[f"head's 3 drafts from 4 positions, {how}"] = (
            lambda chained=chained: median_ms(drafts(4, 3, chained), head_back(4 + 2), calls))
    for measure in rows.values():  # first builds and traces, untimed
        measure()
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--calls", type=int, default=20, help="calls per measurement (default 20)")
    p.add_argument("--rounds", type=int, default=7,
                   help="rounds; each measures every row once, in turn, and the median over rounds "
                        "is reported (default 7)")
    p.add_argument("--out", help="also write DIR/spec_host_cost.txt")
    args = p.parse_args(argv)

    from mlx_lily.models.qwen3_5_moe import Model, specialize
    from mlx_lily.random_checkpoints import SHAPES, build_model

    shape = dict(SHAPES["demo"], num_hidden_layers=args.layers)
    model, _ = build_model(shape, seed=0, model_class=Model, mtp=True)
    specialize(model)  # the head's layer on lily's classes too, as a loaded checkpoint's
    with stubbed_kernels():
        rows = parts(model, args.calls)
        times: Dict[str, List[float]] = {name: [] for name in rows}
        for _ in range(args.rounds):
            for name, measure in rows.items():
                times[name].append(measure())
    median = {name: statistics.median(ts) for name, ts in times.items()}
    step = median["decode step"]
    lines = [f"Host ms to build a speculative round's parts ({args.layers} layers, demo widths, kernels "
             f"stubbed as on CUDA; median over {args.rounds} rounds of {args.calls} calls, rows interleaved)", "",
             "| part | host ms | / decode step |", "|---|---:|---:|"]
    for name, ms in median.items():
        lines.append(f"| {name} | {ms:.3f} | {ms / step:.2f} |")
    write_report(args.out, "spec_host_cost.txt", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
