"""How close a decode token's weight reads come to the GPU's memory speed (NVIDIA only).

    python3 -m bench.diagnostics.tuning.bandwidth [--out DIR]

For each weight read a decode token makes (the merged projections of
``weight_reads.CALLS``, at the real Qwen3.6-35B-A3B shapes), the device time of one
call (CUPTI, through PyTorch's profiler: the kernel alone, without launching)
and the GB/s that makes of the weights' bytes, for:

* PyTorch's sum of a bf16 tensor of the same bytes: what a plain read reaches
  on this machine, in PyTorch's own device memory;
* MLX's elementwise copy of the words (read and write counted);
* MLX's ``quantized_matmul`` per projection (stock's sequence, its norm
  included);
* lily's ``quantized_matvec`` (one launch).

Each call reads its own copy of the weights, the calls rotating through
enough copies that the GPU's L2 cache (50 MB on the H200) holds none of them
when they are read again, as in decode, where every layer's weights are new.
Needs PyTorch with CUDA; without it, says so and exits 2.
"""

from __future__ import annotations

import argparse
from typing import Dict

import mlx.core as mx

from bench.common import write_report
from bench.diagnostics.decode.decode_profile import kernel_times
from bench.diagnostics.tuning.weight_reads import (
    CALLS,
    ROTATION_BYTES,
    ROUNDS,
    device_us,
    per_call_us,
    rotation,
    torch_cuda_missing,
    weight_bytes,
)
from mlx_lily.kernels.linear.gemv import quantized_matvec_kernel, quantized_matvec_reference
from mlx_lily.kernels.linear.testing import gemv_call

def _torch_read_us(nbytes: int, copies: int) -> float:
    import torch

    tensors = [torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda") for _ in range(copies)]

    def run():
        for _ in range(ROUNDS):
            for t in tensors:
                t.sum()
        torch.cuda.synchronize()

    run()
    return per_call_us(kernel_times(run), ROUNDS * copies)


def measure(name: str, spec: tuple, backend: str) -> Dict[str, float]:
    K, rows, bits, prologue, residual = spec
    (x, weights), kwargs = gemv_call(K, rows, bits, prologue, residual, seed=K + sum(rows))
    nbytes = weight_bytes((x, weights))
    sets = rotation(weights)
    copies = len(sets)
    mx.eval(x, kwargs)
    words = [[w for w, _, _ in ws] for ws in sets]
    word_bytes = sum(w.nbytes for w in words[0])
    row = {"weight_bytes": nbytes, "copies": copies}
    row["torch_read_us"] = _torch_read_us(nbytes, copies)
    row["mlx_copy_us"] = device_us(lambda ws: [mx.bitwise_xor(w, 1) for w in ws], words)
    row["mlx_copy_gb_s"] = 2 * word_bytes / row["mlx_copy_us"] / 1e3
    row["stock_us"] = device_us(lambda ws: quantized_matvec_reference(x, ws, **kwargs), sets)
    row["lily_us"] = device_us(lambda ws: quantized_matvec_kernel.run_on(backend, x, ws, **kwargs), sets)
    for key in ("torch_read", "stock", "lily"):
        row[f"{key}_gb_s"] = nbytes / row[f"{key}_us"] / 1e3
    print(f"{name}: {nbytes / 2**20:.1f} MiB; torch read {row['torch_read_us']:.1f} us "
          f"({row['torch_read_gb_s']:.0f} GB/s), MLX copy {row['mlx_copy_gb_s']:.0f} GB/s, "
          f"stock {row['stock_us']:.1f} us ({row['stock_gb_s']:.0f} GB/s), lily {row['lily_us']:.1f} us "
          f"({row['lily_gb_s']:.0f} GB/s)", flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also write DIR/bandwidth.txt")
    args = p.parse_args(argv)
    why = torch_cuda_missing()
    if why:
        print(f"bandwidth needs PyTorch with CUDA ({why})")
        return 2
    from mlx_lily.toolchain.registry import gpu_backend

    backend = gpu_backend()
    lines = ["Device time of one call and GB/s of the weights' bytes (CUPTI; each call on its own copy "
             f"of the weights, rotating over at least {ROTATION_BYTES >> 20} MiB)", "",
             "| call | MiB | torch read GB/s | MLX copy GB/s | stock us | stock GB/s | lily us | lily GB/s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, spec in CALLS.items():
        r = measure(name, spec, backend)
        lines.append(f"| {name} | {r['weight_bytes'] / 2**20:.1f} | {r['torch_read_gb_s']:.0f} | "
                     f"{r['mlx_copy_gb_s']:.0f} | {r['stock_us']:.1f} | {r['stock_gb_s']:.0f} | "
                     f"{r['lily_us']:.1f} | {r['lily_gb_s']:.0f} |")
    write_report(args.out, "bandwidth.txt", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
