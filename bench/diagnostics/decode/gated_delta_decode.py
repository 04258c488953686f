"""The Gated DeltaNet decode step at Qwen3.6's shapes on the GPU: the one-kernel
step (gated_delta_decode) against the separate ops it replaces, with its error.

    python3 -m bench.diagnostics.decode.gated_delta_decode --out DIR

Writes DIR/gated_delta_decode.json: the median milliseconds of one decode step
(after the projections) through the fused kernel, through the separate ops
with their kernels (conv + SiLU, L2 norm, the sequential recurrence kernel,
the gated norm), and through the reference; and over STEPS consecutive steps, each path carrying
its own states, the fused kernel's largest relative error of out and state
against the reference (the op's contract: 3e-2, 2e-2).
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import time

import mlx.core as mx
import numpy as np

from bench.common import write_report

gdd = importlib.import_module("mlx_lily.kernels.gated_delta.decode")
gd = importlib.import_module("mlx_lily.kernels.gated_delta.recurrence")
from mlx_lily.toolchain.registry import gpu_backend  # noqa: E402
from mlx_lily.kernels.gated_delta.testing import gated_delta_decode_inputs

HEADS = (16, 32, 128, 128)  # Hk, Hv, Dk, Dv
CONV_K = 4
STEPS = 64
REPEATS = 200


def separate_ops(backend, qkv, z, a, b, conv_state, conv_weight, A_log, dt_bias, state, norm_weight, eps, Hk):
    """The layer's path before the fused kernel: the references, with the
    recurrence on its sequential kernel."""
    B, T, Hv, Dv = z.shape
    key_dim = (qkv.shape[-1] - Hv * Dv) // 2
    Dk = key_dim // Hk
    conv_input = mx.concatenate([conv_state, qkv], axis=1)
    next_conv = mx.contiguous(conv_input[:, -(CONV_K - 1):, :])
    conv_out = gdd.conv1d_silu_reference(conv_input, conv_weight)
    q, k, v = mx.split(conv_out, [key_dim, 2 * key_dim], axis=-1)
    q, k = gd.l2norm_qk_reference(q.reshape(B, T, Hk, Dk), k.reshape(B, T, Hk, Dk), Dk**-0.5)
    out, state = gd.gated_delta_kernel.run_on(backend, q, k, v.reshape(B, T, Hv, Dv), a, b, A_log, dt_bias, state)
    return gdd.gated_rms_norm_reference(out, z, norm_weight, eps), next_conv, state


def median_ms(fn, args, repeats) -> float:
    for _ in range(min(10, repeats)):
        mx.eval(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(fn(*args))
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--backend", default=None, help="default: the GPU's (emulator: a CPU smoke run)")
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--repeats", type=int, default=REPEATS)
    opts = parser.parse_args()
    backend = opts.backend or gpu_backend()
    if backend is None:
        raise SystemExit("no GPU: this diagnostic measures the GPU kernels")
    Hk, Hv, Dk, Dv = HEADS
    args, _ = gated_delta_decode_inputs(Hk, Hv, Dk, Dv, K=CONV_K, seed=0)
    mx.eval(args)
    fused = lambda *a: gdd.gated_delta_decode_kernel.run_on(backend, *a)  # noqa: E731
    split = lambda *a: separate_ops(backend, *a)  # noqa: E731
    result = {
        "device": str(mx.default_device()), "backend": backend, "platform": platform.platform(),
        "mlx": mx.__version__, "shape": {"Hk": Hk, "Hv": Hv, "Dk": Dk, "Dv": Dv, "conv_k": CONV_K},
        "ms_fused": median_ms(fused, args, opts.repeats),
        "ms_separate_ops": median_ms(split, args, opts.repeats),
        "ms_reference": median_ms(gdd.gated_delta_decode_reference, args, opts.repeats),
    }

    # Consecutive steps, each path from its own states.
    rng = np.random.default_rng(1)
    ref_args, ker_args = list(args), list(args)
    worst = {"out": 0.0, "state": 0.0}
    conv_equal = True
    for _ in range(opts.steps):
        fresh, _ = gated_delta_decode_inputs(Hk, Hv, Dk, Dv, K=CONV_K, rng=rng)
        ref_args[:4] = ker_args[:4] = fresh[:4]
        got = fused(*ker_args)
        want = gdd.gated_delta_decode_reference(*ref_args)
        mx.eval(got, want)
        worst["out"] = max(worst["out"], gd._relative_error(got[0], want[0]))
        worst["state"] = max(worst["state"], gd._relative_error(got[2], want[2]))
        conv_equal &= bool(mx.array_equal(got[1], want[1]).item())
        ker_args[4], ker_args[8] = got[1], got[2]
        ref_args[4], ref_args[8] = want[1], want[2]
    result.update(
        steps=opts.steps, max_rel_error_out=worst["out"], max_rel_error_state=worst["state"],
        conv_state_equal=conv_equal,
        within_contract=worst["out"] <= 3e-2 and worst["state"] <= 2e-2 and conv_equal,
    )
    write_report(opts.out, "gated_delta_decode.json", json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
