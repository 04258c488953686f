"""MoE prefill kernels, stage by stage, at the real shapes (a GPU run).

    python3 -m bench.diagnostics.prefill.moe_prefill --out DIR

Times, per token count (256, 1K, 2K: tiles of 16, 32, 64 rows) and load
(uniform random routing, and skewed: a quarter of the slots on 8 experts):
routing, gate+up+SwiGLU, down, the whole kernel path and stock's SwitchGLU,
plus the combine kernel against stock's combine. Prints a table and writes
``moe_prefill.json`` to DIR. Each stage is timed with its inputs evaluated
beforehand (median of bench.ops.time_call's calls).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import mlx.core as mx

from bench.common import machine_info, software_info, write_report
from bench.ops import time_call
from mlx_lily.kernels.moe.combine import moe_combine_kernel, moe_combine_reference
from mlx_lily.kernels.moe.experts import (
    moe_down_kernel,
    moe_gate_up_kernel,
    quantized_experts,
    relative_error,
    run_moe_experts,
)
from mlx_lily.kernels.moe.routing import moe_routing_kernel, tile_rows_for
from mlx_lily.toolchain.registry import gpu_backend

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 512, 256, 8


def routed(tokens: int, skewed: bool, seed: int) -> mx.array:
    logits = mx.random.normal((1, tokens, EXPERTS), key=mx.random.key(seed))
    if skewed:
        logits[..., :8] += 3.0
    return mx.argpartition(logits, kth=-TOP_K, axis=-1)[..., -TOP_K:].astype(mx.uint32)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/out")
    args = parser.parse_args()
    backend = gpu_backend()
    if backend is None:
        raise SystemExit("needs a GPU (Metal or CUDA)")
    glu = quantized_experts(HIDDEN, INTER, EXPERTS, seed=21)
    rows = []
    for tokens in (256, 1024, 2048):
        for skewed in (False, True):
            x = mx.random.normal((1, tokens, HIDDEN), key=mx.random.key(tokens)).astype(mx.bfloat16)
            inds = routed(tokens, skewed, tokens + 1)
            ids = inds.reshape(tokens, TOP_K)
            tile_m = tile_rows_for(tokens * TOP_K, EXPERTS)
            order, _, tiles = moe_routing_kernel.run_on(backend, ids, EXPERTS, tile_m)
            h = moe_gate_up_kernel.run_on(backend, x.reshape(tokens, HIDDEN), order, tiles,
                                          glu.gate_proj, glu.up_proj, tile_m, TOP_K)
            mx.eval(x, inds, order, tiles, h)
            stages = {
                "routing": (lambda: moe_routing_kernel.run_on(backend, ids, EXPERTS, tile_m)),
                "gate_up": (lambda: moe_gate_up_kernel.run_on(
                    backend, x.reshape(tokens, HIDDEN), order, tiles, glu.gate_proj, glu.up_proj, tile_m, TOP_K)),
                "down": (lambda: moe_down_kernel.run_on(
                    backend, h, order, tiles, glu.down_proj, None, tile_m, TOP_K)),
                "kernel_path": (lambda: run_moe_experts(backend, x, inds, glu)),
                "stock": (lambda: glu(x, inds)),
            }
            row = {"tokens": tokens, "load": "skewed" if skewed else "uniform", "tile_m": tile_m,
                   "real_tiles": int((tiles[:, 0] < EXPERTS).sum().item()), "grid_tiles": tiles.shape[0]}
            for name, fn in stages.items():
                row[f"{name}_ms"] = time_call(fn, (), {})["ms"]
            row["rel_err_vs_stock"] = relative_error(run_moe_experts(backend, x, inds, glu), glu(x, inds))
            flops = 2 * tokens * TOP_K * (2 * HIDDEN * INTER + INTER * HIDDEN)
            row["kernel_tflops"] = flops / row["kernel_path_ms"] / 1e9
            rows.append(row)
            print(json.dumps(row), flush=True)
    keys = mx.random.split(mx.random.key(5), 4)
    y = mx.random.normal((1, 2048, TOP_K, HIDDEN), key=keys[0]).astype(mx.bfloat16)
    s = mx.softmax(mx.random.normal((1, 2048, TOP_K), key=keys[1]), axis=-1).astype(mx.bfloat16)
    sh = mx.random.normal((1, 2048, HIDDEN), key=keys[2]).astype(mx.bfloat16)
    g = mx.random.normal((1, 2048, 1), key=keys[3]).astype(mx.bfloat16)
    mx.eval(y, s, sh, g)
    combine = {"combine_kernel_ms": time_call(lambda: moe_combine_kernel.run_on(backend, y, s, sh, g), (), {})["ms"],
               "combine_stock_ms": time_call(moe_combine_reference, (y, s, sh, g), {})["ms"]}
    print(json.dumps(combine), flush=True)
    doc = {"machine": machine_info(), "software": software_info(), "backend": backend,
           "experts": rows, "combine": combine}
    write_report(args.out, "moe_prefill.json", json.dumps(doc, indent=2), echo=False)
    print(f"wrote {Path(args.out) / 'moe_prefill.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
