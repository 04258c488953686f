"""The MoE decode router's launch against the two launches it stands for.

``moe_decode_router`` (kernels/moe/decode_router.py) gives, in one launch of a
threadgroup per row, the bits of the router GEMV (the row GEMV with the
router's and the shared gate's rows) and ``moe_decode_route`` (top-k and
norm). This times both per batch size B, on the device:

    python3 -m bench.diagnostics.tuning.moe_router_launch --device-time --out DIR [--batch 1,2,4,8,16] [--sets 128]

At the real Qwen3.6-35B-A3B shapes (hidden 2048, 256 experts, top 8; 8-bit
router and shared gate, as the checkpoints have them), random weights. Each
timed call reads its own set of weights, cycling over ``--sets`` of them (0.5
MB each: 128 sets are more than an H200's 50 MB L2 cache), so that the
weights come from memory, as in a decode step. Per B: the device µs of each
form (``--device-time``: CUPTI, NVIDIA with PyTorch; without it the wall
time of the calls evaluated together), for the router launch at each choice of SIMD groups and
rows per SIMD group; every choice's outputs are checked against the two
launches' bits. Writes DIR/moe-router-launch.json and .md.
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np

import mlx_lily.kernels  # noqa: F401  (registers the ops)
from bench.common import log, machine_info, now_iso, software_info, write_json, write_report
from bench.diagnostics.tuning.weight_reads import sweep_backend
from bench.ops import time_in_graph
from mlx_lily.kernels.linear.gemv import quantized_matvec_kernel
from mlx_lily.kernels.moe import decode_router
from mlx_lily.kernels.moe.decode import moe_decode_route_kernel
from mlx_lily.kernels.moe.testing import moe_router_inputs

REAL = (2048, 256, 8)  # hidden, experts, top k
ROUNDS = 4
CHOICES = ((16, 2), (32, 1), (16, 1))  # (SIMD groups, rows per SIMD group)


def _two_launches(backend, h, norm_weight, eps, gate, shared_gate, k, normalize):
    # The row GEMV: the order whose bits the router's launch gives (on CUDA the model's router GEMV
    # takes the tile form, and the router's launch is then never taken).
    logits, shared_logit = quantized_matvec_kernel.run_on(backend, h, (gate, shared_gate), norm_weight, eps)
    xn, inds, scores = moe_decode_route_kernel.run_on(backend, h, logits, norm_weight, eps, k, normalize)
    return logits, shared_logit, xn, inds, scores


def _router_launch(backend, args, simdgroups, rows):
    return decode_router.moe_decode_router_kernel.run_on(backend, *args, simdgroups=simdgroups, rows_per_sg=rows)


def _timed(fn, sets: int, device_time: bool) -> float:
    """µs per call: device time summed over a call's kernels, or wall time."""
    if not device_time:
        return time_in_graph(lambda: [fn(i) for i in range(sets)], (), {}, calls=1) * 1e3 / sets
    from bench.gpu_time import kernel_times

    for i in range(sets):
        mx.eval(fn(i))

    def run():
        for _ in range(ROUNDS):
            for i in range(sets):
                mx.eval(fn(i))

    return sum(sum(t) for t in kernel_times(run).values()) / (ROUNDS * sets)


def sweep(batch: int, sets: int, backend: str, device_time: bool, dims=REAL) -> dict:
    D, E, k = dims
    calls = [moe_router_inputs(D, E, k, seed=batch + 1000 * i, rows=batch)[0] for i in range(sets)]
    want = _two_launches(backend, *calls[0])
    mx.eval(want)
    row = {"batch": batch, "weight_sets": sets, "us": {}}
    row["us"]["two launches"] = _timed(lambda i: _two_launches(backend, *calls[i]), sets, device_time)
    for nsg, rows in CHOICES:
        label = f"router launch {nsg} x {rows}"
        got = _router_launch(backend, calls[0], nsg, rows)
        mx.eval(got)
        same = all(np.array_equal(np.array(g.view(mx.uint16) if g.dtype != mx.uint32 else g),
                                  np.array(w.view(mx.uint16) if w.dtype != mx.uint32 else w))
                   for g, w in zip(got, want))
        if not same:
            row["us"][label] = None
            row.setdefault("differs", []).append(label)
            continue
        row["us"][label] = _timed(lambda i, n=nsg, r=rows: _router_launch(backend, calls[i], n, r), sets,
                                  device_time)
    log(f"B={batch}: " + ", ".join(f"{k} {v:.1f}" if v else f"{k} differs" for k, v in row["us"].items()))
    return row


def markdown(record: dict) -> str:
    labels = list(record["rows"][0]["us"])
    unit = "device µs (CUPTI)" if record["device_time"] else "µs of wall time a call, evaluated together"
    lines = [f"# The MoE decode router's launch against the router GEMV + route, {unit}", "",
             f"{record['machine'].get('accelerator', {}).get('name', 'CPU')}, weights cycled over "
             f"{record['rows'][0]['weight_sets']} sets.",
             "", "| B | " + " | ".join(labels) + " |", "|---:|" + "---:|" * len(labels)]
    for row in record["rows"]:
        cells = [("differs" if row["us"][l] is None else f"{row['us'][l]:.1f}") for l in labels]
        lines.append(f"| {row['batch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python3 -m bench.diagnostics.tuning.moe_router_launch",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", default="1,2,4,8,16", help="batch sizes (default 1,2,4,8,16)")
    p.add_argument("--sets", type=int, default=128, help="weight sets cycled over (default 128)")
    p.add_argument("--device-time", action="store_true", help="device µs (CUPTI: NVIDIA with PyTorch)")
    p.add_argument("--backend", default=None, help=argparse.SUPPRESS)  # tests: 'emulator'
    p.add_argument("--dims", default=",".join(map(str, REAL)), help=argparse.SUPPRESS)  # tests: small shapes
    p.add_argument("--out", help="folder for the JSON and markdown")
    args = p.parse_args(argv)
    backend = sweep_backend(args.backend, args.device_time)
    record = {"kind": "moe-router-launch", "started": now_iso(), "machine": machine_info(),
              "software": software_info(), "backend": backend, "device_time": args.device_time,
              "rows": [sweep(int(b), args.sets, backend, args.device_time, tuple(int(d) for d in args.dims.split(",")))
                       for b in args.batch.split(",")]}
    write_json(args.out, "moe-router-launch.json", record)
    write_report(args.out, "moe-router-launch.md", markdown(record))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
