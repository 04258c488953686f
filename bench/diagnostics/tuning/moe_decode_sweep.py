"""The MoE decode chain's gate/up launch at each choice of rows per pass.

``moe_decode_gate_up`` takes the batch rows that use an expert ``GROUP`` at a
time (``kernels/moe/decode.py``, ``GATE_UP_GROUP``): each pass keeps that many
rows' accumulators in registers and reads the expert's rows again, so the
choice trades registers a lane (threadgroups resident on a core) against
passes. Every choice gives every row the same bits; this tool checks that on
the device and times each, per batch size B (server decode batches, the
verification pass's positions):

    python3 -m bench.diagnostics.tuning.moe_decode_sweep --out DIR [--batch 1,4,8,16] [--device-time]

Random weights at the real Qwen3.6-35B-A3B MoE shapes (hidden 2048, 256
experts, top 8, expert and shared hidden 512; 4-bit group 64), one call of
the whole chain (route, gate/up, down, combine) per B and choice. By
default a call's time is the wall time of calls evaluated together as one
graph; with ``--device-time`` (NVIDIA, with PyTorch) it is each kernel's
device time (CUPTI), gate/up's reported alone. The first choice's output is
checked against the op's contract (``moe_decode_agree``), the others'
against its bits. "expert MB" is what gate/up
must read: the distinct experts the rows picked, and the shared expert, gate
and up weights with their scales and biases.

Writes DIR/moe-decode-sweep.json and DIR/moe-decode-sweep.md.
"""

from __future__ import annotations

import argparse
import statistics

import mlx.core as mx
import numpy as np

import mlx_lily.kernels  # noqa: F401  (registers the ops)
from bench.common import log, machine_info, now_iso, software_info, write_json, write_report
from bench.ops import time_in_graph
from mlx_lily.kernels.moe import decode
from mlx_lily.kernels.moe.testing import moe_decode_inputs
from mlx_lily.toolchain.registry import gpu_backend

# hidden, experts, top k, expert hidden, shared hidden: Qwen3.6-35B-A3B's MoE.
REAL_DIMS = (2048, 256, 8, 512, 512)
ROUNDS = 8


def _expert_bytes(args, inds: mx.array) -> int:
    """Gate and up bytes (words, scales, biases) of the distinct experts in
    ``inds`` plus the shared expert's."""
    *_, glu, shared = args
    per_expert = sum(a.nbytes // a.shape[0] for p in (glu.gate_proj, glu.up_proj)
                     for a in (p.weight, p.scales, p.biases))
    shared_bytes = sum(a.nbytes for p in (shared.gate_proj, shared.up_proj) for a in (p.weight, p.scales, p.biases))
    return len(set(np.array(inds).reshape(-1).tolist())) * per_expert + shared_bytes


def _device_us(fn, rounds: int = ROUNDS) -> dict:
    """{kernel family: device µs per call} over ``rounds`` calls, each evaluated alone."""
    from bench.gpu_time import kernel_times

    mx.eval(fn())

    def run():
        for _ in range(rounds):
            mx.eval(fn())

    per = {}
    for name, times in kernel_times(run).items():
        family = next((f for f in ("gate_up", "down", "route", "combine") if f"moe_decode_{f}" in name), "other")
        per[family] = per.get(family, 0.0) + sum(times) / rounds
    return per


def sweep(batch: int, groups, backend: str, dims, device_time: bool) -> dict:
    D, E, k, I, IS = dims
    args, kwargs = moe_decode_inputs(D, E, k, I, IS, seed=batch, rows=batch)
    mx.eval(args[:4])
    _, inds, _ = decode.moe_decode_route_kernel.run_on(backend, *args[:2], *args[3:7])
    row = {"batch": batch, "expert_bytes": _expert_bytes(args, inds), "groups": {}}
    first_bits = None
    saved = decode.GATE_UP_GROUP
    try:
        for group in groups:
            decode.GATE_UP_GROUP = group

            def fn():
                return decode.moe_decode_kernel.run_on(backend, *args, **kwargs)

            out = fn()
            mx.eval(out)
            bits = np.array(out.view(mx.uint16))
            if first_bits is None:  # the first choice against the op's contract; the rest against it
                first_bits = bits
                mismatch = decode.moe_decode_agree(out, out, *args, **kwargs)
                row["contract"] = mismatch or "met"
            entry = {"same_bits": bool(np.array_equal(bits, first_bits))}
            if device_time:
                per = _device_us(fn)
                entry.update({"gate_up_us": per.get("gate_up"), "chain_us": sum(per.values())})
                entry["gate_up_gb_s"] = row["expert_bytes"] / entry["gate_up_us"] / 1e3 if entry["gate_up_us"] else None
            else:
                entry["chain_us"] = 1e3 * time_in_graph(fn, (), {}, calls=8, graphs=5)
            row["groups"][str(group)] = entry
            log(f"B = {batch}, GROUP {group}: " + ", ".join(
                f"{key} {value:.1f}" if isinstance(value, float) else f"{key} {value}" for key, value in entry.items()))
    finally:
        decode.GATE_UP_GROUP = saved
    timed = "gate_up_us" if device_time else "chain_us"
    row["fastest"] = min(row["groups"], key=lambda g: row["groups"][g][timed])
    return row


def markdown(record: dict) -> str:
    device = record["device_time"]
    groups = record["groups"]
    unit = "gate/up device µs (GB/s of its expert bytes)" if device else "whole chain µs, calls in one graph"
    lines = [f"MoE decode gate/up by rows per pass (GROUP); {unit}; default GROUP {record['default_group']}", "",
             "| B | expert MB | " + " | ".join(f"GROUP {g}" for g in groups) + " | fastest | same bits |",
             "|---:|---:|" + "---:|" * len(groups) + "---|---|"]
    for r in record["rows"]:
        cells = []
        for g in groups:
            e = r["groups"][str(g)]
            if device:
                gbs = f" ({e['gate_up_gb_s']:.0f})" if e.get("gate_up_gb_s") else ""
                cells.append(f"{e['gate_up_us']:.1f}{gbs}" if e.get("gate_up_us") else "")
            else:
                cells.append(f"{e['chain_us']:.1f}")
        same = all(e["same_bits"] for e in r["groups"].values())
        lines.append(f"| {r['batch']} | {r['expert_bytes'] / 1e6:.1f} | " + " | ".join(cells)
                     + f" | {r['fastest']} | {'yes' if same else 'NO'} |")
    if device:
        lines += ["", "Whole chain (route, gate/up, down, combine), device µs:", "",
                  "| B | " + " | ".join(f"GROUP {g}" for g in groups) + " |", "|---:|" + "---:|" * len(groups)]
        for r in record["rows"]:
            lines.append(f"| {r['batch']} | " + " | ".join(f"{r['groups'][str(g)]['chain_us']:.1f}" for g in groups)
                         + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for moe-decode-sweep.json/.md")
    parser.add_argument("--batch", default="1,4,8,16", help="rows per call, 1 to 16, comma-separated")
    parser.add_argument("--groups", default=",".join(map(str, decode.GATE_UP_GROUPS)),
                        help=f"rows per pass to try, of {decode.GATE_UP_GROUPS}")
    parser.add_argument("--device-time", action="store_true",
                        help="each kernel's device time (NVIDIA, needs PyTorch)")
    parser.add_argument("--dims", default=None, help=argparse.SUPPRESS)  # tests: "D,E,k,I,IS"
    parser.add_argument("--backend", default=None, help=argparse.SUPPRESS)  # tests: 'emulator'
    args = parser.parse_args(argv)
    try:
        batches = [int(b) for b in args.batch.split(",")]
        groups = [int(g) for g in args.groups.split(",")]
    except ValueError:
        parser.error("--batch and --groups take comma-separated numbers")
    if not all(1 <= b <= decode.MAX_BATCH for b in batches):
        parser.error(f"--batch {args.batch}: 1 to {decode.MAX_BATCH} rows")
    if not groups or not all(g in decode.GATE_UP_GROUPS for g in groups):
        parser.error(f"--groups {args.groups}: each one of {decode.GATE_UP_GROUPS}")
    dims = tuple(int(v) for v in args.dims.split(",")) if args.dims else REAL_DIMS
    backend = args.backend or gpu_backend()
    if backend is None:
        raise SystemExit("needs a GPU (Metal or CUDA)")
    if args.device_time:
        from bench.diagnostics.tuning.weight_reads import torch_cuda_missing

        why = torch_cuda_missing()
        if why:
            raise SystemExit(f"--device-time needs PyTorch with CUDA ({why})")
    rows = [sweep(b, groups, backend, dims, args.device_time) for b in batches]
    record = {"when": now_iso(), "machine": machine_info(), "software": software_info(), "backend": backend,
              "dims": dict(zip(("D", "E", "k", "I", "IS"), dims)), "device_time": args.device_time,
              "default_group": decode.GATE_UP_GROUP, "groups": groups, "rows": rows}
    write_json(args.out, "moe-decode-sweep.json", record)
    write_report(args.out, "moe-decode-sweep.md", markdown(record))
    if not all(e["same_bits"] for r in rows for e in r["groups"].values()):
        log("a choice of GROUP changed a row's bits: the kernel's contract is broken")
        return 1
    if any(r["contract"] != "met" for r in rows):
        log("the kernels missed the op's contract: " + "; ".join(r["contract"] for r in rows))
        return 1
    fastest = ", ".join(f"{r['batch']}: {r['fastest']}" for r in rows)
    log(f"fastest GROUP by B: {fastest}; median of the fastest: "
        f"{statistics.median(int(r['fastest']) for r in rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
