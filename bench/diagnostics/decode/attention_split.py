"""Decode attention on both sides of the split: the data to tune SPLIT_FROM and the key blocks.

For each context, at the model's shapes (16 query / 2 KV heads, dim 256, a
strided bf16 KV cache view as mlx-lm's KVCache passes it), times stock's
attention, lily's single-pass decode kernel (one threadgroup per KV head) and
lily's split kernel at several key blocks, and lily's own choice at that
context ("chosen": SPLIT_FROM and decode_key_block), and checks each kernel result
against the reference. SPLIT_FROM should be the smallest context from which
the split is faster than the single pass, and decode_key_block should pick
the fastest block per context. "prefetch N": lily's choice with N passes of
key and value rows in flight per SIMD group (``DECODE_PREFETCH``; the same
bits, checked here against the chosen form's).

    python3 -m bench.diagnostics.decode.attention_split --out DIR [--lengths 256,...,128K] [--prefetch 2,4]

Writes DIR/attention-split.json and DIR/attention-split.md (the table).
"""

from __future__ import annotations

import argparse
import json
import sys

import mlx.core as mx

import mlx_lily.kernels  # noqa: F401  (registers the ops)
from bench.common import length_label, log, machine_info, now_iso, parse_lengths, software_info, write_report
from bench.ops import KV_CACHE_STEP, time_call
from mlx_lily.toolchain.registry import gpu_backend

A = sys.modules["mlx_lily.kernels.attention.sdpa"]

LENGTHS = "256,1K,2K,4K,8K,16K,32K,64K,128K"
KEY_BLOCKS = (64, 128, 256, 512)
NEVER = 1 << 40


def inputs(ctx: int, hq=16, hkv=2, D=256):
    keys = mx.random.split(mx.random.key(ctx), 3)
    rows = (ctx // KV_CACHE_STEP + 1) * KV_CACHE_STEP
    q = mx.random.normal((1, hq, 1, D), key=keys[0]).astype(mx.bfloat16)
    k = mx.random.normal((1, hkv, rows, D), key=keys[1]).astype(mx.bfloat16)[:, :, :ctx, :]
    v = mx.random.normal((1, hkv, rows, D), key=keys[2]).astype(mx.bfloat16)[:, :, :ctx, :]
    mx.eval(q, k, v)
    return q, k, v, D**-0.5, None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for attention-split.json/.md")
    parser.add_argument("--lengths", default=LENGTHS)
    parser.add_argument("--prefetch", default="2,4",
                        help="DECODE_PREFETCH values to time besides the default, comma-separated (default 2,4)")
    parser.add_argument("--backend", default=None, help=argparse.SUPPRESS)  # tests: 'emulator'
    args = parser.parse_args(argv)
    try:
        prefetches = [int(n) for n in args.prefetch.split(",") if n.strip()]
    except ValueError:
        parser.error(f"--prefetch {args.prefetch}: comma-separated whole numbers")
    if any(n < 1 for n in prefetches):
        parser.error(f"--prefetch {args.prefetch}: each at least 1")
    backend = args.backend or gpu_backend()
    if backend is None:
        raise SystemExit("needs a GPU (Metal or CUDA)")
    rows = []
    for ctx in parse_lengths(args.lengths):
        call = inputs(ctx)
        want = A.attention_reference(*call)
        row = {"context": ctx, "stock_ms": time_call(A.attention_reference, call, {})["ms"]}
        variants = {"chosen": {}, "single": dict(split_from=NEVER)}
        variants.update({f"split_{b}": dict(split_from=1, key_block=b) for b in KEY_BLOCKS})
        variants.update({f"prefetch_{n}": dict(prefetch=n) for n in prefetches})
        chosen = None
        for name, options in variants.items():
            def fn(*a, options=options):
                options = dict(options)
                prefetch = options.pop("prefetch", A.DECODE_PREFETCH)
                held, A.DECODE_PREFETCH = A.DECODE_PREFETCH, prefetch
                try:
                    return A.run_decode(backend, *a, **options)
                finally:
                    A.DECODE_PREFETCH = held
            row[f"{name}_ms"] = time_call(fn, call, {})["ms"]
            got = fn(*call)
            row[f"{name}_agrees"] = A.attention_agree(got, want) is None
            if name == "chosen":
                chosen = got
            elif name.startswith("prefetch_"):
                row[f"{name}_agrees"] = row[f"{name}_agrees"] and mx.array_equal(got, chosen).item()
        log(f"context {length_label(ctx)}: " + ", ".join(
            f"{k} {v:.4f}" for k, v in row.items() if k.endswith("_ms")))
        rows.append(row)
    doc = {"tool": "mlx-lily attention split sweep", "finished": now_iso(), "machine": machine_info(),
           "software": software_info(), "settings": {"SPLIT_FROM": A.SPLIT_FROM, "KEY_BLOCK": A.KEY_BLOCK,
           "MIN_KEY_BLOCK": A.MIN_KEY_BLOCK, "SPLIT_THREADGROUPS": A.SPLIT_THREADGROUPS,
           "DECODE_PREFETCH": A.DECODE_PREFETCH,
           "shape": "16 q / 2 kv heads, dim 256, bf16, strided KV view"}, "rows": rows}
    write_report(args.out, "attention-split.json", json.dumps(doc, indent=1), echo=False)
    names = ["stock", "chosen", "single"] + [f"split_{b}" for b in KEY_BLOCKS] + [f"prefetch_{n}" for n in prefetches]
    lines = ["| context | " + " | ".join(f"{n} ms" for n in names) + " |",
             "|---" * (len(names) + 1) + "|"]
    for row in rows:
        cells = [f"{row[f'{n}_ms']:.4f}" + ("" if n == "stock" or row[f"{n}_agrees"] else " (DISAGREES)")
                 for n in names]
        lines.append(f"| {length_label(row['context'])} | " + " | ".join(cells) + " |")
    write_report(args.out, "attention-split.md", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
