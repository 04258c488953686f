"""Gated DeltaNet at Qwen3.6's shapes on the GPU: the chunked tile kernels
against the sequential kernel and stock, by call length, with their errors.

    python3 -m bench.diagnostics.prefill.gated_delta_chunked --out DIR

Writes DIR/gated_delta_chunked.json: per length T, the median milliseconds of
stock (the op's reference), the sequential kernel, the chunked kernels (and
each of their three passes), and max |chunked - float64| / max |float64| for
y and the state at T = 1000 (the float64 recurrence on the CPU). The length
from which the chunked kernels win is gated_delta.CHUNKED_FROM's measurement.
The sequential kernel is also timed with each number of state rows per SIMD
group the real shape takes (``sequential_ms_by_rows``):
gated_delta.SEQUENTIAL_ROWS is that measurement's choice.
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

from bench.common import REPO_ROOT, write_report

gd = importlib.import_module("mlx_lily.kernels.gated_delta.recurrence")
gdc = importlib.import_module("mlx_lily.kernels.gated_delta.chunked")
from mlx_lily.toolchain.registry import gpu_backend  # noqa: E402

HEADS = (16, 32, 128, 128)  # Hk, Hv, Dk, Dv of the real shapes, for the report
LENGTHS = [16, 32, 48, 64, 96, 128, 192, 256, 512, 1024, 2048, 4096]


def inputs(T):
    """The op's arguments at the real shapes, as `bench --ops` builds them."""
    from bench.ops import _gated_delta, dims_for

    args, _ = _gated_delta(dims_for("qwen3.6-35b-a3b"), T, T)
    mx.eval(args)
    return args


def median_ms(fn, *args, iters=20):
    mx.eval(fn(*args))
    mx.eval(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        mx.eval(fn(*args))
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[len(times) // 2]


def float64_errors(backend, T=1000):
    sys.path.insert(0, str(REPO_ROOT / "tests"))
    from test_gated_delta_kernel import ground_truth

    args = inputs(T)
    y, s = gdc.gated_delta_chunked_run(backend, *args)
    with mx.stream(mx.cpu):
        want_y, want_s = ground_truth(*args)

    def rel(got, want):
        got = np.array(got.astype(mx.float32)).astype(np.float64)
        return float(np.abs(got - want).max() / np.abs(want).max())

    seq_y, seq_s = gd.gated_delta_kernel.run_on(backend, *args)
    return {"T": T, "chunked_y": rel(y, want_y), "chunked_state": rel(s, want_s),
            "sequential_y": rel(seq_y, want_y), "sequential_state": rel(seq_s, want_s)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)))
    opts = parser.parse_args()
    backend = gpu_backend()
    if backend is None:
        raise SystemExit("no GPU: this measures the kernels on Metal or CUDA")
    ok, why = gd.gated_delta.kernel.chunked_ready_on(backend)
    print(f"chunked kernels: {why}", flush=True)
    rows = []
    for T in map(int, opts.lengths.split(",")):
        args = inputs(T)
        row = {"T": T,
               "stock_ms": median_ms(gd.gated_delta_reference, *args),
               "sequential_ms": median_ms(lambda *a: gd.gated_delta_kernel.run_on(backend, *a), *args)}
        row["sequential_ms_by_rows"] = {
            r: median_ms(lambda *a: gd.gated_delta_kernel.run_on(backend, *a, rows=r), *args)
            for r in gd.ROW_CHOICES if gd.rows_per_simdgroup(HEADS[2], HEADS[3], r) == r}
        if ok and gdc.chunked_supports(*args) is None:
            row["chunked_ms"] = median_ms(lambda *a: gdc.gated_delta_chunked_run(backend, *a), *args)
            qb, kb, vb = args[:3]
            prep = lambda: gdc.chunk_prepare_kernel.run_on(backend, qb, kb, vb, *args[3:7])  # noqa: E731
            w, u, kd, p, gcum = prep()
            row["prepare_ms"] = median_ms(prep)
            state = lambda: gdc.chunk_state_kernel.run_on(backend, w, u, kd, gcum, args[7])  # noqa: E731
            d, s0, _ = state()
            row["state_ms"] = median_ms(state)
            row["output_ms"] = median_ms(
                lambda: gdc.chunk_output_kernel.run_on(backend, qb, s0, d, p, gcum, qb.dtype))
        row["op_path"] = gd.gated_delta.kernel.path_for(backend, *args)
        print(json.dumps(row), flush=True)
        rows.append(row)
    errors = float64_errors(backend) if ok else None
    print(json.dumps({"float64_errors": errors}), flush=True)
    doc = {"tool": "mlx-lily bench diagnostics: gated_delta_chunked", "backend": backend,
           "machine": platform.platform(), "mlx": mx.__version__, "heads": HEADS,
           "chunk": gdc.CHUNK, "chunked_from": gd.CHUNKED_FROM, "chunked_check": why,
           "rows": rows, "float64_errors": errors}
    write_report(opts.out, "gated_delta_chunked.json", json.dumps(doc, indent=1), echo=False)
    print(f"wrote {Path(opts.out) / 'gated_delta_chunked.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
