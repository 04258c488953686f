"""Decode time per token by path: where does a decode token's time go?

    python3 -m bench.diagnostics.decode.decode_paths [--shape qwen3.6-35b-a3b] [--context 4096] [--out DIR]

One model, one prompt of CONTEXT tokens, then decode steps on that cache for
each path a decode token can take:

* ``stock``: mlx-lm's own layers;
* ``lily eager``: lily's fused layer steps, not compiled (``MLX_LILY_COMPILE_DECODE=0``);
* ``lily layers``: each layer's steps compiled on their own;
* ``lily segments``: the layer stack in compiled segments (the server's path);
* ``lily whole step``: the whole stack one compiled call (lily's default for
  ``mlx_lm.generate``'s caches; where the attention's decode kernels are off,
  on the reference backend say, it runs the segments, and the row says so).

Per path, the median over STEPS steps of: the host's time to build one step's
graph (``host ms``), and the whole step, built and evaluated (``step ms``).
Where host ms is close to step ms, the host bounds decode; where step ms is
far above it, the GPU does. The table goes to stdout and, with --out, to
DIR/decode_paths.txt.
"""

from __future__ import annotations

import argparse
import os

import mlx.core as mx

PATHS = ("stock", "lily eager", "lily layers", "lily segments", "lily whole step")


def measure(model, vocab: int, context: int, steps: int, path: str) -> tuple[float, float, str]:
    """(host ms, step ms, the layer paths the timed steps took)."""
    from bench.engines import switch
    from bench.measure import decode_step_times, prefilled_cache
    from mlx_lily.layers.decoder import COMPILE_ENV

    switch(model, "stock" if path == "stock" else "lily")
    os.environ[COMPILE_ENV] = "0" if path == "lily eager" else "1"
    text = model.language_model.model
    if path == "lily layers":
        text.__dict__["_lily_segments_ok"] = False
    else:
        text.__dict__.pop("_lily_segments_ok", None)
    if path == "lily whole step":
        text.__dict__.pop("_lily_whole_ok", None)
    else:
        text.__dict__["_lily_whole_ok"] = False
    cache = prefilled_cache(model, vocab, context)
    from mlx_lily import call_trace as paths

    paths.start()
    try:
        host, step = decode_step_times(model, cache, 1, steps)
        taken = sorted({r["path"] for r in paths.seen()})
    finally:
        paths.stop()
    return host, step, ", ".join(taken) or "stock"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3.6-35b-a3b")
    p.add_argument("--context", type=int, default=4096, help="prompt tokens before decoding (default: 4096)")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps per path (default: 16)")
    p.add_argument("--out", help="also write DIR/decode_paths.txt")
    args = p.parse_args(argv)

    from bench.common import write_report
    from bench.engines import load_shared
    from mlx_lily.layers.decoder import COMPILE_ENV

    before = os.environ.get(COMPILE_ENV)
    model, vocab, _, _ = load_shared({"model": None, "shape": args.shape, "seed": 0, "conditioned": False})
    lines = [f"Decode per token at {args.context} tokens of context ({args.shape}, {mx.default_device()}), "
             f"median of {args.steps} steps", "", f"{'path':16s} {'host ms':>9s} {'step ms':>9s} {'tok/s':>8s}  layers ran"]
    try:
        for path in PATHS:
            host, step, taken = measure(model, vocab, args.context, args.steps, path)
            lines.append(f"{path:16s} {host:9.2f} {step:9.2f} {1e3 / step:8.1f}  {taken}")
            print(lines[-1], flush=True)
    finally:
        if before is None:
            os.environ.pop(COMPILE_ENV, None)
        else:
            os.environ[COMPILE_ENV] = before
    write_report(args.out, "decode_paths.txt", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
