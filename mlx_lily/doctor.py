"""``python -m mlx_lily doctor``: what lily will do on this machine, and whether it works.

Prints the platform, MLX's version and backend, mlx-lm's version, and for each
lily op the path it takes here (kernel or reference, and why). Then runs each
op on small inputs: where the op has a kernel, the kernel (on the GPU, or in
the CPU emulator when there is no GPU) against the reference, with the error
size; where it has none, the reference alone, to show it runs.
"""

from __future__ import annotations

import argparse
import platform
import shutil
from typing import List

import mlx.core as mx

from . import __version__
from .kernels import OPS, gpu_backend


def _flatten(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def max_error(got, want) -> float:
    """Largest absolute difference over all outputs, in fp32."""
    err = 0.0
    for g, w in zip(_flatten(got), _flatten(want)):
        if g.shape != w.shape:
            return float("inf")
        diff = mx.abs(g.astype(mx.float32) - w.astype(mx.float32)).max()
        err = max(err, diff.item())
    return err


def check_op(op, tolerance: float) -> tuple[str, str]:
    """(status, detail) for one op on its sample inputs."""
    args, kwargs = op.sample()
    want = op.reference(*args, **kwargs)
    mx.eval(want)
    if op.kernel is None:
        return "ok", "reference runs (no kernel to compare yet)"
    where = gpu_backend()
    if where is not None:
        ok, why = op.kernel.ready_on(where)
        if not ok:
            return "FALLBACK", f"kernel unusable, reference runs: {why}"
        got = op.kernel.run_on(where, *args, **kwargs)
    elif shutil.which("c++") or shutil.which("g++"):
        got, where = op.kernel.run_on("emulator", *args, **kwargs), "CPU emulator"
    else:
        return "skipped", "no GPU and no C++ compiler for the emulator"
    compare = getattr(op, "compare", None)
    if compare is not None:
        good, err = compare(got, want)
    else:
        err = max_error(got, want)
        good = err <= tolerance
    return ("pass" if good else "FAIL"), f"kernel on {where}, max error {err:.3g}"


def decode_path() -> str:
    """How one decode token of one sequence runs (README, "Decode")."""
    from .kernels.attention.sdpa import attention_kernels
    from .layers.decoder import COMPILE_ENV, compile_enabled
    from .toolchain.registry import kernel_backend

    fused = "one token of one sequence: each layer's fused step (its ops on their paths above)"
    if not compile_enabled():
        return f"{fused}; not compiled ({COMPILE_ENV}=0 or the CPU emulator)"
    backend = kernel_backend()[0]
    segments = f"{fused}; the layer stack in mx.compile-d segments"
    if backend is None:
        return f"{segments} (no kernels: the reference path)"
    if not attention_kernels.decode_on(backend):
        return f"{segments} (the decode kernels the whole step needs are off)"
    return (f"{fused}; the whole layer stack one mx.compile-d step (mlx_lm.generate's caches), "
            "compiled segments for the server's batch caches")


def prefill_pacing() -> str:
    """Whether prompt chunks are paced (README, "Prefill memory")."""
    from .layers.decoder import PACE_ENV, PACE_MIN_ROWS, pacing_enabled

    if pacing_enabled():
        return f"prompt calls of {PACE_MIN_ROWS} rows or more: at most two layers' work queued on the GPU"
    return f"not paced ({PACE_ENV}=0, or not a GPU: nothing piles up)"


def server_priming() -> str:
    """Whether mlx_lm.server primes lily's kernels at load (README, the server)."""
    import os

    from .warmup import PRIME_ENV, requested
    from .toolchain.registry import kernel_backend

    backend, why = kernel_backend()
    if backend is None:
        return f"nothing to prime: no kernels here ({why})"
    if requested("mlx_lm.server"):
        where = "in every program that loads through lily" if requested(None) else "under mlx_lm.server"
        return f"{backend} kernel instances built and checked at load, {where} ({PRIME_ENV}=0 skips)"
    return f"not primed ({PRIME_ENV}={os.environ.get(PRIME_ENV)}): each instance builds at its first use"


def kernel_sources() -> str:
    """How the GPU builds hand MLX their kernels' text (toolchain/sources.py)."""
    from .toolchain import sources
    from .toolchain.registry import kernel_backend

    backend, _ = kernel_backend()
    if backend == "cuda":
        if sources.cuda_includes_work():
            return f"compacted, by #include from {sources.cuda_sources_dir()} (MLX rebuilds and hashes less per launch)"
        return "compacted, inline (by #include is off or failed its probe; see the notice)"
    if backend == "metal":
        return "compacted, inline"
    return f"{backend or 'no kernels'}: full text"


def distributed(model: str | None = None, parallel: str = "tensor") -> List[str]:
    """The mx.distributed group this process is in, and (with ``model``,
    under ``mlx.launch``) the paths this rank's layers take after mlx-lm's
    sharded load (docs/distributed.md)."""
    group = mx.distributed.init()
    if group.size() == 1:
        return ["one process (no mx.distributed group; under mlx.launch, with --model, "
                "each rank reports its layers' paths)"]
    lines = [f"{group.size()} ranks, this is rank {group.rank()}"]
    if model:
        from mlx_lm.utils import sharded_load

        from .backend import using
        from .layers.sharded import rank_paths

        with using("lily"):
            loaded, _ = sharded_load(model, **{f"{parallel}_group": group})
        lines += rank_paths(loaded)
    return lines


def report_platform() -> None:
    import mlx_lm

    device = mx.default_device()
    backend = gpu_backend() or "cpu"
    print(f"mlx-lily   {__version__}")
    print(f"platform   {platform.platform()} ({platform.machine()}), Python {platform.python_version()}")
    print(f"mlx        {mx.__version__}, default device {device}, backend {backend}")
    print(f"mlx-lm     {mlx_lm.__version__}")


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlx_lily doctor", description=__doc__)
    parser.add_argument("--tolerance", type=float, default=3e-2,
                        help="largest absolute error a kernel may have vs its reference (bf16 sized)")
    parser.add_argument("--model", help="whether this checkpoint has an MTP head; under mlx.launch: load it "
                                         "sharded and report each rank's layer paths")
    parser.add_argument("--parallel", choices=["tensor", "pipeline"], default="tensor",
                        help="with --model: mlx-lm's tensor (shard) or pipeline split")
    args = parser.parse_args(argv)

    report_platform()
    width = max(len(name) for name in OPS)
    print("\nops (path on this machine):")
    for name, op in OPS.items():
        path, why = op.planned_path()
        print(f"  {name:{width}s} {path:9s} {why}")
    print(f"\ndecode       {decode_path()}")
    print(f"prefill      {prefill_pacing()}")
    print(f"server       {server_priming()}")
    print(f"sources      {kernel_sources()}")
    if args.model:
        from .mtp_cli import head_line

        print(f"{'mtp':12s} {head_line(args.model)}")
    for i, line in enumerate(distributed(args.model, args.parallel)):
        print(f"{'distributed' if i == 0 else '':12s} {line}")

    print("\nself-check (small inputs):")
    failures = 0
    for name, op in OPS.items():
        try:
            status, detail = check_op(op, args.tolerance)
        except Exception as e:  # report, never crash: doctor is for broken setups
            status, detail = "ERROR", f"{type(e).__name__}: {e}"
        failures += status in ("FAIL", "ERROR")
        print(f"  {name:{width}s} {status:8s} {detail}")
    print("\nall ops ok" if not failures else f"\n{failures} op(s) failed")
    return 1 if failures else 0
