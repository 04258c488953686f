"""Device time of decode steps: the sum of the GPU kernels' durations.

On NVIDIA, PyTorch's profiler (CUPTI) sees every kernel the process
launches, MLX's included, so the kernels of a few decode steps are recorded
and their durations summed (MLX runs a step's kernels on one stream, so the
sum is the GPU's busy time). Beside ``host_ms_per_decode_token`` it says
which side bounds decode: the GPU's kernels, or the host building and
launching them.

Elsewhere there is no device timer to read from Python (MLX exposes none for
Metal's command buffers), and ``gpu_ms_per_decode_token`` is None, with the
reason in ``gpu_time_note``.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx

STEPS = 8


def why_unavailable() -> Optional[str]:
    """None where kernels can be timed here, else why not."""
    if mx.default_device().type != mx.DeviceType.gpu:
        return "no GPU"
    if mx.metal.is_available():
        return "no device timer for Metal from Python"
    try:
        import torch
    except ImportError:
        return "PyTorch (for CUPTI) is not installed"
    if not torch.cuda.is_available():
        return "PyTorch has no CUDA here"
    return None


def kernel_times(run: Callable[[], None]) -> Dict[str, List[float]]:
    """{kernel name: [device µs of each call]} of every GPU kernel ``run``
    launches (and waits for), recorded by PyTorch's profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.zeros(1, device="cuda")  # CUDA context and CUPTI up before recording
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    kernels: Dict[str, List[float]] = defaultdict(list)
    for event in prof.events():
        if "CUDA" in str(getattr(event, "device_type", "")):
            kernels[event.name].append(event.time_range.elapsed_us())
    return kernels


def decode_gpu_ms(model: Any, cache: Any, token: int, steps: int = STEPS) -> Tuple[Optional[float], Optional[str]]:
    """(device ms per decode step, None) over ``steps`` greedy steps on
    ``cache`` (each evaluated before the next), or (None, why not). Advances
    ``cache`` by ``steps`` tokens."""
    why = why_unavailable()
    if why is not None:
        return None, why
    tok = mx.array([[token]])

    def run():
        nonlocal tok
        for _ in range(steps):
            logits = model(tok, cache=cache)
            tok = mx.argmax(logits[:, -1:], axis=-1)
            mx.eval(tok, [c.state for c in cache])

    try:
        kernels = kernel_times(run)
    except Exception as exc:  # noqa: BLE001 - the figure is extra; the arm's others stand
        return None, f"profiler failed: {type(exc).__name__}: {exc}"[:200]
    total_us = sum(sum(v) for v in kernels.values())
    if total_us <= 0:
        return None, "the profiler recorded no kernels"
    return total_us / steps / 1e3, None


def median_or_none(values: List[Optional[float]]) -> Optional[float]:
    found = [v for v in values if v is not None]
    return statistics.median(found) if found else None
