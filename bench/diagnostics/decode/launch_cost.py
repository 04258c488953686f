"""What one kernel launch costs a step through MLX, on this machine.

    python3 -m bench.diagnostics.decode.launch_cost [--launches 16,64,256] [--source-kb 0,16,32] [--input-mb 0,512] [--out DIR]

A decode step of lily launches ~290 kernels (bench/README.md), each a tiny
one at batch 1. Where the host's cost per launch (building the node, MLX's
encoding, and for a custom kernel the lookup of its compiled module, which
hashes the kernel's whole source) exceeds the kernel's own run time, the
launch count sets the step's time. This times steps made of N chained
launches of a kernel that adds 1 to 32 floats, for several N:

* MLX's own add (``x + 1``), built op by op (``mx.compile`` would fuse the
  chain into one kernel);
* a custom kernel (``mx.fast.cuda_kernel`` / ``metal_kernel``) whose source
  is padded with a comment to each ``--source-kb``, since MLX hashes the
  source at every launch; the smallest also through ``mx.compile``, which
  keeps custom kernels apart and replays the recorded graph, as lily's
  decode segments do;
* with ``--input-mb``, the smallest custom kernel also given a uint8 array of
  that many MB that it does not read: MLX's CUDA backend adds up its
  launches' input sizes in elements (``array::data_size``, not bytes) and
  commits its graph of queued kernels every ``MLX_MAX_MB_PER_BUFFER`` x 2^20
  of them (1000 on the H200) as well as every ``MLX_MAX_OPS_PER_BUFFER``
  kernels (100), so this row shows what those commits cost per launch.

Each step is evaluated on its own (wall time to the result) and, as
``mlx_lm.generate`` runs decode, pipelined (the next step is built and
submitted while the previous one runs; time per step over the run). The
cost per launch is the slope between the smallest and largest N. Needs a
GPU for the custom-kernel rows; on a CPU it times MLX's own add only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable, Dict, List

import mlx.core as mx

from bench.common import log, write_report
from mlx_lily.toolchain.registry import gpu_backend

WIDTH = 32  # floats per launch: a kernel with nothing to do but be launched
# MLX's CUDA graph settings, shown in the report when set.
GRAPH_SETTINGS = ("MLX_USE_CUDA_GRAPHS", "MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER")


def custom_add(source_kb: float, input_mb: float = 0) -> Callable[[mx.array], mx.array]:
    """x + 1 through a custom kernel whose source is padded to source_kb,
    given also an unread array of input_mb MB when that is positive."""
    backend = gpu_backend()
    index = "threadIdx.x" if backend == "cuda" else "thread_position_in_grid.x"
    body = f"unsigned int i = {index};\nout[i] = inp[i] + 1.0f;\n"
    padding = int(source_kb * 1024) - len(body)
    if padding > 0:  # comment lines, as a long kernel's text would be
        line = "// " + "x" * 76 + "\n"
        body = line * (padding // len(line)) + body
    make = mx.fast.cuda_kernel if backend == "cuda" else mx.fast.metal_kernel
    names = ["inp", "unread"] if input_mb > 0 else ["inp"]
    kernel = make(name=f"launch_cost_{int(source_kb * 10)}_{len(names)}", input_names=names,
                  output_names=["out"], source=body)
    extra = [mx.zeros((int(input_mb * 2**20),), mx.uint8)] if input_mb > 0 else []
    mx.eval(extra)

    def add(x: mx.array) -> mx.array:
        return kernel(inputs=[x, *extra], grid=(WIDTH, 1, 1), threadgroup=(WIDTH, 1, 1),
                      output_shapes=[x.shape], output_dtypes=[x.dtype])[0]

    return add


def chain(op: Callable[[mx.array], mx.array], n: int) -> Callable[[mx.array], mx.array]:
    def step(x: mx.array) -> mx.array:
        for _ in range(n):
            x = op(x)
        return x

    return step


def time_steps(step: Callable[[mx.array], mx.array], steps: int) -> Dict[str, float]:
    """Median ms of a step evaluated alone, and ms per step pipelined."""
    x = mx.zeros((WIDTH,), mx.float32)
    mx.eval(step(x))  # builds (compiles) whatever the step needs
    alone: List[float] = []
    for _ in range(steps):
        start = time.perf_counter()
        mx.eval(step(x))
        alone.append(time.perf_counter() - start)
    start = time.perf_counter()
    y = step(x)
    mx.async_eval(y)
    for _ in range(steps - 1):
        nxt = step(y)
        mx.async_eval(nxt)
        mx.eval(y)
        y = nxt
    mx.eval(y)
    pipelined = (time.perf_counter() - start) / steps
    return {"alone_ms": 1e3 * statistics.median(alone), "pipelined_ms": 1e3 * pipelined}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launches", default="16,64,256", help="launches per step (default 16,64,256)")
    p.add_argument("--source-kb", default="0,16,32", help="custom kernels' source sizes, KB (default 0,16,32)")
    p.add_argument("--input-mb", default="0",
                   help="also launch the smallest kernel given an unread array of each of these MB (default 0: none)")
    p.add_argument("--steps", type=int, default=30, help="steps per measurement (default 30)")
    p.add_argument("--out", help="also write DIR/launch_cost.txt")
    args = p.parse_args(argv)
    counts = sorted({int(n) for n in args.launches.split(",")})
    if len(counts) < 2:
        p.error("--launches: at least two counts, for the slope")
    gpu = gpu_backend() is not None

    rows: Dict[str, Callable[[int], Callable]] = {"MLX add, op by op": lambda n: chain(lambda x: x + 1, n)}
    if gpu:
        sizes = sorted(float(k) for k in args.source_kb.split(","))
        for kb in sizes:
            op = custom_add(kb)
            rows[f"custom kernel, {kb:g} KB source"] = lambda n, op=op: chain(op, n)
        op = custom_add(sizes[0])
        rows[f"custom kernel, {sizes[0]:g} KB source, mx.compile"] = lambda n, op=op: mx.compile(chain(op, n))
        for mb in sorted(float(m) for m in args.input_mb.split(",")):
            if mb > 0:
                op = custom_add(sizes[0], mb)
                rows[f"custom kernel, {sizes[0]:g} KB source, given {mb:g} MB"] = lambda n, op=op: chain(op, n)

    settings = ", ".join(f"{k}={os.environ[k]}" for k in GRAPH_SETTINGS if k in os.environ) or "MLX's defaults"
    lines = [f"Steps of N chained launches (x + 1 on {WIDTH} floats), {mx.default_device()}, "
             f"median over {args.steps} steps; graph settings: {settings}", "",
             "| launch | " + " | ".join(f"N = {n}: alone / pipelined ms" for n in counts)
             + " | µs per launch, alone / pipelined |",
             "|---|" + "---:|" * (len(counts) + 1)]
    for name, make in rows.items():
        figures = [time_steps(make(n), args.steps) for n in counts]
        span = counts[-1] - counts[0]
        slope = [1e3 * (figures[-1][k] - figures[0][k]) / span for k in ("alone_ms", "pipelined_ms")]
        cells = [f"{f['alone_ms']:.2f} / {f['pipelined_ms']:.2f}" for f in figures]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {slope[0]:.1f} / {slope[1]:.1f} |")
        log(lines[-1])
    if not gpu:
        lines += ["", "No GPU: the custom-kernel rows need one."]
    write_report(args.out, "launch_cost.txt", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
