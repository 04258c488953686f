"""Registers, threadgroups an SM and waves of every decode launch, from nvcc, without a GPU.

    python3 -m bench.diagnostics.tuning.launch_occupancy [--shape qwen3.6-35b-a3b] [--layers 4]
        [--batch 1,2,16] [--out DIR]

A launch whose threadgroups hold many registers leaves an SM room for few of
them, and its grid then runs in several waves: each wave pays every
threadgroup's serial part again (a top-k before its loads, a norm). At 94
registers a thread the routed MoE launch held two 256-thread threadgroups an
SM where gate/up alone held four, and its 576 threadgroups at one row ran in
three waves (docs/kernel-notes.md). ``kernel_resources`` reads such figures on
an NVIDIA machine from what MLX compiled; this finds them on any machine with
nvcc: every lily op takes its kernel path as on CUDA with its launches stubbed
(``host_cost.stubbed_kernels``), one decode step runs at each ``--batch`` (B =
1 on ``mlx_lm.generate``'s caches, more rows on the server's batch caches), and
each distinct launch (kernel, template, grid, threadgroup) is compiled by nvcc
for sm_90a as MLX would build it. Per launch: threads, registers, static
shared memory, threadgroups an SM holds at once (and what bounds them), the
grid's threadgroups and its waves over the H200's 132 SMs. The model is the
shape's with ``--layers`` layers (4 holds both layer kinds). Needs nvcc on
PATH; without it, says so and exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx

from bench.common import write_json, write_report
from bench.diagnostics.decode.host_cost import held, stubbed_kernels

# The modules whose decode launches follow the GPU (down's and the routed
# launch's shapes by B, the row GEMV's split).
CUDA_CHOICES = ("mlx_lily.kernels.moe.decode", "mlx_lily.kernels.linear.gemv", "mlx_lily.kernels.attention.sdpa",
                "mlx_lily.kernels.moe.decode_router")
# An H100 / H200 SM (compute capability 9.0).
SM90 = {"sms": 132, "registers": 65536, "register_unit": 256, "threads": 2048, "shared": 233472,
        "shared_reserved": 1024, "threadgroups": 32}


def resident_per_sm(registers: int, threads: int, shared: int, sm: Dict[str, int] = SM90) -> Tuple[int, str]:
    """(threadgroups of ``threads`` threads one SM holds at once, what bounds
    it): registers are given a warp at a time in units of ``register_unit``,
    each threadgroup's shared memory takes ``shared_reserved`` bytes more."""
    warps = math.ceil(threads / 32)
    per_warp = math.ceil(registers * 32 / sm["register_unit"]) * sm["register_unit"]
    limits = {"threads": sm["threads"] // (warps * 32), "threadgroups": sm["threadgroups"]}
    if registers:
        limits["registers"] = sm["registers"] // (per_warp * warps)
    if shared:
        limits["shared memory"] = sm["shared"] // (shared + sm["shared_reserved"])
    bound = min(limits, key=limits.get)
    return limits[bound], bound


def nvcc_resources(unit: str, workdir: Path, name: str) -> Dict[str, int]:
    """Registers, static shared bytes and stack bytes nvcc (sm_90a) gives the
    one kernel of ``unit`` (a translation unit as MLX generates it; its MLX
    device header replaced by lily's ABI header, as lily's CUDA cache compiles)."""
    from mlx_lily.toolchain import cuda_cache

    source = workdir / f"{name}.cu"
    body = unit[len(cuda_cache.MLX_DEFAULT_HEADER):] if unit.startswith(cuda_cache.MLX_DEFAULT_HEADER) else unit
    source.write_text(cuda_cache.ABI_HEADER + body)
    run = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90a", "-cubin", "-Xptxas", "-v", str(source),
                          "-o", str(source.with_suffix(".cubin"))], capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"nvcc failed on {name}:\n{run.stderr[-3000:]}")
    found = {key: re.search(pattern, run.stderr) for key, pattern in (
        ("registers", r"Used (\d+) registers"), ("shared", r"(\d+) bytes smem"), ("stack", r"(\d+) bytes stack frame"))}
    return {key: int(m.group(1)) if m else 0 for key, m in found.items()}


def decode_launches(shape: str, layers: int, batches: List[int]) -> List[Tuple[int, Any, Any, tuple, tuple]]:
    """(B, kernel, cuda_cache.Instance, grid, threadgroup) of each distinct
    launch one decode step makes at each B, kernels stubbed as on CUDA."""
    from mlx_lm.models.cache import make_prompt_cache

    from bench.diagnostics.decode.decode_profile import batch_cache
    from mlx_lily.models.qwen3_5_moe import Model
    from mlx_lily.random_checkpoints import SHAPES, build_model
    from mlx_lily.toolchain import cuda_cache, kernel

    config = dict(SHAPES[shape], num_hidden_layers=layers)
    model, _ = build_model(config, seed=0, model_class=Model)
    seen: Dict[tuple, tuple] = {}
    noting: List[Optional[int]] = [None]
    run_launch = kernel.Kernel._run_launch

    def recording(self, backend, launch):
        if noting[0] is not None:
            instance = cuda_cache.Instance.of(self, launch)
            key = (noting[0], json.dumps(instance.to_json(), sort_keys=True), tuple(launch.grid),
                   tuple(launch.threadgroup))
            seen.setdefault(key, (noting[0], self, instance, tuple(launch.grid), tuple(launch.threadgroup)))
        return run_launch(self, backend, launch)

    prompt = [list(range(1, 9))]
    with contextlib.ExitStack() as stack:
        stack.enter_context(stubbed_kernels())
        stack.enter_context(held(kernel.Kernel, "_run_launch", recording))
        for module in CUDA_CHOICES:  # their launch choices by B as on CUDA (each imports gpu_backend by name)
            stack.enter_context(held(importlib.import_module(module), "gpu_backend", lambda: "cuda"))
        for rows in batches:
            if rows == 1:
                cache = make_prompt_cache(model)
                mx.eval(model(mx.array(prompt), cache=cache))
            else:
                cache = batch_cache(model, config["vocab_size"], len(prompt[0]), rows)
            noting[0] = rows
            mx.eval(model(mx.full((rows, 1), 3, dtype=mx.int32), cache=cache))
            noting[0] = None
    mx.clear_cache()
    return list(seen.values())


def occupancy_rows(launches, workdir: Path, sm: Dict[str, int] = SM90) -> List[dict]:
    rows = []
    for i, (batch, k, instance, grid, group) in enumerate(launches):
        unit = k.cuda_function(instance, k.mlx_texts("cuda", False, instance.absent))[1]
        used = nvcc_resources(unit, workdir, f"{k.name}_{i}")
        threads = group[0] * group[1] * group[2]
        per_sm, bound = resident_per_sm(used["registers"], threads, used["shared"], sm)
        groups = math.prod(math.ceil(g / t) for g, t in zip(grid, group))
        rows.append({"batch": batch, "kernel": k.name, "template": instance.to_json()["template"],
                     "threads": threads, **used, "threadgroups_per_sm": per_sm, "bound_by": bound,
                     "threadgroups": groups, "waves": groups / (per_sm * sm["sms"])})
    return rows


def render(rows: List[dict], shape: str, layers: int) -> str:
    lines = [f"# Decode launches at {shape} ({layers} layers): nvcc sm_90a, {SM90['sms']} SMs", "",
             "| B | kernel | threads | registers | shared bytes | threadgroups / SM (bound) | threadgroups | waves |",
             "|---:|---|---:|---:|---:|---|---:|---:|"]
    for r in sorted(rows, key=lambda r: (r["batch"], r["kernel"], -r["threadgroups"])):
        lines.append(f"| {r['batch']} | `{r['kernel']}` | {r['threads']} | {r['registers']} | {r['shared']} | "
                     f"{r['threadgroups_per_sm']} ({r['bound_by']}) | {r['threadgroups']} | {r['waves']:.2f} |")
    spilled = [r for r in rows if r["stack"]]
    if spilled:
        lines += ["", "Stack frames (local memory): " + ", ".join(f"{r['kernel']} at B = {r['batch']} "
                                                             f"({r['stack']} bytes)" for r in spilled)]
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3.6-35b-a3b")
    p.add_argument("--layers", type=int, default=4, help="layers of the model (default 4: both kinds)")
    p.add_argument("--batch", default="1,2,16", help="rows of the decode steps, comma-separated (1 to 16)")
    p.add_argument("--out", default=None, help="folder for launch-occupancy.md/.json (default: print only)")
    args = p.parse_args(argv)
    try:
        batches = sorted({int(b) for b in args.batch.split(",") if b.strip()})
    except ValueError:
        p.error(f"--batch {args.batch!r}: comma-separated row counts")
    if not batches or not all(1 <= b <= 16 for b in batches):
        p.error(f"--batch {args.batch!r}: row counts from 1 to 16")
    if shutil.which("nvcc") is None:
        print("launch_occupancy: needs nvcc on PATH")
        return 2
    import mlx_lily.kernels  # noqa: F401 - registers every kernel

    launches = decode_launches(args.shape, args.layers, batches)
    with tempfile.TemporaryDirectory() as work:
        rows = occupancy_rows(launches, Path(work))
    write_report(args.out, "launch-occupancy.md", render(rows, args.shape, args.layers))
    write_json(args.out, "launch-occupancy.json", {"shape": args.shape, "layers": args.layers, "sm": SM90,
                                                    "launches": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
