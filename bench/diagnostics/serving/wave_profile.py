"""Where a wave of prompts' time to first token goes, under mlx-lm's batch generator (a GPU run).

    python3 -m bench.diagnostics.serving.wave_profile [--shape S] [--conditioned]
        [--prompts 16] [--tokens 256] [--rounds 3] [--arm "NAME:VAR=V,..."] [--out DIR]

``bench --serve``'s 16-stream wave spends most of its time before the first
token: the server prefills the 16 prompts together (one packed call with
lily, ``layers/prompt_rows.py``), then runs their last tokens as the first
decode step. This repeats that part alone: ``--prompts`` prompts of about
``--tokens`` tokens inserted together into a ``BatchGenerator`` that
prefills them in one batch (as lily's server does), until each has its
first token. Per arm (environment settings applied for its runs, e.g.
``pace off:MLX_LILY_PACE_PREFILL=0``; the first arm is the defaults unless
given), the arms alternating after one warm run each:

* the seconds to the last first token (median of ``--rounds``) and the
  rounds' peak memory (MLX's allocator, weights included: what a setting
  that queues more work, such as prefill pacing off, costs in memory);
* the device time of one more round's kernels (CUPTI through PyTorch, where
  it has CUDA), by kernel, beside its wall time: how much of the wave the
  host, not the GPU, sets;
* where the host's time went in one more round (cProfile, the functions
  that took the most, by their own time and with what they call).

Prints a report and writes ``wave_profile.md`` and ``wave_profile.json`` to DIR.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time
from typing import Any, Dict, List, Tuple

import mlx.core as mx

# Functions listed per arm, by own time and by cumulative time.
TOP_FUNCTIONS = 25
# Kernels listed per arm, by device time.
TOP_KERNELS = 15


def parse_arm(text: str) -> Tuple[str, Dict[str, str]]:
    """``NAME:VAR=V,VAR2=V2`` (or ``NAME:`` for no settings) -> (name, {VAR: V})."""
    name, sep, rest = text.partition(":")
    if not sep or not name.strip():
        raise ValueError(f"--arm {text!r}: NAME:VAR=VALUE,... (NAME: alone for the defaults)")
    settings = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        var, eq, value = item.partition("=")
        if not eq or not var:
            raise ValueError(f"--arm {text!r}: {item!r} is not VAR=VALUE")
        settings[var.strip()] = value.strip()
    return name.strip(), settings


class _Environment:
    """An arm's variables set for the block, the earlier values back after."""

    def __init__(self, settings: Dict[str, str]):
        self.settings, self.saved = settings, {}

    def __enter__(self) -> None:
        for var, value in self.settings.items():
            self.saved[var] = os.environ.get(var)
            os.environ[var] = value

    def __exit__(self, *exc: Any) -> None:
        for var, value in self.saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


def prompt_lengths(prompts: int, tokens: int) -> List[int]:
    """About ``tokens`` each, a few apart (rows padded unlike each other, as
    the bench's served prompts are)."""
    return [max(2, tokens - (3 * r) % 5) for r in range(prompts)]


def wave(model: Any, ids: List[List[int]]) -> float:
    """Seconds from inserting ``ids`` together to every request's first token."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, completion_batch_size=max(32, len(ids)), prefill_batch_size=len(ids))
    try:
        start = time.perf_counter()
        uids = set(gen.insert(ids, max_tokens=[1] * len(ids)))
        seen = set()
        while seen < uids:
            _, responses = gen.next()
            seen.update(r.uid for r in responses)
        return time.perf_counter() - start
    finally:
        gen.close()


def host_profile(run: Any) -> Tuple[List[str], List[str]]:
    """cProfile of ``run()``: the top functions by own time, and by
    cumulative time, as pstats prints them."""
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        run()
    finally:
        profiler.disable()
    tables = []
    for key in ("tottime", "cumulative"):
        stream = io.StringIO()
        pstats.Stats(profiler, stream=stream).strip_dirs().sort_stats(key).print_stats(TOP_FUNCTIONS)
        lines = stream.getvalue().splitlines()
        start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
        tables.append([line for line in lines[start:] if line.strip()])
    return tables[0], tables[1]


def device_profile(run: Any) -> Tuple[Any, Dict[str, List[float]]]:
    """(wall seconds, {kernel: [µs of each call]}) of ``run()`` under
    CUPTI; (None, {}) where PyTorch has no CUDA here."""
    from bench.gpu_time import kernel_times, why_unavailable

    if why_unavailable() is not None:
        return None, {}
    walls = []
    kernels = kernel_times(lambda: walls.append(run()))
    return walls[0], kernels


def kernel_lines(kernels: Dict[str, List[float]]) -> List[str]:
    ranked = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))
    lines = [f"  {'kernel':70s} {'calls':>6s} {'ms':>8s}"]
    for name, times in ranked[:TOP_KERNELS]:
        lines.append(f"  {name[:70]:70s} {len(times):6d} {sum(times) / 1e3:8.2f}")
    rest = ranked[TOP_KERNELS:]
    if rest:
        lines.append(f"  {f'({len(rest)} other kernels)':70s} {sum(len(t) for _, t in rest):6d} "
                     f"{sum(sum(t) for _, t in rest) / 1e3:8.2f}")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3.6-35b-a3b")
    p.add_argument("--conditioned", action="store_true", help="the conditioned random checkpoint (realistic routing)")
    p.add_argument("--prompts", type=int, default=16, help="prompts inserted together (default: 16)")
    p.add_argument("--tokens", type=int, default=256, help="tokens a prompt, about (default: 256)")
    p.add_argument("--rounds", type=int, default=3, help="timed waves per arm (default: 3)")
    p.add_argument("--arm", action="append", default=[], metavar="NAME:VAR=V,...",
                   help="an arm's environment settings; repeatable (the defaults run first as 'default')")
    p.add_argument("--no-host-profile", action="store_true", help="skip cProfile's round")
    p.add_argument("--out", help="also write DIR/wave_profile.md and DIR/wave_profile.json")
    args = p.parse_args(argv)
    if args.prompts < 1 or args.tokens < 2 or args.rounds < 1:
        p.error("--prompts, --rounds: 1 or more; --tokens: 2 or more")
    try:
        arms = [("default", {})] + [parse_arm(a) for a in args.arm]
    except ValueError as exc:
        p.error(str(exc))

    import numpy as np

    from bench.common import write_json, write_report
    from bench.engines import load_shared, switch

    model, vocab, _, _ = load_shared({"model": None, "shape": args.shape, "seed": 0, "conditioned": args.conditioned})
    switch(model, "lily")
    lengths = prompt_lengths(args.prompts, args.tokens)
    ids = [[int(t) for t in np.random.default_rng(r).integers(0, vocab, n)] for r, n in enumerate(lengths)]

    for _, settings in arms:  # warm: what each arm builds, built once
        with _Environment(settings):
            wave(model, ids)
    seconds: Dict[str, List[float]] = {name: [] for name, _ in arms}
    # Each timed round's peak memory (MLX's allocator, the weights included):
    # a setting that saves time by queueing more (prefill pacing off) shows
    # what it costs here.
    peaks: Dict[str, List[float]] = {name: [] for name, _ in arms}
    for _ in range(args.rounds):
        for name, settings in arms:
            with _Environment(settings):
                mx.synchronize()
                mx.reset_peak_memory()
                seconds[name].append(wave(model, ids))
                peaks[name].append(mx.get_peak_memory() / 2**30)

    lines = [f"{args.prompts} prompts of {min(lengths)} to {max(lengths)} tokens ({args.shape}"
             f"{', conditioned' if args.conditioned else ''}) inserted together into mlx-lm's BatchGenerator "
             f"(one prefill batch), until each has its first token; {args.rounds} rounds an arm, alternating.", ""]
    record: Dict[str, Any] = {"shape": args.shape, "conditioned": args.conditioned, "lengths": lengths, "rounds": args.rounds, "arms": []}
    for name, settings in arms:
        with _Environment(settings):
            wall, kernels = device_profile(lambda: wave(model, ids))
            own, cumulative = ([], []) if args.no_host_profile else host_profile(lambda: wave(model, ids))
        busy = sum(sum(t) for t in kernels.values()) / 1e3 if kernels else None
        median = statistics.median(seconds[name])
        lines.append(f"## {name}" + (f" ({', '.join(f'{k}={v}' for k, v in settings.items())})" if settings else ""))
        lines.append("")
        lines.append(f"First tokens after {median:.3f} s (median; rounds {', '.join(f'{s:.3f}' for s in seconds[name])}); "
                     f"peak memory {max(peaks[name]):.2f} GiB.")
        if busy is not None:
            lines.append(f"Profiled round: {wall:.3f} s of wall time, {busy:.1f} ms of kernels "
                         f"({sum(len(t) for t in kernels.values())} launches).")
            lines += ["", *kernel_lines(kernels)]
        for title, table in (("own time", own), ("cumulative time", cumulative)):
            if table:
                lines += ["", f"Host, by {title} (cProfile, one round):", "", *("    " + line for line in table)]
        lines.append("")
        record["arms"].append({
            "name": name, "settings": settings, "first_tokens_s": seconds[name], "median_s": median,
            "peak_gb": round(max(peaks[name]), 3),
            "profiled_wall_s": wall, "kernel_ms": busy,
            "launches": sum(len(t) for t in kernels.values()) if kernels else None,
            "kernels_ms": {k: round(sum(t) / 1e3, 3) for k, t in sorted(kernels.items(), key=lambda kv: -sum(kv[1]))[:40]},
            "host_own": own, "host_cumulative": cumulative,
        })
    write_report(args.out, "wave_profile.md", "\n".join(lines) + "\n")
    write_json(args.out, "wave_profile.json", record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
