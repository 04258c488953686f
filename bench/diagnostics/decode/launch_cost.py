"""What one kernel launch costs a step through MLX, on this machine.

    python3 -m bench.diagnostics.decode.launch_cost [--launches 16,64,256] [--source-kb 0,16,32] [--input-mb 0,512]
        [--inputs 0,8,16] [--lily-gemv] [--out DIR]

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
  kernels (100), so this row shows what those commits cost per launch;
* with ``--inputs``, the smallest custom kernel also given that many small
  arrays whose strides its source names (MLX passes each one's pointer and
  strides as kernel parameters and tracks it in its graph), as lily's
  launches are (a one-projection GEMV has 9 inputs, the MoE launches more):
  op by op, through ``mx.compile``, and through ``mx.compile`` reading each
  input by its pointer alone (no strides), as lily's kernels read weights;
* with ``--lily-gemv``, lily's own decode GEMV (K = N = 2048, 4-bit, one
  row of x, its output the next launch's x), op by op (the Python op's
  dispatch in every launch) and through ``mx.compile``, as a decode step
  replays it.

The alone and pipelined slopes include each kernel's GPU time (small for
the tiny kernels, a few µs for the GEMV); the host column is the host's part
of a pipelined step alone (building it and ``mx.async_eval``), so the GEMV's
host µs a launch against the small-input rows' says how much of a decode
step's launch half is the launch itself and how much its inputs.

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
from typing import Callable, Dict, List, Optional

import mlx.core as mx

from bench.common import log, write_report
from mlx_lily.toolchain.registry import gpu_backend

WIDTH = 32  # floats per launch: a kernel with nothing to do but be launched
# MLX's CUDA graph settings, shown in the report when set.
GRAPH_SETTINGS = ("MLX_USE_CUDA_GRAPHS", "MLX_MAX_OPS_PER_BUFFER", "MLX_MAX_MB_PER_BUFFER")


def custom_add(source_kb: float, input_mb: float = 0, inputs: int = 0,
               strides: bool = True) -> Callable[[mx.array], mx.array]:
    """x + 1 through a custom kernel whose source is padded to source_kb,
    given also an unread array of input_mb MB when that is positive, and
    ``inputs`` small arrays (read only by a thread past the grid: none) whose
    strides the source names, or (``strides`` False) that it reads by
    pointer alone, as lily's kernels read their weights."""
    backend = gpu_backend()
    index = "threadIdx.x" if backend == "cuda" else "thread_position_in_grid.x"
    small = [f"in{j}" for j in range(inputs)]
    unread = " + ".join(f"{n}[{n}_strides[0]]" if strides else f"{n}[1]" for n in small) or "0.0f"
    body = (f"unsigned int i = {index};\nfloat extra = 0.0f;\n"
            f"if (i >= 1000000u) {{ extra = {unread}; }}\nout[i] = inp[i] + 1.0f + extra;\n")
    padding = int(source_kb * 1024) - len(body)
    if padding > 0:  # comment lines, as a long kernel's text would be
        line = "// " + "x" * 76 + "\n"
        body = line * (padding // len(line)) + body
    make = mx.fast.cuda_kernel if backend == "cuda" else mx.fast.metal_kernel
    names = (["inp", "unread"] if input_mb > 0 else ["inp"]) + small
    kernel = make(name=f"launch_cost_{int(source_kb * 10)}_{len(names)}{'' if strides else '_bare'}", input_names=names,
                  output_names=["out"], source=body)
    extra = [mx.zeros((int(input_mb * 2**20),), mx.uint8)] if input_mb > 0 else []
    extra += [mx.zeros((64,), mx.float32) for _ in small]
    mx.eval(extra)

    def add(x: mx.array) -> mx.array:
        return kernel(inputs=[x, *extra], grid=(WIDTH, 1, 1), threadgroup=(WIDTH, 1, 1),
                      output_shapes=[x.shape], output_dtypes=[x.dtype])[0]

    return add


GEMV_WIDTH = 2048  # the --lily-gemv row's K and N


def lily_gemv() -> Callable[[mx.array], mx.array]:
    """x [1, 1, GEMV_WIDTH] bf16 -> W x through lily's decode GEMV (4-bit
    weights of group 64), as a decode step calls it: each launch's output is
    the next one's x, with no other op between them."""
    from mlx_lily import kernels as K

    D = GEMV_WIDTH
    w = mx.random.normal((D, D), key=mx.random.key(0)).astype(mx.bfloat16) * 0.02
    weights = (tuple(mx.quantize(w, group_size=64, bits=4)),)
    mx.eval(weights)

    def gemv(x: mx.array) -> mx.array:
        (y,) = K.decode_matvec(x, weights)
        return y

    return gemv


def chain(op: Callable[[mx.array], mx.array], n: int) -> Callable[[mx.array], mx.array]:
    def step(x: mx.array) -> mx.array:
        for _ in range(n):
            x = op(x)
        return x

    return step


def time_steps(step: Callable[[mx.array], mx.array], steps: int, x: Optional[mx.array] = None) -> Dict[str, float]:
    """Median ms of a step evaluated alone, ms per step pipelined, and of
    those the host's ms per step (building the step and ``mx.async_eval``,
    not the waits: what a launch costs the host whatever the GPU's own time),
    from ``x`` (default WIDTH zeros)."""
    x = mx.zeros((WIDTH,), mx.float32) if x is None else x
    mx.eval(step(x))  # builds (compiles) whatever the step needs
    alone: List[float] = []
    for _ in range(steps):
        start = time.perf_counter()
        mx.eval(step(x))
        alone.append(time.perf_counter() - start)
    start = time.perf_counter()
    y = step(x)
    mx.async_eval(y)
    host = time.perf_counter() - start
    for _ in range(steps - 1):
        built = time.perf_counter()
        nxt = step(y)
        mx.async_eval(nxt)
        host += time.perf_counter() - built
        mx.eval(y)
        y = nxt
    mx.eval(y)
    pipelined = (time.perf_counter() - start) / steps
    return {"alone_ms": 1e3 * statistics.median(alone), "pipelined_ms": 1e3 * pipelined,
            "host_ms": 1e3 * host / steps}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launches", default="16,64,256", help="launches per step (default 16,64,256)")
    p.add_argument("--source-kb", default="0,16,32", help="custom kernels' source sizes, KB (default 0,16,32)")
    p.add_argument("--input-mb", default="0",
                   help="also launch the smallest kernel given an unread array of each of these MB (default 0: none)")
    p.add_argument("--inputs", default="0",
                   help="also launch the smallest kernel given each of these counts of small inputs whose strides "
                        "it names (default 0: none)")
    p.add_argument("--lily-gemv", action="store_true",
                   help="also chain lily's decode GEMV (2048 x 2048, 4-bit, one row), as a decode step launches it")
    p.add_argument("--steps", type=int, default=30, help="steps per measurement (default 30)")
    p.add_argument("--out", help="also write DIR/launch_cost.txt")
    args = p.parse_args(argv)
    counts = sorted({int(n) for n in args.launches.split(",")})
    if len(counts) < 2:
        p.error("--launches: at least two counts, for the slope")
    gpu = gpu_backend() is not None

    rows: Dict[str, Callable[[int], Callable]] = {"MLX add, op by op": lambda n: chain(lambda x: x + 1, n)}
    starts: Dict[str, mx.array] = {}  # a row's own first x, where not WIDTH floats
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
        for count in sorted(int(c) for c in args.inputs.split(",")):
            if count > 0:
                # Op by op, then compiled as a decode step is (no Python
                # per launch: what MLX itself spends on each input), with
                # and without the strides as kernel parameters.
                op = custom_add(sizes[0], inputs=count)
                name = f"custom kernel, {sizes[0]:g} KB source, given {count} small inputs"
                rows[name] = lambda n, op=op: chain(op, n)
                rows[name + ", mx.compile"] = lambda n, op=op: mx.compile(chain(op, n))
                op = custom_add(sizes[0], inputs=count, strides=False)
                rows[name + " (pointers only), mx.compile"] = lambda n, op=op: mx.compile(chain(op, n))
        if args.lily_gemv:
            # Op by op, the Python op's dispatch is in each launch; compiled,
            # as the decode step replays it, only MLX's work is.
            op = lily_gemv()
            name = f"lily's decode GEMV, {GEMV_WIDTH} x {GEMV_WIDTH}, 4-bit, one row"
            rows[name] = lambda n, op=op: chain(op, n)
            rows[name + ", mx.compile"] = lambda n, op=op: mx.compile(chain(op, n))
            starts[name] = starts[name + ", mx.compile"] = mx.zeros((1, 1, GEMV_WIDTH), mx.bfloat16)

    settings = ", ".join(f"{k}={os.environ[k]}" for k in GRAPH_SETTINGS if k in os.environ) or "MLX's defaults"
    lines = [f"Steps of N chained launches (x + 1 on {WIDTH} floats; the GEMV row: its own x), "
             f"{mx.default_device()}, median over {args.steps} steps; graph settings: {settings}. "
             "The slopes over N: alone and pipelined include the GPU's time; host is the host's "
             "part of a pipelined step (its build and async_eval).", "",
             "| launch | " + " | ".join(f"N = {n}: alone / pipelined ms" for n in counts)
             + " | µs per launch, alone / pipelined / host |",
             "|---|" + "---:|" * (len(counts) + 1)]
    for name, make in rows.items():
        figures = [time_steps(make(n), args.steps, starts.get(name)) for n in counts]
        span = counts[-1] - counts[0]
        slope = [1e3 * (figures[-1][k] - figures[0][k]) / span for k in ("alone_ms", "pipelined_ms", "host_ms")]
        cells = [f"{f['alone_ms']:.2f} / {f['pipelined_ms']:.2f}" for f in figures]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {slope[0]:.1f} / {slope[1]:.1f} / {slope[2]:.1f} |")
        log(lines[-1])
    if not gpu:
        lines += ["", "No GPU: the custom-kernel rows need one."]
    write_report(args.out, "launch_cost.txt", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
