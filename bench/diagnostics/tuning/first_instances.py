"""The CUDA kernel instances a first prompt and reply meet, recorded without a GPU.

    python3 -m bench.diagnostics.tuning.first_instances [--shape qwen3.6-35b-a3b] [--layers 4]
        [--prompt 128] [--decode 16] [--against CUDA_INSTANCES_JSON] [--write] [--out DIR]

Lily ships a record of those instances (``mlx_lily/toolchain/cuda_instances.json``)
so that a first process on an NVIDIA GPU compiles them in parallel from its
start instead of one at a time at their first launches. A kernel whose body
changes gets a new build name, and its entries go stale. This records them
again on any machine: every lily op takes its kernel path as on CUDA, each
launch is a stub that returns outputs of the right shapes
(``host_cost.stubbed_kernels``), and each launch's instance is noted as lily's
CUDA cache notes it. The model is the shape's with ``--layers`` layers (an
instance depends on the widths, not on how many layers repeat it; 4 holds
both layer kinds), a ``--prompt``-token prompt and ``--decode`` tokens through
mlx-lm's ``generate_step``, plus the first-use self-check samples of each
kernel met.

``--against`` takes an H200's own record (``MLX_LILY_CACHE/cuda-instances.json``
after runs at these shapes): an instance is kept only where that record holds
it but for its build name (a comment-only edit renames a build), so what is
shipped was met on a GPU. ``--write`` replaces the shipped record with its
entries that are still current plus the recorded ones. Writes
DIR/first-instances.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from pathlib import Path
from typing import Any, Dict, List, Optional

import mlx.core as mx

from bench.diagnostics.decode.host_cost import held, stubbed_kernels


def _key(entry: dict, with_build: bool = True) -> str:
    return json.dumps({k: v for k, v in entry.items() if with_build or k != "build"}, sort_keys=True)


def record(shape: str, layers: int, prompt: int, decode: int) -> List[dict]:
    """The instances (``cuda_cache.Instance`` JSON) a prompt and reply meet at
    ``shape`` with ``layers`` layers, then the self-check samples of each
    kernel met, in the order first met."""
    from bench.measure import generate, prompt_array
    from mlx_lily.models.qwen3_5_moe import Model
    from mlx_lily.random_checkpoints import SHAPES, build_model
    from mlx_lily.toolchain import cuda_cache, kernel

    config = dict(SHAPES[shape], num_hidden_layers=layers)
    model, _ = build_model(config, seed=0, model_class=Model)
    seen: Dict[str, dict] = {}

    def note(k: Any, launch: Any) -> None:
        entry = cuda_cache.Instance.of(k, launch).to_json()
        seen.setdefault(_key(entry), entry)

    run_launch = kernel.Kernel._run_launch

    def recording(self, backend, launch):
        note(self, launch)
        return run_launch(self, backend, launch)

    with contextlib.ExitStack() as stack:
        stack.enter_context(stubbed_kernels())
        stack.enter_context(held(kernel.Kernel, "_run_launch", recording))
        generate(model, prompt_array(prompt, config["vocab_size"]), decode)
        for name in sorted({e["kernel"] for e in seen.values()}):
            k = kernel.KERNELS[name]
            if not callable(getattr(k, "sample", None)):
                continue
            cases = k.sample()
            for args, kwargs in cases if isinstance(cases, list) else [cases]:
                note(k, k.launch(*args, **kwargs))
    mx.clear_cache()
    return list(seen.values())


def met_on_gpu(entries: List[dict], gpu_record: List[dict]) -> tuple:
    """(entries the GPU's record holds but for the build name, the others)."""
    held_there = {_key(e, with_build=False) for e in gpu_record if isinstance(e, dict)}
    kept = [e for e in entries if _key(e, with_build=False) in held_there]
    return kept, [e for e in entries if _key(e, with_build=False) not in held_there]


def shipped_with(entries: List[dict]) -> List[dict]:
    """The shipped record's entries whose builds are current, then ``entries``
    (each once)."""
    from mlx_lily.toolchain import cuda_cache
    from mlx_lily.toolchain.kernel import KERNELS

    def current(entry: dict) -> bool:
        instance = cuda_cache.Instance.from_json(entry)
        k = KERNELS.get(instance.kernel)
        return k is not None and k.backend_name("cuda", instance.absent) == instance.build

    out: Dict[str, dict] = {}
    for entry in [e for e in cuda_cache.read_instances(cuda_cache.SHIPPED_INSTANCES) if current(e)] + entries:
        out.setdefault(_key(entry), entry)
    return list(out.values())


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3.6-35b-a3b")
    p.add_argument("--layers", type=int, default=4, help="layers of the model (default 4: both kinds)")
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (default 128, as bench --cold-start)")
    p.add_argument("--decode", type=int, default=16, help="tokens decoded (default 16, as bench --cold-start)")
    p.add_argument("--against", help="an NVIDIA GPU's cuda-instances.json: keep only instances it holds")
    p.add_argument("--write", action="store_true", help="replace the shipped record (its current entries kept)")
    p.add_argument("--out", default="bench/out", help="folder for first-instances.json (default: bench/out)")
    args = p.parse_args(argv)

    import mlx_lily.kernels  # noqa: F401 - registers every kernel
    from mlx_lily.toolchain import cuda_cache

    entries = record(args.shape, args.layers, args.prompt, args.decode)
    left_out: List[dict] = []
    if args.against:
        try:
            gpu_record = json.loads(Path(args.against).read_text())
        except (OSError, ValueError) as exc:
            raise SystemExit(f"--against {args.against}: not a readable JSON record ({exc})")
        entries, left_out = met_on_gpu(entries, gpu_record if isinstance(gpu_record, list) else [])
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "first-instances.json").write_text(json.dumps(entries, indent=0) + "\n")
    print(f"{len(entries)} instances recorded at {args.shape}, {args.layers} layers", flush=True)
    for entry in left_out:
        print(f"  left out (not in {args.against}): {entry['kernel']} {dict(entry['template'])}")
    if args.write:
        shipped = shipped_with(entries)
        cuda_cache.SHIPPED_INSTANCES.write_text(json.dumps(shipped, indent=0) + "\n")
        print(f"wrote {cuda_cache.SHIPPED_INSTANCES}: {len(shipped)} instances")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
