"""The MoE decode chain's launch choices: the data to tune them.

``moe_decode_gate_up`` takes the batch rows that use an expert ``GROUP`` at a
time (``kernels/moe/decode.py``, ``GATE_UP_GROUP``): each pass keeps that many
rows' accumulators in registers and reads the expert's rows again, so the
choice trades registers a lane (threadgroups resident on a core) against
passes. With ``--launch`` the tool also tries gate/up's SIMD groups per
threadgroup (only route's norm's, the default, takes route into gate/up's
launch for a few rows; "route apart" keeps two launches there), hidden rows
per SIMD group of the routed launch ("routed rows N") and of gate/up's own
(two launches), and down's SIMD groups and output rows per SIMD group
(``GATE_UP_SIMD_GROUPS``, ``DOWN_SIMD_GROUPS``, ``DOWN_ROWS_PER_SG``; each at
every B, where the default row takes down's by-B choice on CUDA,
``CUDA_DOWN_LAUNCH_FOR_BATCH``), and down and the combine as one launch at
every B ("combined down", then its SIMD groups "sg N" and output elements
per threadgroup "rows R"; "down apart": two launches, whatever the default;
the one launch's time counts as down's). Every
choice gives every row the same bits; this tool checks that on the device
and times each, per batch size B (server decode batches, the verification
pass's positions):

    python3 -m bench.diagnostics.tuning.moe_decode_sweep --out DIR [--batch 1,4,8,16] [--device-time] [--launch]
        [--cold N] [--only PREFIXES]

Random weights at the real Qwen3.6-35B-A3B MoE shapes (hidden 2048, 256
experts, top 8, expert and shared hidden 512; 4-bit group 64), one call of
the whole chain (route, gate/up, down, combine) per B and choice. By
default a call's time is the wall time of calls evaluated together as one
graph; with ``--device-time`` (NVIDIA, with PyTorch) it is each kernel's
device time (CUPTI), gate/up's reported alone (where route and gate/up run
as one launch, B <= ``decode.ROUTED_MAX_ROWS`` at the default SIMD groups
or B <= 4 in the "routed rows N" choices, that launch's). The first
choice's output is checked against the op's contract (``moe_decode_agree``), the others'
against its bits. Repeated calls on one set of weights find them in the
GPU's L2 cache (50 MB on an H200; a call reads 11 to 120 MB), which a decode
step never does: each layer's experts are read once a token. With ``--cold
N`` the timed calls cycle over N sets of weights and routing (N x 0.8 GB at
the real shapes), so each call reads its experts from memory, as in a step.
"expert MB" is what gate/up must read: the distinct experts the rows picked, and the shared expert, gate
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
from bench.diagnostics.tuning.weight_reads import sweep_backend
from bench.ops import time_in_graph
from mlx_lily.kernels.moe import decode
from mlx_lily.kernels.moe.testing import moe_decode_inputs

# hidden, experts, top k, expert hidden, shared hidden: Qwen3.6-35B-A3B's MoE.
REAL_DIMS = (2048, 256, 8, 512, 512)
ROUNDS = 8
# A profiled kernel's family by its name (the first marker it holds); route
# and gate/up as one launch (a few rows) counts as gate/up.
FAMILIES = (("route_gate_up", "gate_up"), ("gate_up", "gate_up"), ("down", "down"), ("route", "route"),
            ("combine", "combine"))


def _expert_bytes(args, inds: mx.array) -> int:
    """Gate and up bytes (words, scales, biases) of the distinct experts in
    ``inds`` plus the shared expert's."""
    *_, glu, shared = args
    per_expert = sum(a.nbytes // a.shape[0] for p in (glu.gate_proj, glu.up_proj)
                     for a in (p.weight, p.scales, p.biases))
    shared_bytes = sum(a.nbytes for p in (shared.gate_proj, shared.up_proj) for a in (p.weight, p.scales, p.biases))
    return len(set(np.array(inds).reshape(-1).tolist())) * per_expert + shared_bytes


def _device_us(fn, rounds: int = ROUNDS, sets: int = 1) -> dict:
    """{kernel family: device µs per call} over ``rounds`` calls, each
    evaluated alone; call i runs ``fn(i % sets)``."""
    from bench.gpu_time import kernel_times

    for i in range(sets):
        mx.eval(fn(i))

    def run():
        for i in range(rounds):
            mx.eval(fn(i % sets))

    per = {}
    for name, times in kernel_times(run).items():
        family = next((f for marker, f in FAMILIES if f"moe_decode_{marker}" in name), "other")
        per[family] = per.get(family, 0.0) + sum(times) / rounds
    return per


def variants(groups, launch: bool) -> dict:
    """{label: {module constant: value}}: each GROUP, then (``launch``) each
    of gate/up's SIMD groups and down's SIMD groups x rows per SIMD group."""
    out = {f"group {g}": {"GATE_UP_GROUP": g} for g in groups}
    if launch:
        out.update({f"gate_up sg {n}": {"GATE_UP_SIMD_GROUPS": n} for n in decode.SIMD_GROUP_CHOICES})
        # Route apart: gate/up at its default SIMD groups, two launches even
        # where the default takes route into gate/up (B <= ROUTED_MAX_ROWS);
        # the other SIMD groups always take two.
        out["route apart"] = {"ROUTED_MAX_ROWS": 0}
        # The routed launch's rows per SIMD group, at up to 4 rows (the
        # default takes it at one row only).
        out.update({f"routed rows {n}": {"ROUTED_ROWS_PER_SG": n, "ROUTED_ROWS_BY_BATCH": False,
                                         "ROUTED_MAX_ROWS": 4}
                    for n in decode.ROWS_PER_SG_CHOICES})
        out.update({f"gate_up rows {n}": {"GATE_UP_ROWS_PER_SG": n, "ROUTED_MAX_ROWS": 0}
                    for n in decode.ROWS_PER_SG_CHOICES if n > 1})
        out.update({f"down sg {n} x {r}": {"DOWN_SIMD_GROUPS": n, "DOWN_ROWS_PER_SG": r, "DOWN_BY_BATCH": False,
                                            "COMBINED_DOWN_MAX_ROWS": 0}
                    for n in decode.SIMD_GROUP_CHOICES for r in decode.DOWN_ROWS_CHOICES})
        # Down and the combine as one launch at every B ("combined down", its
        # time counted as down's: a SIMD group per slot at the default; then
        # fewer SIMD groups, and each count of output elements a
        # threadgroup), and as two ("down apart", whatever the default).
        every_b = {"COMBINED_DOWN_MAX_ROWS": decode.MAX_BATCH}
        out["down apart"] = {"COMBINED_DOWN_MAX_ROWS": 0}
        out["combined down"] = dict(every_b)
        out.update({f"combined down sg {n}": {**every_b, "COMBINED_DOWN_SIMD_GROUPS": n}
                    for n in decode.SIMD_GROUP_CHOICES if n < 8})
        out.update({f"combined down rows {r}": {**every_b, "COMBINED_DOWN_ROWS": r}
                    for r in decode.COMBINED_DOWN_ROWS_CHOICES})
    return out


def sweep(batch: int, choices: dict, backend: str, dims, device_time: bool, cold: int = 0) -> dict:
    D, E, k, I, IS = dims
    sets = [moe_decode_inputs(D, E, k, I, IS, seed=batch + 1000 * i, rows=batch) for i in range(max(cold, 1))]
    args, kwargs = sets[0]
    mx.eval(args[:4])
    _, inds, _ = decode.moe_decode_route_kernel.run_on(backend, *args[:2], *args[3:7])
    row = {"batch": batch, "expert_bytes": _expert_bytes(args, inds), "weight_sets": len(sets), "groups": {}}
    first_bits = None
    for label, setting in choices.items():
        saved = {name: getattr(decode, name) for name in setting}
        try:
            for name, value in setting.items():
                setattr(decode, name, value)

            def fn(i=0):
                set_args, set_kwargs = sets[i]
                return decode.moe_decode_kernel.run_on(backend, *set_args, **set_kwargs)

            out = fn()
            mx.eval(out)
            bits = np.array(out.view(mx.uint16))
            if first_bits is None:  # the first choice against the op's contract; the rest against it
                first_bits = bits
                mismatch = decode.moe_decode_agree(out, out, *args, **kwargs)
                row["contract"] = mismatch or "met"
            entry = {"same_bits": bool(np.array_equal(bits, first_bits))}
            if device_time:
                per = _device_us(fn, rounds=max(ROUNDS, 2 * len(sets)), sets=len(sets))
                entry.update({"gate_up_us": per.get("gate_up"), "down_us": per.get("down"),
                              "chain_us": sum(per.values())})
                entry["gate_up_gb_s"] = row["expert_bytes"] / entry["gate_up_us"] / 1e3 if entry["gate_up_us"] else None
            else:
                entry["chain_us"] = 1e3 * time_in_graph(lambda: fn(), (), {}, calls=8, graphs=5)
        except RuntimeError as exc:  # e.g. CUDA: too many registers for the threadgroup
            if first_bits is None:
                raise
            entry = {"same_bits": None, "error": " ".join(str(exc).split())[:200]}
        finally:
            for name, value in saved.items():
                setattr(decode, name, value)
        row["groups"][label] = entry
        log(f"B = {batch}, {label}: " + ", ".join(
            f"{key} {value:.1f}" if isinstance(value, float) else f"{key} {value}" for key, value in entry.items()))
    timed = "gate_up_us" if device_time else "chain_us"
    ran = [g for g in row["groups"] if g.startswith("group") and row["groups"][g].get(timed)]
    row["fastest"] = min(ran, key=lambda g: row["groups"][g][timed]).split()[-1] if ran else None
    if device_time:
        downs = [g for g in row["groups"] if g.startswith("down") and row["groups"][g].get("down_us")]
        row["fastest_down"] = min(downs, key=lambda g: row["groups"][g]["down_us"]) if downs else None
    return row


def markdown(record: dict) -> str:
    device = record["device_time"]
    labels = list(record["rows"][0]["groups"]) if record["rows"] else []
    unit = "device µs of gate/up (GB/s of its expert bytes) / down / the chain" if device \
        else "whole chain µs, calls in one graph"
    if record.get("cold"):
        unit += f"; weights read from memory (calls cycle over {record['cold']} weight sets)"
    lines = [f"MoE decode launch choices; {unit}. Defaults: GROUP {record['default_group']}, "
             f"{record['defaults']}", "",
             "| B | expert MB | choice | " + ("gate/up | down | chain" if device else "chain") + " | same bits |",
             "|---:|---:|---|" + ("---:|---:|---:|" if device else "---:|") + "---|"]
    for r in record["rows"]:
        for label in labels:
            e = r["groups"][label]
            if "error" in e:
                cells = f"did not run: {e['error']}" + (" | |" if device else "")
            elif device:
                gbs = f" ({e['gate_up_gb_s']:.0f})" if e.get("gate_up_gb_s") else ""
                cells = " | ".join([f"{e['gate_up_us']:.1f}{gbs}" if e.get("gate_up_us") else "",
                                    f"{e['down_us']:.1f}" if e.get("down_us") else "", f"{e['chain_us']:.1f}"])
            else:
                cells = f"{e['chain_us']:.1f}"
            same = "" if e["same_bits"] is None else ("yes" if e["same_bits"] else "NO")
            lines.append(f"| {r['batch']} | {r['expert_bytes'] / 1e6:.1f} | {label} | {cells} | {same} |")
    lines.append("")
    for r in record["rows"]:
        lines.append(f"- B = {r['batch']}: fastest GROUP {r['fastest']}"
                     + (f", fastest down {r['fastest_down']}" if r.get("fastest_down") else ""))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for moe-decode-sweep.json/.md")
    parser.add_argument("--batch", default="1,4,8,16", help="rows per call, 1 to 16, comma-separated")
    parser.add_argument("--groups", default=",".join(map(str, decode.GATE_UP_GROUPS)),
                        help=f"rows per pass to try, of {decode.GATE_UP_GROUPS}")
    parser.add_argument("--device-time", action="store_true",
                        help="each kernel's device time (NVIDIA, needs PyTorch)")
    parser.add_argument("--launch", action="store_true",
                        help="also gate/up's SIMD groups and hidden rows per SIMD group, route apart, and down's "
                             "SIMD groups x rows per SIMD group")
    parser.add_argument("--only", default=None, metavar="PREFIXES",
                        help="comma-separated label prefixes: time only the choices whose labels start with one "
                             "(e.g. 'group 1,routed rows'); the first of them in the sweep's order is the reference")
    parser.add_argument("--cold", type=int, default=0, metavar="N",
                        help="cycle the timed calls over N sets of weights (about 0.8 GB each at the real shapes), "
                             "so each call reads its experts from memory, not from the L2 cache")
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
    backend = sweep_backend(args.backend, args.device_time)
    choices = variants(groups, args.launch)
    if args.only:
        prefixes = [p.strip() for p in args.only.split(",") if p.strip()]
        choices = {label: c for label, c in choices.items() if any(label.startswith(p) for p in prefixes)}
        if not choices:
            parser.error(f"--only {args.only}: no choice's label starts with these (see --launch's labels)")
    if args.cold < 0 or args.cold == 1:
        parser.error(f"--cold {args.cold}: 0 (off) or at least 2 weight sets")
    rows = [sweep(b, choices, backend, dims, args.device_time, args.cold) for b in batches]
    defaults = {n: getattr(decode, n) for n in ("GATE_UP_SIMD_GROUPS", "GATE_UP_ROWS_PER_SG", "ROUTED_ROWS_PER_SG",
                                                "CUDA_ROUTED_ROWS_FOR_BATCH", "DOWN_SIMD_GROUPS", "DOWN_ROWS_PER_SG",
                                                "CUDA_DOWN_LAUNCH_FOR_BATCH")}
    record = {"when": now_iso(), "machine": machine_info(), "software": software_info(), "backend": backend,
              "dims": dict(zip(("D", "E", "k", "I", "IS"), dims)), "device_time": args.device_time,
              "cold": args.cold, "default_group": decode.GATE_UP_GROUP, "defaults": defaults, "groups": groups,
              "choices": choices, "rows": rows}
    write_json(args.out, "moe-decode-sweep.json", record)
    write_report(args.out, "moe-decode-sweep.md", markdown(record))
    if any(e["same_bits"] is False for r in rows for e in r["groups"].values()):
        log("a launch choice changed a row's bits: the kernels' contract is broken")
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
