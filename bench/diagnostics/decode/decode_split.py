"""Where the host's time goes in one lily decode step, part by part.

    python3 -m bench.diagnostics.decode.decode_split [--shape qwen3.6-35b-a3b] [--context 4096] [--steps 32] [--rounds 1]
        [--gpu-clocks] [--segments] [--out DIR]
    python3 -m bench.diagnostics.decode.decode_split --batch 1,4,8,16 [--context 256] [--out DIR]

The real model's layer stack (random weights at ``--shape``), a prompt of
CONTEXT tokens, then STEPS decode steps on lily's path. Each step is timed in
three phases, the next step starting only when the last is done:

* build: ``model(token)`` returns the step's graph, split into its parts
  (eligibility and masks, the weights check; on the whole-step path its
  compiled call and the KV caches' capacity; on the segmented path the
  compiled segment calls, the KV-cache writes and the attention ops between
  segments; and the rest);
* launch: ``mx.async_eval`` returns (MLX encodes and launches every kernel of
  the step; host work on CUDA);
* wait: until the step's results are ready (the GPU's work not yet done).

Decode is also timed as mlx-lm's ``generate_step`` runs it, each step's
build and launch overlapping the GPU's work on the step before: first after
a fresh prompt of CONTEXT tokens (as the A/B measures decode, though without
the A/B's warmup at that length), then after the split steps; with the
slowest tokens, so that a stall shows, and the time Python's garbage
collector took meanwhile. Where build plus launch is close to the time per
token, the host bounds decode. ``--rounds N`` repeats the split steps and the
decode after them N times on the same cache: whether decode slows as the
process goes on, and in which phase. ``--gpu-clocks`` adds the GPU's clocks,
power and load during each decode run (``bench.gpu_clocks``, NVIDIA): whether
a slow run had a slow GPU. ``--batch 1,4`` times the server's batched step
instead, on its batch caches (``decode_split_batch.txt``): the same phases,
then the step pipelined as mlx-lm's loops run it (build and launch, then
the wait for the token before).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
from collections import defaultdict
from typing import Any, Callable, Dict, Iterator, List, Optional

import mlx.core as mx

from bench.common import write_report
from bench.gpu_clocks import describe as describe_clocks
from bench.gpu_clocks import sampled_clocks
from bench.diagnostics.decode.host_cost import held

PARTS = ("eligibility and masks", "weights check", "whole-step call", "KV capacity", "segment calls",
         "KV-cache writes", "attention ops", "batched step")


@contextlib.contextmanager
def timed_parts(cache: Any, spent: Dict[str, float]) -> Iterator[None]:
    """The text model's parts (and the KV caches' writes) add their seconds
    to ``spent`` while the block runs."""
    from mlx_lily.layers import text_model

    def timing(part: str, fn: Callable) -> Callable:
        def wrapped(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[part] += time.perf_counter() - start
        return wrapped

    cls = text_model.LilyTextModel
    segment = cls._segment
    whole = cls._whole
    masks = cls._segment_masks

    def eligibility(self, *args):
        # Less the weights check it makes, which is a part of its own.
        start, checked = time.perf_counter(), spent["weights check"]
        try:
            return masks(self, *args)
        finally:
            spent["eligibility and masks"] += time.perf_counter() - start - (spent["weights check"] - checked)

    def timed_segment(self, *args):
        return timing("segment calls", segment(self, *args))

    def timed_whole(self, *args):
        return timing("whole-step call", whole(self, *args))

    class TimedKernels:
        def __getattr__(self, name):
            return getattr(real_kernels, name)

        attention = staticmethod(timing("attention ops", text_model.K.attention))

    real_kernels = text_model.K
    with contextlib.ExitStack() as stack:
        stack.enter_context(held(cls, "_segment_masks", eligibility))
        stack.enter_context(held(cls, "_weights_version", timing("weights check", cls._weights_version)))
        stack.enter_context(held(cls, "_segment", timed_segment))
        stack.enter_context(held(cls, "_whole", timed_whole))
        stack.enter_context(held(cls, "_whole_takes", timing("eligibility and masks", cls._whole_takes)))
        stack.enter_context(held(cls, "_batch_takes", timing("eligibility and masks", cls._batch_takes)))
        stack.enter_context(held(cls, "_decode_batch", timing("batched step", cls._decode_batch)))
        stack.enter_context(held(text_model, "reserve_rows", timing("KV capacity", text_model.reserve_rows)))
        stack.enter_context(held(text_model, "K", TimedKernels()))
        for c in cache:
            if hasattr(c, "keys") and hasattr(c, "update_and_fetch"):
                stack.enter_context(held(c, "update_and_fetch", timing("KV-cache writes", c.update_and_fetch)))
        yield


def split_steps(model: Any, cache: Any, steps: int, batch: int = 1) -> Dict[str, float]:
    """Median ms per step of each phase and part (``batch`` rows a step: the
    server's batch caches)."""
    rows: Dict[str, List[float]] = defaultdict(list)
    tok = mx.ones((batch, 1), dtype=mx.int32)
    for _ in range(steps):
        spent: Dict[str, float] = defaultdict(float)
        with timed_parts(cache, spent):
            start = time.perf_counter()
            logits = model(tok, cache=cache)
            tok = mx.argmax(logits[:, -1:], axis=-1)
            built = time.perf_counter()
        mx.async_eval(tok, [c.state for c in cache])
        launched = time.perf_counter()
        mx.eval(tok)
        done = time.perf_counter()
        rows["build"].append(built - start)
        for part in PARTS:
            rows[part].append(spent[part])
        rows["rest of build"].append(built - start - sum(spent[p] for p in PARTS))
        rows["launch"].append(launched - built)
        rows["wait"].append(done - launched)
        rows["step"].append(done - start)
    return {name: 1e3 * statistics.median(v) for name, v in rows.items()}


def pipelined_ms(model: Any, cache: Any, steps: int, batch: int = 1) -> Dict[str, float]:
    """Median ms per step of decode steps run as mlx-lm's loops run them:
    each step built and submitted, then the token before it read (so the
    host builds a step while the GPU runs the one before): the build, the
    launch, the wait for the previous token, and the step."""
    rows: Dict[str, List[float]] = defaultdict(list)
    tok = mx.ones((batch, 1), dtype=mx.int32)
    previous = None
    for _ in range(steps):
        start = time.perf_counter()
        logits = model(tok, cache=cache)
        tok = mx.argmax(logits[:, -1:], axis=-1)
        built = time.perf_counter()
        mx.async_eval(tok)
        launched = time.perf_counter()
        if previous is not None:
            previous.tolist()
        done = time.perf_counter()
        previous = tok
        for name, seconds in (("build", built - start), ("launch", launched - built), ("wait", done - launched),
                              ("step", done - start)):
            rows[name].append(seconds)
    mx.eval(tok)
    return {name: 1e3 * statistics.median(v[1:] or v) for name, v in rows.items()}


@contextlib.contextmanager
def collector_time(spent: List[float]) -> Iterator[None]:
    """Appends the seconds of each garbage collection while the block runs."""
    started: List[float] = []

    def callback(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            spent.append(time.perf_counter() - started.pop())

    gc.callbacks.append(callback)
    try:
        yield
    finally:
        gc.callbacks.remove(callback)


def generate_token_ms(model: Any, prompt: mx.array, cache: Any, steps: int,
                      collections: Optional[List[float]] = None, window: Optional[list] = None) -> List[float]:
    """Ms between consecutive decode tokens as mlx-lm's generate_step yields
    them (each step's graph built and launched before the previous token is
    read: the A/B's decode figure is ``steps / sum`` of these); the garbage
    collections' seconds meanwhile go to ``collections``, and the decode's
    (start, end) in ``time.time()`` seconds to ``window``."""
    from mlx_lm.generate import generate_step

    gen = generate_step(prompt, model, max_tokens=steps + 1, prompt_cache=cache)
    next(gen)
    times: List[float] = []
    with collector_time(collections if collections is not None else []):
        began = time.time()
        last = time.perf_counter()
        for _ in range(steps):
            next(gen)
            now = time.perf_counter()
            times.append(1e3 * (now - last))
            last = now
    if window is not None:
        window.extend((began, time.time()))
    gen.close()
    mx.synchronize()
    return times


def describe_tokens(times: List[float], collections: Optional[List[float]] = None) -> str:
    slow = sorted(range(len(times)), key=lambda i: -times[i])[:5]
    gc_note = ""
    if collections is not None:
        n = len(collections)
        gc_note = f"; {n} garbage collection{'' if n == 1 else 's'}, {1e3 * sum(collections):.1f} ms in all"
    return (f"{len(times) / sum(times) * 1e3:.1f} tok/s (mean {statistics.mean(times):.2f} ms, median "
            f"{statistics.median(times):.2f}, slowest: " + ", ".join(f"#{i} {times[i]:.1f}" for i in slow)
            + f"{gc_note})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3.6-35b-a3b")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1, help="split steps, then decode, this many times (default 1)")
    p.add_argument("--gpu-clocks", action="store_true",
                   help="the GPU's clocks, power and load during each decode run (nvidia-smi)")
    p.add_argument("--segments", action="store_true",
                   help="decode in compiled segments (the server's path, and the path before the whole step)")
    p.add_argument("--batch", help="comma-separated stream counts: the server's batched step on its batch caches "
                                   "(split and pipelined steps) instead of generate_step's decode")
    p.add_argument("--out", help="also write DIR/decode_split.txt")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.steps < 1:
        p.error("--rounds and --steps: at least 1")
    if args.batch:
        return batch_main(args)

    from bench.engines import load_shared, switch
    from bench.measure import prefilled_cache

    model, vocab, _, _ = load_shared({"model": None, "shape": args.shape, "seed": 0, "conditioned": False})
    switch(model, "lily")
    if args.segments:
        model.language_model.model.__dict__["_lily_whole_ok"] = False
    from bench.measure import make_prompt_cache, prompt_array

    # As the A/B decodes: a fresh prompt through generate_step, then its tokens.
    def decode_run(prompt: mx.array, cache: Any) -> tuple:
        """(ms per token, garbage collections' seconds, the GPU's clocks)."""
        collections: List[float] = []
        window: list = []
        with sampled_clocks(args.gpu_clocks) as clocks:
            times = generate_token_ms(model, prompt, cache, args.steps, collections, window)
        return times, collections, clocks.summary(*window)

    fresh = decode_run(prompt_array(args.context, vocab), make_prompt_cache(model))
    cache = prefilled_cache(model, vocab, args.context)
    splits, afters = [], []
    for _ in range(args.rounds):
        splits.append(split_steps(model, cache, args.steps))
        afters.append(decode_run(mx.array([1, 2]), cache))
    heads = " | ".join(f"round {r + 1}" for r in range(args.rounds))
    path = "compiled segments" if args.segments else "lily's default path"
    lines = [f"One lily decode step at {args.context} tokens of context ({args.shape}, {path}), "
             f"median ms over {args.steps} steps", "", f"| phase | {heads} |", "|---|" + "---:|" * args.rounds]
    for phase in ("build", *(f"- {part}" for part in PARTS + ("rest of build",)), "launch", "wait", "step"):
        lines.append(f"| {phase} | " + " | ".join(f"{s[phase.lstrip('- ')]:.2f}" for s in splits) + " |")
    def described(run: tuple) -> str:
        times, collections, clocks = run
        text = describe_tokens(times, collections)
        return text + (f"; {describe_clocks(clocks)}" if args.gpu_clocks else "")

    lines += ["", f"generate_step after a fresh {args.context}-token prompt (as the A/B): {described(fresh)}"]
    for r, after in enumerate(afters):
        lines.append(f"generate_step after round {r + 1}'s split steps: {described(after)}")
    write_report(args.out, "decode_split.txt", "\n".join(lines) + "\n")
    return 0


def batch_main(args) -> int:
    """--batch: per stream count B, the server's step of B streams on its
    batch caches (each stream's prompt prefilled alone, then merged as
    BatchGenerator merges them), split into phases, then pipelined."""
    from bench.diagnostics.decode.decode_profile import batch_cache
    from bench.engines import load_shared, switch

    model, vocab, _, _ = load_shared({"model": None, "shape": args.shape, "seed": 0, "conditioned": False})
    switch(model, "lily")
    batches = [int(b) for b in args.batch.split(",")]
    splits, piped = [], []
    for rows in batches:
        cache = batch_cache(model, vocab, args.context, rows)
        split_steps(model, cache, 3, rows)  # traces and first-use checks
        splits.append(split_steps(model, cache, args.steps, rows))
        piped.append(pipelined_ms(model, cache, args.steps, rows))
    heads = " | ".join(f"B = {b}" for b in batches)
    lines = [f"The server's decode step at about {args.context} tokens of context ({args.shape}, lily), "
             f"median ms over {args.steps} steps", "", f"| phase | {heads} |", "|---|" + "---:|" * len(batches)]
    for phase in ("build", *(f"- {part}" for part in PARTS + ("rest of build",)), "launch", "wait", "step"):
        lines.append(f"| {phase} | " + " | ".join(f"{s[phase.lstrip('- ')]:.2f}" for s in splits) + " |")
    lines += ["", "Pipelined (each step built and submitted before the token before it is read, as "
              "mlx-lm's loops run decode):", "", f"| phase | {heads} |", "|---|" + "---:|" * len(batches)]
    for phase in ("build", "launch", "wait", "step"):
        lines.append(f"| {phase} | " + " | ".join(f"{p[phase]:.2f}" for p in piped) + " |")
    write_report(args.out, "decode_split_batch.txt", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
