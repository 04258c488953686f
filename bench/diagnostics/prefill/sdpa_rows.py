"""Whether MLX's causal sdpa gives a query the same bits in different calls (a GPU run).

    python3 -m bench.diagnostics.prefill.sdpa_rows [--out DIR]

A prefill call computes attention for its queries [a, e) against keys
[0, e), causal. Prefix reuse resumes a prompt at some token, so a query can
be computed in a call that starts or ends elsewhere than in a cold prefill.
This compares, at the real head shapes (16 query / 2 KV heads of 256, bf16),
the rows that pairs of calls share, bit for bit, for MLX's
``scaled_dot_product_attention`` and lily's attention op (which on CUDA
takes MLX's sdpa for long calls, ``CUDA_PREFILL_REFERENCE_FROM``). A pair
differs in where it starts, where it ends, or both.

Prints a table and writes ``sdpa_rows.json`` to DIR.
"""

from __future__ import annotations

import argparse
import json

import mlx.core as mx

from bench.common import write_json, write_report

HQ, HKV, D = 16, 2, 256
POSITIONS = 8192
# (what differs, first call (start, end), second call)
PAIRS = (
    ("end -64", (2048, 4096), (2048, 4032)),
    ("end -32", (2048, 4096), (2048, 4064)),
    ("end -96", (2048, 4096), (2048, 4000)),
    ("end -1", (2048, 4096), (2048, 4095)),
    ("end -1096", (2048, 4096), (2048, 3000)),
    ("end +16", (4096, 6000), (4096, 6016)),
    ("end +100", (4096, 6000), (4096, 6100)),
    ("end +128", (4096, 6000), (4096, 6128)),
    ("start -1", (4096, 6000), (4095, 6000)),
    ("start -64", (4096, 6000), (4032, 6000)),
    ("start -128", (4096, 6000), (3968, 6000)),
    ("start -256", (4096, 6000), (3840, 6000)),
    ("start -2048", (4096, 6000), (2048, 6000)),
    ("start -64, end +64", (4096, 6000), (4032, 6064)),
    ("start -128, end +128", (4096, 6000), (3968, 6128)),
    ("start -128, end +100", (4096, 6000), (3968, 6100)),
    ("64 queries in 1904", (4096, 4160), (4096, 6000)),
    ("14 queries in 1904", (4096, 4110), (4096, 6000)),
    ("64 queries at 64 in 1904", (4160, 4224), (4096, 6000)),
)


def run(fn, q, k, v, call):
    a, e = call
    return fn(q[:, :, a:e], k[:, :, :e], v[:, :, :e])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args()
    from mlx_lily import kernels as K

    keys = mx.random.split(mx.random.key(0), 3)
    q = mx.random.normal((1, HQ, POSITIONS, D), key=keys[0]).astype(mx.bfloat16)
    k = mx.random.normal((1, HKV, POSITIONS, D), key=keys[1]).astype(mx.bfloat16)
    v = mx.random.normal((1, HKV, POSITIONS, D), key=keys[2]).astype(mx.bfloat16)
    scale = D ** -0.5
    fns = {
        "mx.fast sdpa": lambda q_, k_, v_: mx.fast.scaled_dot_product_attention(q_, k_, v_, scale=scale,
                                                                                 mask="causal"),
        "lily attention op": lambda q_, k_, v_: K.attention(q_, k_, v_, scale, "causal"),
    }
    rows = []
    for name, fn in fns.items():
        for what, first, second in PAIRS:
            x, y = run(fn, q, k, v, first), run(fn, q, k, v, second)
            lo, hi = max(first[0], second[0]), min(first[1], second[1])
            xs = x[:, :, lo - first[0]: hi - first[0]]
            ys = y[:, :, lo - second[0]: hi - second[0]]
            same = mx.all(xs == ys, axis=(0, 1, 3))
            mx.eval(same)
            n_same = int(same.sum().item())
            row = {"fn": name, "pair": what, "first": list(first), "second": list(second),
                   "shared_rows": hi - lo, "rows_equal": n_same,
                   "max_abs_diff": float(mx.abs(xs.astype(mx.float32) - ys.astype(mx.float32)).max().item())}
            print(json.dumps(row), flush=True)
            rows.append(row)
    lines = ["| op | pair | first | second | rows equal / shared | max abs diff |", "|---|---|---|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['fn']} | {r['pair']} | {r['first']} | {r['second']} | "
                     f"{r['rows_equal']} / {r['shared_rows']} | {r['max_abs_diff']:.3g} |")
    write_report(args.out, "sdpa_rows.md", "\n".join(lines) + "\n")
    write_json(args.out, "sdpa_rows.json", {"rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
