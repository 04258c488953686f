"""What gemv_sweep and bandwidth share: the weight reads of one decode token
(the merged projections ``quantized_matvec`` runs, at the real
Qwen3.6-35B-A3B shapes) and how to time one read on the device alone, each
call on its own copy of the weights, rotating past the GPU's L2 cache
(NVIDIA, PyTorch's profiler)."""

from __future__ import annotations

from typing import Callable, Dict, List

import mlx.core as mx

from bench.diagnostics.decode.decode_profile import kernel_times

# name -> (K, rows per segment, bits per segment, prologue, residual): what one
# decode token of the real model runs (per layer, or once for lm_head).
CALLS = {
    "deltanet in (qkv, z, b, a)": (2048, (8192, 4096, 32, 32), (4, 4, 4, 4), "norm", False),
    "attention in (q+gate, k, v)": (2048, (8192, 512, 512), (4, 4, 4), "norm", False),
    "router + shared gate": (2048, (256, 1), (8, 8), "norm", False),
    # Also attention's output projection: the attention op applies the output
    # gate, so o_proj is this call (no prologue) since 35c64a4.
    "deltanet out + residual": (4096, (2048,), (4,), "none", True),
    "lm_head": (2048, (248320,), (4,), "none", False),
}

# Bytes the rotation spans: four times the H200's L2.
ROTATION_BYTES = 200 * 2**20
ROUNDS = 5


def weight_bytes(args) -> int:
    _, weights = args
    return sum(w.nbytes + s.nbytes + b.nbytes for w, s, b in weights)


def per_call_us(kernels: Dict[str, List[float]], calls: int) -> float:
    """Device µs per call: every kernel the calls launched, summed."""
    total = sum(sum(times) for times in kernels.values())
    if total <= 0:
        raise RuntimeError("the profiler recorded no GPU kernels (device times need CUDA and CUPTI)")
    return total / calls


def device_us(fn: Callable, inputs: list) -> float:
    """Device µs of one call of fn, each call on the next input of the
    rotation and evaluated on its own (kernels of independent calls in one
    graph may run at once, and their times would overlap)."""
    for a in inputs:  # compiled, and each copy read once before timing
        mx.eval(fn(a))

    def run():
        for _ in range(ROUNDS):
            for a in inputs:
                mx.eval(fn(a))

    return per_call_us(kernel_times(run), ROUNDS * len(inputs))


def rotation(weights: tuple) -> list:
    """Copies of the weights (a tuple of (w, scales, biases)), enough that
    together they span ROTATION_BYTES; evaluated."""
    nbytes = sum(a.nbytes for triple in weights for a in triple)
    sets = [weights] + [tuple(tuple(a * 1 for a in triple) for triple in weights)
                        for _ in range(max(2, -(-ROTATION_BYTES // nbytes)) - 1)]
    mx.eval(sets)
    return sets


def torch_cuda_missing() -> str:
    """Why PyTorch's profiler cannot time kernels here ('' when it can)."""
    try:
        import torch
    except ImportError as exc:
        return str(exc)
    return "" if torch.cuda.is_available() else "torch.cuda is not available"


def sweep_backend(backend: str, device_time: bool) -> str:
    """The backend a tuning sweep runs on (``backend``, a test's 'emulator',
    or the GPU's), or SystemExit saying what is missing: a GPU, or for
    ``device_time`` PyTorch with CUDA."""
    from mlx_lily.toolchain.registry import gpu_backend

    backend = backend or gpu_backend()
    if backend is None:
        raise SystemExit("needs a GPU (Metal or CUDA)")
    if device_time:
        why = torch_cuda_missing()
        if why:
            raise SystemExit(f"--device-time needs PyTorch with CUDA ({why})")
    return backend
