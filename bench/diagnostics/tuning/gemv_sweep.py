"""The decode GEMV's launch choices at the model's shapes: the data to tune them.

For each merged projection a decode token runs through ``quantized_matvec``
(random weights at the real Qwen3.6-35B-A3B shapes, 4-bit group 64; the router
8-bit), times stock's op sequence (its reference), the kernel as the launcher
chooses it ("chosen"), and the kernel at every rows-per-SIMD-group choice and
several SIMD groups per threadgroup; each result is checked against the
contract. GB/s is the weights' bytes (words, scales, biases) over the time:
the HBM-speed figure the kernel should approach.

    python3 -m bench.diagnostics.tuning.gemv_sweep --out DIR [--device-time] [--batch B[,B...]] [--tiles]
        [--no-grid] [--tile-splits N[,N...]] [--no-row-gemv] [--prologue none|norm|gate]

``--batch B`` (or a list, e.g. ``1,4,16``: one process, one row per call
and B) sweeps calls of B rows of x (the server's decode batches, the
verification pass's positions): every variant gives each row the default's
bits where its SIMD groups are at least the default's (the norm keeps the
B = 1 launch's order), so the fastest of those can become the bucket's
default without changing any output.

``--tiles`` also times the GEMV on matrix tiles (``gemv_tiles.py``, the
model's form on CUDA; "chosen" is the row-parallel GEMV) where it takes the
call (bf16; every segment 4-bit or every one 8-bit): at each K split with one
output tile a threadgroup (tilesN), with 2 and 4 tiles a threadgroup at the
call's default split (tilesNx2, tilesNx4: the same bits as tilesN) and as
the launcher chooses at this B (tiles_default): the figures that chose each
backend's form and defaults.

By default a call's time is the wall time of CALLS_PER_GRAPH calls evaluated
as one graph (host gaps between kernels included). With ``--device-time``
(NVIDIA, with PyTorch) it is the kernels' device time (CUPTI), each call
evaluated on its own and reading its own copy of the weights, rotating over
more than the GPU's L2 cache (``weight_reads.rotation``): the kernel alone.

Writes DIR/gemv-sweep.json and DIR/gemv-sweep.md (the table).
"""

from __future__ import annotations

import argparse
from typing import Optional
import json
import sys

import mlx.core as mx

import mlx_lily.kernels  # noqa: F401  (registers the ops)
from bench.common import log, machine_info, now_iso, software_info, write_report
from bench.diagnostics.tuning.weight_reads import CALLS, device_us, rotation, sweep_backend, weight_bytes
from bench.ops import time_call, time_in_graph as ops_time_in_graph
from mlx_lily.kernels.linear.gemv import (
    ROWS_CHOICES,
    quantized_matvec_agree,
    quantized_matvec_kernel,
    quantized_matvec_reference,
)
from mlx_lily.kernels.linear.gemv_tiles import TPG_CHOICES, default_launch
from mlx_lily.kernels.linear.gemv_tiles import default_simdgroups as tile_default_simdgroups
from mlx_lily.kernels.linear.gemv_tiles import simdgroup_choices as tile_simdgroup_choices
from mlx_lily.kernels.linear.gemv_tiles import quantized_matvec_tiles_kernel, quantized_matvec_tiles_supports
from mlx_lily.kernels.linear.testing import gemv_call

# 32 SIMD groups (1024 threads) exceed an H200 SM's registers at the body's
# 113 per thread (nvcc, sm_90): the launch fails. So may 16 at large
# buckets (more accumulators a lane): such a variant is recorded as not run.
SIMDGROUPS = (2, 4, 8, 16)
# Calls per timed graph: one evaluation's launch and sync overhead (tens of
# microseconds on CUDA) spread over this many kernels, so the figure is the
# kernel's device time plus the gap between two kernels of one graph. (At
# 5bcabe5389 the timing also held the host's building of each call's graph,
# for the kernel a Python launch: those figures are not kernel times.)
CALLS_PER_GRAPH = 32
GRAPHS_TIMED = 15

def time_in_graph(fn, args, kwargs) -> float:
    """Microseconds per call, CALLS_PER_GRAPH calls built, then evaluated together."""
    return 1e3 * ops_time_in_graph(fn, args, kwargs, CALLS_PER_GRAPH, GRAPHS_TIMED)


def copy_floor(args) -> dict:
    """What this GPU moves through MLX's own elementwise kernel: the weights'
    words read and written once (xor), per call in a graph of many."""
    _, weights = args
    words = [w for w, _, _ in weights]
    us = time_in_graph(lambda *ws: [mx.bitwise_xor(w, 1) for w in ws], tuple(words), {})
    return {"us": us, "gb_s": 2 * sum(w.nbytes for w in words) / us / 1e3}


def sweep(name: str, spec: tuple, backend: str, device_time: bool = False, batch: int = 1,
          tiles: bool = False, grid: bool = True, tile_splits: Optional[tuple] = None, chosen: bool = True) -> dict:
    K, rows, bits, prologue, residual = spec
    args, kwargs = gemv_call(K, rows, bits, prologue, residual, seed=K + sum(rows), batch=batch)
    mx.eval(args, kwargs)
    nbytes = weight_bytes(args)
    want = quantized_matvec_reference(*args, **kwargs)
    if device_time:
        sets = rotation(args[1])

        def timed(fn, args, kwargs):
            return device_us(lambda ws: fn(args[0], ws, **kwargs), sets)
    else:
        timed = time_in_graph

    row = {"call": name, "batch": batch, "weight_bytes": nbytes, "timing": "device" if device_time else "graph",
           "stock_us": timed(quantized_matvec_reference, args, kwargs), "copy": copy_floor(args)}
    variants = {}
    if chosen:
        row["one_eval_us"] = 1e3 * time_call(quantized_matvec_kernel.run_on, (backend,) + args, kwargs)["ms"]
        variants["chosen"] = (quantized_matvec_kernel, {})
    nsg = tile_default_simdgroups(backend, sum(rows))
    if grid:
        variants.update({f"r{r}x{g}": (quantized_matvec_kernel, dict(rows_per_simdgroup=r, simdgroups=g))
                         for r in ROWS_CHOICES for g in SIMDGROUPS})
    if tiles and quantized_matvec_tiles_supports(*args, **kwargs) is None:
        variants.update({f"tiles{g}": (quantized_matvec_tiles_kernel, dict(simdgroups=g, tiles_per_threadgroup=1))
                         for g in tile_simdgroup_choices(backend) if tile_splits is None or g in tile_splits})
        # Several tiles a threadgroup at the call's default K split (the same bits).
        variants.update({f"tiles{nsg}x{t}": (quantized_matvec_tiles_kernel,
                                              dict(simdgroups=nsg, tiles_per_threadgroup=t))
                         for t in TPG_CHOICES[1:]})
        # The backend's own defaults for this call and B (given, not read from
        # the process: --backend may name another backend than it runs).
        default_nsg, default_tpg = default_launch(backend, rows, batch)
        variants["tiles_default"] = (quantized_matvec_tiles_kernel,
                                     dict(simdgroups=default_nsg, tiles_per_threadgroup=default_tpg))
    outputs = {}
    for variant, (kernel, options) in variants.items():
        def fn(*a, kernel=kernel, options=options, **k):
            return kernel.run_on(backend, *a, **options, **k)
        try:
            us = timed(fn, args, kwargs)
            outputs[variant] = fn(*args, **kwargs)
            agrees = quantized_matvec_agree(outputs[variant], want, *args, **kwargs) is None
        except RuntimeError as e:  # e.g. CUDA: "too many resources requested for launch"
            if variant == "chosen":
                raise
            log(f"{name}: {variant} did not run: {e}")
            row[variant] = {"us": None, "gb_s": None, "agrees": None, "error": str(e)}
            continue
        row[variant] = {"us": us, "gb_s": nbytes / us / 1e3, "agrees": agrees}
        one_tile = (variant.split("x")[0] if variant.startswith("tiles") and "x" in variant
                    else f"tiles{nsg}" if variant == "tiles_default" else None)
        if one_tile in outputs:  # several tiles a threadgroup: tilesN's bits
            row[variant]["same_bits_as_" + one_tile] = all(
                mx.array_equal(a, b).item() for a, b in zip(outputs[variant], outputs[one_tile]))
    ran = [v for v in variants if v != "chosen" and row[v]["us"] is not None]
    best = min(ran, key=lambda v: row[v]["us"]) if ran else "chosen"  # noqa: B023
    if best not in row:
        raise SystemExit(f"{name}: no variant ran (--no-row-gemv needs --tiles and a call the tile form takes)")
    row["best"] = best
    said = f", chosen {row['chosen']['us']:.1f} us" if "chosen" in row else ""
    log(f"{name}, B = {batch}: stock {row['stock_us']:.1f} us{said}, "
        f"best {best} {row[best]['us']:.1f} us ({row[best]['gb_s']:.0f} GB/s); "
        f"MLX copy of the words {row['copy']['gb_s']:.0f} GB/s")
    return row


def markdown(rows: list) -> str:
    timing = (f"{CALLS_PER_GRAPH} calls evaluated in one graph" if not rows or rows[0].get("timing") != "device"
              else "device time of each kernel alone (CUPTI), weights rotating past the L2 cache "
                   "(\"copy GB/s\" and \"one call per eval\" stay wall-clock timings)")
    lines = [f"Microseconds per call, {timing}; \"copy GB/s\": MLX's",
             "elementwise kernel reading and writing the packed weights once (the machine's reachable rate).",
             "",
             "| call | weights MB | stock us | chosen us | best | best us | best GB/s | copy GB/s | one call per eval us |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    several = len({r.get("batch", 1) for r in rows}) > 1

    def label(r):
        return f"{r['call']} (B = {r['batch']})" if several else r["call"]

    for r in rows:
        best = r[r["best"]]
        flag = "" if all(r[v]["agrees"] is not False for v in r if isinstance(r[v], dict) and v != "copy") \
            else " (A RESULT DISAGREES)"
        chosen_us = f"{r['chosen']['us']:.1f}" if "chosen" in r else ""
        one_eval = f"{r['one_eval_us']:.1f}" if "one_eval_us" in r else ""
        lines.append(f"| {label(r)}{flag} | {r['weight_bytes'] / 1e6:.1f} | {r['stock_us']:.1f} | "
                     f"{chosen_us} | {r['best']} | {best['us']:.1f} | {best['gb_s']:.0f} | "
                     f"{r['copy']['gb_s']:.0f} | {one_eval} |")
    lines += ["", "Every variant, us (rows per SIMD group x SIMD groups per threadgroup):", ""]
    variants = []
    for r in rows:
        variants += [v for v in r if isinstance(r[v], dict) and v not in ("chosen", "copy") and v not in variants]
    lines.append("| call | " + " | ".join(variants) + " |")
    lines.append("|---" * (len(variants) + 1) + "|")
    for r in rows:
        lines.append(f"| {label(r)} | " + " | ".join(
            "" if v not in r else "did not run" if r[v]["us"] is None else f"{r[v]['us']:.1f}"
            for v in variants) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for gemv-sweep.json/.md")
    parser.add_argument("--calls", default=None,
                        help="comma-separated substrings of the calls to sweep (default: all): "
                             + "; ".join(CALLS))
    parser.add_argument("--device-time", action="store_true",
                        help="time each kernel alone on the device (NVIDIA, needs PyTorch; see above)")
    parser.add_argument("--batch", default="1",
                        help="rows of x per call, 1 to 16, or a comma-separated list (default 1)")
    parser.add_argument("--tiles", action="store_true",
                        help="also time the GEMV on matrix tiles (quantized_matvec_tiles) at each of its "
                             "SIMD-group choices (tiles1, tiles2, tiles4; tiles8 on CUDA), with 2 and 4 tiles a "
                             "threadgroup, and as launched by default, where it takes the call")
    parser.add_argument("--no-grid", action="store_true",
                        help="skip the row-parallel GEMV's grid of launch choices: stock, the chosen "
                             "launch and (with --tiles) the tile form only, a few minutes less per B")
    parser.add_argument("--tile-splits", default=None,
                        help="with --tiles: only these SIMD-group counts for the tile form (comma-separated; "
                             "fewer kernel instances to build)")
    parser.add_argument("--no-row-gemv", action="store_true",
                        help="with --tiles: skip the row-parallel GEMV as chosen too (stock and the tile form only)")
    parser.add_argument("--prologue", choices=("none", "norm", "gate"), default=None,
                        help="every call with this prologue instead of its own (what the norm or the gate "
                             "costs at each B; rows named with the prologue)")
    parser.add_argument("--backend", default=None, help=argparse.SUPPRESS)  # tests: 'emulator'
    args = parser.parse_args(argv)
    try:
        batches = [int(b) for b in str(args.batch).split(",")]
    except ValueError:
        parser.error(f"--batch {args.batch!r}: numbers of rows, 1 to 16, comma-separated")
    if not all(1 <= b <= 16 for b in batches):
        parser.error(f"--batch {args.batch}: 1 to 16 rows")
    try:
        tile_splits = tuple(int(g) for g in args.tile_splits.split(",")) if args.tile_splits else None
    except ValueError:
        parser.error(f"--tile-splits {args.tile_splits!r}: SIMD-group counts, comma-separated")
    if args.no_row_gemv and not args.tiles:
        parser.error("--no-row-gemv times the tile form only: it needs --tiles")
    backend = sweep_backend(args.backend, args.device_time)
    if tile_splits is not None and not set(tile_splits) <= set(tile_simdgroup_choices(backend)):
        parser.error(f"--tile-splits {args.tile_splits}: the tile form takes "
                     f"{', '.join(map(str, tile_simdgroup_choices(backend)))} SIMD groups on {backend}")
    wanted = [w.strip() for w in args.calls.split(",")] if args.calls else None
    calls = {n: spec for n, spec in CALLS.items() if wanted is None or any(w in n for w in wanted)}
    if not calls:
        raise SystemExit(f"--calls {args.calls!r} matches none of: {'; '.join(CALLS)}")
    if args.prologue is not None:
        calls = {f"{n} [{args.prologue} prologue]": (K, rows, bits, args.prologue, residual)
                 for n, (K, rows, bits, _, residual) in calls.items()}
    rows: list = []
    for name, spec in calls.items():
        for batch in batches:
            rows.append(sweep(name, spec, backend, args.device_time, batch, args.tiles,
                              not args.no_grid and not args.no_row_gemv, tile_splits, not args.no_row_gemv))
        # Written after every call: a run cut short (each variant compiles a
        # kernel instance, through NVRTC on CUDA) keeps what it measured.
        doc = {"tool": "mlx-lily decode GEMV sweep", "finished": now_iso(), "machine": machine_info(),
               "software": software_info(),
               "settings": {"rows_choices": ROWS_CHOICES, "simdgroups": SIMDGROUPS, "prologue": args.prologue,
                            "batch": batches[0] if len(batches) == 1 else batches,
                            "tiles": args.tiles, "grid": not args.no_grid and not args.no_row_gemv,
                            "tile_splits": list(tile_splits) if tile_splits else None,
                            "row_gemv": not args.no_row_gemv},
               "calls_done": len(rows), "calls_asked": len(calls) * len(batches), "rows": rows}
        write_report(args.out, "gemv-sweep.json", json.dumps(doc, indent=1), echo=False)
        write_report(args.out, "gemv-sweep.md", markdown(rows), echo=False)
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
