"""The host's share of a lily decode step, measured on any machine.

    python3 -m bench.diagnostics.decode.host_cost [--layers 40] [--steps 30] [--out DIR]

On an NVIDIA GPU through MLX, lily's decode is bound by the host: building a
step's graph (the model's Python and MLX's graph construction) and launching
its kernels take longer than the kernels run (bench/README.md). This
measures the first part without a GPU: every lily kernel op is made to take
its kernel path "on CUDA", but each kernel launch is replaced by a stub that
returns an output of the right shape and dtype (a zero-cost graph node), so
only the host's work remains. The model has the real model's layer stack
(40 layers, attention every 4th) at the demo shape's widths: the host's work
per layer does not depend on the widths.

Rows: the step on lily's default path (the whole stack as one compiled
call), then the same step with one part of the host's work taken away (its
result held fixed), so the difference is that part's cost: the weights check
(one pass over every weight's identity); then the step in compiled segments
(the path the whole step replaced, and the server's), and those segments
without the attention steps between them (the KV cache write, the attention
op's choice, its launches); last, the step on the server's caches for one
request (``mlx_lm.server``'s: the batched step). Then the step's launches by
kernel, with their inputs (``launch_inputs``). The numbers are this
machine's CPU; a faster host scales them down, not their proportions.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
from typing import Any, Dict, Iterator, List, Optional, Tuple

import mlx.core as mx

from bench.common import write_report


# While a list: each stubbed launch appends (kernel name, its input count).
_launches: Optional[List[Tuple[str, int]]] = None


@contextlib.contextmanager
def stubbed_kernels() -> Iterator[None]:
    """Every kernel op takes its kernel path as on CUDA; every launch returns
    outputs of the right shapes without running anything."""
    from mlx_lily.toolchain import kernel, registry

    def fake_build(self, backend, absent=()):
        def launch(inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value=None, **kw):
            if _launches is not None:
                _launches.append((self.name, len(inputs)))
            # One cheap node that depends on an input, like a launch does.
            seed = inputs[0].reshape(-1)[:1].astype(mx.float32) * 0
            return [mx.broadcast_to(seed, s).astype(d) for s, d in zip(output_shapes, output_dtypes)]
        return launch

    def ready(self, backend):
        return True, "stub"

    def unchecked(self, backend, *args, **kwargs):
        return self.run_on(backend, *args, **kwargs), None

    with contextlib.ExitStack() as stack:
        stack.enter_context(held(registry, "gpu_backend", lambda: "cuda"))
        stack.enter_context(held(kernel.Kernel, "_build", fake_build))
        classes = {type(op.kernel) for op in registry.OPS.values() if op.kernel is not None} | {kernel.Kernel}
        for cls in classes:
            for name in ("ready_on", "chunked_ready_on"):
                if hasattr(cls, name):
                    stack.enter_context(held(cls, name, ready))
            if hasattr(cls, "run_checked"):
                stack.enter_context(held(cls, "run_checked", unchecked))
        yield


@contextlib.contextmanager
def held(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name`` set to ``value`` for the block, then as it was (an
    attribute the owner only inherited is removed again)."""
    missing = object()
    before = owner.__dict__.get(name, missing)
    setattr(owner, name, value)
    try:
        yield
    finally:
        if before is missing:
            delattr(owner, name)
        else:
            setattr(owner, name, before)


SERVER_ROW = "on the server's caches, one row"


def server_cache(model: Any) -> list:
    """The caches ``mlx_lm.server``'s generator holds for one request: a
    left-padded ArraysCache per DeltaNet layer, a BatchKVCache per attention
    layer (no padding), which the batched step takes."""
    from mlx_lm.models.cache import ArraysCache, BatchKVCache

    text = model.language_model.model
    return [ArraysCache(size=2, left_padding=[0]) if layer.is_linear else BatchKVCache([0])
            for layer in text.layers]


def launch_inputs(model: Any, cache: Any) -> Dict[str, Tuple[int, int]]:
    """{kernel: (launches, inputs)} of one decode step, under
    ``stubbed_kernels``: the step made op by op (a compiled step's launches
    run only while it is traced), the same launches with the same inputs.
    MLX's host work per launch grows with its inputs (``launch_cost
    --inputs``)."""
    global _launches
    from mlx_lily.layers.decoder import COMPILE_ENV

    before = os.environ.get(COMPILE_ENV)
    os.environ[COMPILE_ENV] = "0"
    _launches = []
    try:
        host_ms(model, cache, 1)
        seen = _launches
    finally:
        _launches = None
        if before is None:
            os.environ.pop(COMPILE_ENV)
        else:
            os.environ[COMPILE_ENV] = before
    out: Dict[str, Tuple[int, int]] = {}
    for name, n in seen:
        calls, inputs = out.get(name, (0, 0))
        out[name] = (calls + 1, inputs + n)
    return out


def host_ms(model: Any, cache: Any, steps: int) -> float:
    """Median milliseconds to build one decode step's graph (each step
    evaluated, untimed, before the next)."""
    token = mx.array([[3]])
    times: List[float] = []
    for _ in range(steps):
        start = time.perf_counter()
        out = model(token, cache=cache)
        times.append(time.perf_counter() - start)
        mx.eval(out, [c.state for c in cache])
    return 1e3 * statistics.median(times)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--steps", type=int, default=20, help="decode steps per measurement (default 20)")
    p.add_argument("--rounds", type=int, default=7,
                   help="rounds; each measures every variant once, in turn, and the median "
                        "over rounds is reported (default 7)")
    p.add_argument("--out", help="also write DIR/host_cost.txt")
    args = p.parse_args(argv)

    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lily import call_trace as paths
    from mlx_lily.random_checkpoints import SHAPES, build_model
    from mlx_lily.layers import text_model
    from mlx_lily.models.qwen3_5_moe import Model

    shape = dict(SHAPES["demo"], num_hidden_layers=args.layers)
    model, _ = build_model(shape, seed=0, model_class=Model)
    text = model.language_model.model

    class NoAttention:
        def __getattr__(self, name):
            return getattr(text_model.K, name)

        @staticmethod
        def attention(queries, keys, values, scale, mask, **kwargs):
            return queries

    @contextlib.contextmanager
    def as_is():
        yield

    @contextlib.contextmanager
    def keys_held():
        version = text._weights_version()
        with held(text_model.LilyTextModel, "_weights_version", lambda self: version):
            yield

    @contextlib.contextmanager
    def segments():
        text.__dict__["_lily_whole_ok"] = False
        try:
            yield
        finally:
            text.__dict__.pop("_lily_whole_ok")

    @contextlib.contextmanager
    def segments_without_attention():
        real = text_model.K
        text_model.K = NoAttention()
        try:
            with segments():
                yield
        finally:
            text_model.K = real

    variants = {"whole step": as_is, "without the weights checks": keys_held,
                "in segments": segments, "in segments, without the attention ops": segments_without_attention,
                SERVER_ROW: as_is}
    times = {name: [] for name in variants}
    with stubbed_kernels():
        prompt = mx.array([list(range(1, 65))])
        cache = make_prompt_cache(model)
        mx.eval(model(prompt, cache=cache))
        server = server_cache(model)
        mx.eval(model(prompt, cache=server))
        host_ms(model, cache, 3)  # compiles the whole step
        host_ms(model, server, 3)  # the batched step
        with segments():
            host_ms(model, cache, 3)  # and the segments
        paths.start()
        host_ms(model, cache, 1)
        taken = ", ".join(sorted({r["path"] for r in paths.seen()}))
        paths.stop()
        paths.start()
        host_ms(model, server, 1)
        taken_server = ", ".join(sorted({r["path"] for r in paths.seen()}))
        paths.stop()
        inputs = launch_inputs(model, cache)
        for _ in range(args.rounds):
            for name, variant in variants.items():
                with variant():
                    times[name].append(host_ms(model, server if name == SERVER_ROW else cache, args.steps))
    median = {name: statistics.median(ts) for name, ts in times.items()}
    whole = median["whole step"]
    lines = [f"Host ms to build one decode step ({args.layers} layers, demo widths, kernels stubbed "
             f"as on CUDA; path: {taken}; on the server's caches: {taken_server}; median over "
             f"{args.rounds} rounds of {args.steps} steps, variants interleaved)", "",
             "| step | host ms | part's cost | spread over rounds |", "|---|---:|---:|---:|"]
    base = {"in segments, without the attention ops": median["in segments"]}
    for name, ms in median.items():
        if name == "whole step":
            part = ""
        elif name == "in segments":
            part = f"the whole step saves {ms - whole:.2f}"
        elif name == SERVER_ROW:
            part = f"{ms - whole:+.2f} against the whole step"
        else:
            part = f"{base.get(name, whole) - ms:.2f}"
        spread = (max(times[name]) - min(times[name])) / ms
        lines.append(f"| {name} | {ms:.2f} | {part} | {spread:.0%} |")
    calls = sum(c for c, _ in inputs.values())
    lines += ["", f"One step's launches and their inputs (MLX's host work per launch grows with its "
                  f"inputs): {calls} launches, {sum(n for _, n in inputs.values())} inputs", "",
              "| kernel | launches | inputs a launch |", "|---|---:|---:|"]
    for name, (c, n) in sorted(inputs.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"| {name} | {c} | {n / c:.1f} |")
    write_report(args.out, "host_cost.txt", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
