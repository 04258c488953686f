"""Which kernel instance did a first-use check turn off, and who was right?

    python3 -m bench.diagnostics.numerics.turned_off [--tokens 256] [--out DIR]

Runs the small-alt checkpoint (bf16, seed 1: the GPU determinism test's
model) through a prompt and a few decode steps on this GPU, and records
every kernel instance whose first-use check disagreed with its reference.
For the first such call of each kernel it evaluates the same call four ways:
the kernel on this GPU, the op's reference on this GPU, the reference on the
CPU, and the reference on the CPU in fp32 (every input widened: the oracle).
The table says how far each of the first three lies from the oracle
(largest difference over the largest oracle value, per output); with --out
the call's inputs and the results go to DIR/turned-off-<kernel>.npz, which a
test can replay on any machine. (A kernel whose self-check failed is off as
a whole, before any call: ``python -m mlx_lily doctor`` names those.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from bench.common import write_report  # noqa: E402
from mlx_lily.toolchain.contracts import on_cpu  # noqa: E402


def capture_turned_off(tokens: int, decode_steps: int) -> dict:
    """kernel name -> (its Kernel, args, kwargs, why) for the first call of
    each kernel that a first-use check turned off."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lily.random_checkpoints import build_model
    from mlx_lily.models.qwen3_5_moe import Model
    from mlx_lily.toolchain.kernel import Kernel

    captured: dict = {}
    off = Kernel._off

    def spy(self, backend, key, why, args, kwargs, want=None):
        captured.setdefault(self.name, (self, args, kwargs, why))
        return off(self, backend, key, why, args, kwargs, want)

    Kernel._off = spy
    try:
        model, _ = build_model("small-alt", seed=1, dtype=mx.bfloat16, model_class=Model)
        ids = mx.array([[(i * 2654435761) % 2**32 % 512 for i in range(tokens + decode_steps)]])
        cache = make_prompt_cache(model)
        mx.eval(model(ids[:, :tokens], cache=cache))
        for t in range(tokens, tokens + decode_steps):
            mx.eval(model(ids[:, t : t + 1], cache=cache))
    finally:
        Kernel._off = off
    return captured


def _outputs(result) -> list:
    return list(result) if isinstance(result, (list, tuple)) else [result]


def _wide(a):
    return a.astype(mx.float32) if isinstance(a, mx.array) and mx.issubdtype(a.dtype, mx.floating) else a


def judge(kernel, args, kwargs, backend: str) -> dict:
    """The call four ways (module docstring) -> name -> list of outputs."""
    runs = {
        "kernel": _outputs(kernel.run_on(backend, *args, **kwargs)),
        "reference on this GPU": _outputs(kernel.reference(*args, **kwargs)),
        "reference on the CPU": _outputs(on_cpu(kernel.reference, *args, **kwargs)),
        "fp32 oracle": _outputs(on_cpu(kernel.reference, *map(_wide, args),
                                       **{k: _wide(v) for k, v in kwargs.items()})),
    }
    mx.eval(runs)
    return runs


def distance(got, oracle) -> float:
    g = np.array(got.astype(mx.float32), dtype=np.float64)
    o = np.array(oracle.astype(mx.float32), dtype=np.float64)
    return float(np.abs(g - o).max() / max(np.abs(o).max(), 1e-30))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=256, help="prompt tokens (default 256)")
    p.add_argument("--decode-steps", type=int, default=6)
    p.add_argument("--out", help="folder for turned-off.txt and the captured calls")
    args = p.parse_args(argv)

    from mlx_lily.toolchain.registry import kernel_backend

    backend, why = kernel_backend()
    if backend in (None, "emulator"):
        print(f"no GPU kernels here ({why})")
        return 1
    captured = capture_turned_off(args.tokens, args.decode_steps)
    lines = [f"Kernel instances turned off by their first-use check ({backend}, small-alt, bf16)", ""]
    if not captured:
        lines.append("none")
    for name, (kernel, call_args, call_kwargs, why) in captured.items():
        runs = judge(kernel, call_args, call_kwargs, backend)
        oracle = runs.pop("fp32 oracle")
        lines += [f"{name}: {why}", ""]
        lines.append("| result | " + " | ".join(f"output {i}" for i in range(len(oracle))) + " |")
        lines.append("|---|" + "---:|" * len(oracle))
        for run, outs in runs.items():
            cells = " | ".join(f"{distance(o, w):.3g}" for o, w in zip(outs, oracle))
            lines.append(f"| {run} vs fp32 | {cells} |")
        lines.append("")
        if args.out:
            arrays = {f"arg{i}": np.array(a.astype(mx.float32)) for i, a in enumerate(call_args) if isinstance(a, mx.array)}
            arrays.update({f"arg{i}_dtype": np.array(str(a.dtype)) for i, a in enumerate(call_args) if isinstance(a, mx.array)})
            arrays.update({f"arg{i}_value": np.array(a) for i, a in enumerate(call_args)
                           if not isinstance(a, mx.array) and a is not None})
            for run, outs in runs.items():
                tag = run.split()[0] + ("_gpu" if "GPU" in run else "_cpu" if "CPU" in run else "")
                arrays.update({f"{tag}_{i}": np.array(o.astype(mx.float32)) for i, o in enumerate(outs)})
            Path(args.out).mkdir(parents=True, exist_ok=True)
            np.savez_compressed(Path(args.out) / f"turned-off-{name}.npz", **arrays)
    write_report(args.out, "turned-off.txt", "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
