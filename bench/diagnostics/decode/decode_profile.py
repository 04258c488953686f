"""Which GPU kernels a decode token runs, and for how long (NVIDIA only).

    python3 -m bench.diagnostics.decode.decode_profile [--engines lily,stock] [--context 4096] [--out DIR]
    python3 -m bench.diagnostics.decode.decode_profile --batch 1,4,8,16 [--context 256] [--out DIR]
        [--set MODULE.NAME=VALUE ...]

One model, one prompt of CONTEXT tokens per engine, then STEPS decode steps
recorded with PyTorch's profiler (CUPTI: it sees every kernel the process
launches, MLX's included). Per engine: the wall time of a step, the device
time its kernels took (their sum: MLX runs them on one stream), the kernels
per step, and the kernels that took the most time, with, for lily's
kernels, the bytes a launch moves (read and written, as bench/counts.py
counts them from the step's traced graph), the GB/s that makes and its share
of the GPU's HBM bandwidth (``PEAK_GBPS``). Where the kernels' time
is far below the wall time, launching (the host, MLX's encoding) bounds
decode; where it is close, the kernels do.

With ``--batch``, each B of the list profiles a decode step of B streams on
the server's caches (each stream's prompt prefilled alone, then merged as
mlx-lm's BatchGenerator merges requests: left-padded BatchKVCache, batched
ArraysCache), the batch's step as the server runs it; the wall time there
also separates building the step's graph (host) from the whole step.

Needs PyTorch with CUDA on the machine; without it, says so and exits 2.

Time: a fresh process compiles every lily kernel it launches (MLX builds
custom CUDA kernels through NVRTC in each process and keeps them on disk only
for its own kernels), which on the H200 takes about two minutes before the
first step; give a run at least four.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx

from bench.gpu_time import kernel_times

TOP = 25


def _profile_steps(model, cache, steps: int) -> Tuple[float, Dict[str, List[float]]]:
    """(median wall ms per step, {kernel name: [device µs of each call]})."""
    walls = []

    def run():
        tok = mx.array([[1]])
        for _ in range(steps):
            start = time.perf_counter()
            logits = model(tok, cache=cache)
            tok = mx.argmax(logits[:, -1:], axis=-1)
            mx.eval(tok, [c.state for c in cache])
            walls.append(1e3 * (time.perf_counter() - start))

    kernels = kernel_times(run)
    return statistics.median(walls), kernels


# HBM bandwidth by GPU (GB/s, the vendors' figures), for the "of peak" column.
PEAK_GBPS = {"H200": 4800.0, "H100": 3350.0, "B200": 8000.0, "A100": 2039.0}


def peak_gbps() -> Optional[float]:
    """This GPU's HBM bandwidth from PEAK_GBPS, None where not listed."""
    import torch

    name = torch.cuda.get_device_name()
    return next((gbps for gpu, gbps in PEAK_GBPS.items() if gpu in name), None)


def custom_kernel_bytes(step: Any, *args: mx.array) -> Dict[str, float]:
    """{custom kernel's built name: bytes one launch moves (read + written,
    as ``bench/counts.py`` counts them: only the experts picked)} over
    ``step(*args)``'s graph, traced (not run): lily's kernels, whose names
    the profiler shows."""
    from bench.counts import CUSTOM_KERNEL_PREFIX, bytes_by_kernel, trace

    return {label: statistics.median(sizes) for label, sizes in bytes_by_kernel(trace(step, *args)).items()
            if label.startswith(CUSTOM_KERNEL_PREFIX)}


def call_bytes(name: str, per_call: Dict[str, float]) -> Optional[float]:
    """The bytes of a profiled kernel's launch: the longest built name in
    ``per_call`` that its profiler name contains (MLX's own kernels: None)."""
    found = [label for label in per_call if label in name]
    return per_call[max(found, key=len)] if found else None


def _report(title: str, wall: float, kernels: Dict[str, List[float]], steps: int,
            per_call: Optional[Dict[str, float]] = None, peak: Optional[float] = None) -> List[str]:
    calls = sum(len(v) for v in kernels.values())
    busy = sum(sum(v) for v in kernels.values()) / 1e3
    lines = [f"{title}: {wall:.2f} ms per step (wall, median); kernels {busy / steps:.2f} ms per step "
             f"(device time, sum); {calls / steps:.0f} kernels per step", "",
             f"  {'kernel':70s} {'per step':>8s} {'us/call':>8s} {'ms/step':>8s} {'MB/call':>8s} {'GB/s':>7s}"
             f" {'of peak':>7s}"]
    ranked = sorted(kernels.items(), key=lambda kv: -sum(kv[1]))
    for name, times in ranked[:TOP]:
        us = statistics.mean(times)
        size = call_bytes(name, per_call or {})
        rate = size / (us * 1e3) if size is not None and us > 0 else None  # bytes per ns = GB/s
        lines.append(f"  {name[:70]:70s} {len(times) / steps:8.1f} {us:8.2f} {sum(times) / steps / 1e3:8.3f} "
                     f"{'' if size is None else f'{size / 1e6:.2f}':>8s} {'' if rate is None else f'{rate:.0f}':>7s} "
                     f"{'' if rate is None or not peak else f'{rate / peak:.0%}':>7s}")
    rest = ranked[TOP:]
    if rest:
        rest_calls = sum(len(t) for _, t in rest) / steps
        rest_ms = sum(sum(t) for _, t in rest) / steps / 1e3
        lines.append(f"  {f'({len(rest)} other kernels)':70s} {rest_calls:8.1f} {'':8s} {rest_ms:8.3f}")
    return lines + [""]


def batch_cache(model: Any, vocab: int, context: int, rows: int) -> Any:
    """The server's caches for ``rows`` streams: stream r's prompt (about
    ``context`` tokens, lengths staggered so that the rows are left-padded
    differently) prefilled alone, then merged as BatchGenerator merges them."""
    import numpy as np
    from mlx_lm.generate import _merge_caches
    from mlx_lm.models.cache import make_prompt_cache

    rng = np.random.default_rng(rows)
    caches = []
    for r in range(rows):
        n = max(8, context - 7 * r)
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array(rng.integers(0, vocab, n))[None], cache=cache))
        caches.append(cache)
    return _merge_caches(caches)


def profile_batch(model, vocab: int, engine: str, context: int, steps: int, rows: int) -> List[str]:
    """One engine's decode step of ``rows`` streams on the server's caches."""
    from bench.engines import switch

    switch(model, engine)
    cache = batch_cache(model, vocab, context, rows)
    tok = mx.zeros((rows, 1), dtype=mx.int32)
    builds, walls = [], []

    def step():
        nonlocal tok
        start = time.perf_counter()
        logits = model(tok, cache=cache)
        builds.append(1e3 * (time.perf_counter() - start))
        tok = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(tok, [c.state for c in cache])
        walls.append(1e3 * (time.perf_counter() - start))

    for _ in range(3):  # compilation and first-use checks
        step()
    builds.clear(), walls.clear()
    kernels = kernel_times(lambda: [step() for _ in range(steps)])
    title = f"{engine}, B = {rows} (host {statistics.median(builds):.2f} ms building the step)"
    per_call = custom_kernel_bytes(lambda t: model(t, cache=cache), tok)  # last: the trace rebinds the cache
    return _report(title, statistics.median(walls), kernels, steps, per_call, peak_gbps())


def profile_engine(model, vocab: int, engine: str, context: int, steps: int) -> List[str]:
    from bench.engines import switch
    from bench.measure import prefilled_cache

    switch(model, engine)
    cache = prefilled_cache(model, vocab, context)
    wall, kernels = _profile_steps(model, cache, steps)
    per_call = custom_kernel_bytes(lambda t: model(t, cache=cache), mx.array([[1]]))  # last: the trace rebinds the cache
    return _report(engine, wall, kernels, steps, per_call, peak_gbps())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3.6-35b-a3b")
    p.add_argument("--engines", default="lily", help="comma-separated: lily, stock (default: lily)")
    p.add_argument("--context", type=int, default=4096, help="prompt tokens before decoding (default: 4096)")
    p.add_argument("--steps", type=int, default=8, help="recorded decode steps (default: 8)")
    p.add_argument("--batch", help="comma-separated stream counts: profile the server's batched step instead")
    p.add_argument("--conditioned", action="store_true", help="the conditioned random checkpoint (realistic routing)")
    p.add_argument("--out", help="also write DIR/decode_profile.txt (DIR/decode_profile_batch.txt with --batch)")
    p.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                   help="profile with a module constant set (e.g. "
                        "mlx_lily.kernels.attention.sdpa.DECODE_PREFETCH=4); repeatable, named in the report")
    args = p.parse_args(argv)
    from bench.common import run_with_settings

    return run_with_settings(p, args.set, lambda settings: _profile(args, settings))


def _profile(args, settings) -> int:
    try:
        import torch

        if not torch.cuda.is_available():
            raise ImportError("torch.cuda is not available")
    except ImportError as exc:
        print(f"decode_profile needs PyTorch with CUDA ({exc})")
        return 2

    from bench.common import write_report
    from bench.engines import load_shared

    model, vocab, _, _ = load_shared({"model": None, "shape": args.shape, "seed": 0,
                                      "conditioned": args.conditioned})
    batches = [int(b) for b in args.batch.split(",")] if args.batch else [None]
    lines = [f"Decode kernels per token at {args.context} tokens of context ({args.shape}"
             f"{', conditioned' if args.conditioned else ''}), {args.steps} recorded steps"
             + "".join(f"; {module}.{name} = {value!r}" for module, name, value in settings), ""]
    print("\n".join(lines), flush=True)
    for engine in args.engines.split(","):
        for rows in batches:
            try:
                found = (profile_engine(model, vocab, engine.strip(), args.context, args.steps) if rows is None
                         else profile_batch(model, vocab, engine.strip(), args.context, args.steps, rows))
            except Exception as exc:  # noqa: BLE001 - the other runs' profiles still count
                found = [f"{engine}: profiling failed ({type(exc).__name__}: {exc})", ""]
            lines += found
            print("\n".join(found), flush=True)
    name = "decode_profile_batch.txt" if args.batch else "decode_profile.txt"
    write_report(args.out, name, "\n".join(lines) + "\n", echo=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
