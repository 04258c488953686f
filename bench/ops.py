"""``python -m bench --ops``: each lily op against its stock counterpart.

Every lily op carries a ``reference``: stock mlx-lm's computation for that
piece of the layer. Here both are timed on inputs at the model's real shapes
(a prefill chunk and a single decode token; attention also at several
contexts), so each kernel's own gain shows separately from the end-to-end
numbers. An op without a kernel on this machine (or whose kernel declines
these shapes) is reported as "reference only", with the reference timed.

The input builders below know each op's argument layout from
``mlx_lily/kernels``; an op registered later that bench does not know yet is
timed on its own ``sample()`` inputs, with a note.
"""

from __future__ import annotations

import argparse
import functools
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from bench.common import (
    Progress,
    length_label,
    log,
    machine_info,
    now_iso,
    op_paths,
    parse_lengths,
    software_info,
)

DEFAULT_CONTEXTS = "256,4K,32K"
# Timing loop: a few untimed calls, then at least MIN_ITERS timed calls and
# more until TARGET_S seconds have been spent (at most MAX_ITERS).
WARMUP_ITERS, MIN_ITERS, MAX_ITERS, TARGET_S = 2, 5, 50, 0.5
# In-graph timing (GPU backends only): GRAPH_CALLS calls built first and
# evaluated together, GRAPHS_TIMED times. One evaluation's launch and sync
# overhead (about 0.05 ms on CUDA) is then spread over the calls, as it is
# over a model's layers. Calls slower than IN_GRAPH_UP_TO_MS alone are not
# timed so (the overhead is noise there).
GRAPH_CALLS, GRAPHS_TIMED, IN_GRAPH_UP_TO_MS = 8, 9, 20.0

Inputs = Tuple[tuple, dict]


# ------------------------------------------------------------------ shapes


def dims_for(shape: str) -> Dict[str, Any]:
    """The op-level dimensions of a model shape (mlx_lily.random_checkpoints.SHAPES)."""
    from mlx_lily.random_checkpoints import SHAPES

    c = SHAPES[shape]
    rope = c["rope_parameters"]
    return {
        "hidden": c["hidden_size"],
        "hq": c["num_attention_heads"],
        "hkv": c["num_key_value_heads"],
        "head_dim": c["head_dim"],
        "rope_dims": int(c["head_dim"] * rope["partial_rotary_factor"]),
        "rope_theta": rope["rope_theta"],
        "hk": c["linear_num_key_heads"],
        "hv": c["linear_num_value_heads"],
        "dk": c["linear_key_head_dim"],
        "dv": c["linear_value_head_dim"],
        "conv_k": c["linear_conv_kernel_dim"],
        "experts": c["num_experts"],
        "top_k": c["num_experts_per_tok"],
        "expert_dim": c["moe_intermediate_size"],
        "eps": c.get("rms_norm_eps", 1e-6),
    }


def _normal(shape, seed: int, dtype=mx.bfloat16) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


# --------------------------------------------------------- input builders
# Each takes (dims, T tokens in this call, context = tokens in the cache after
# it) and returns (args, kwargs) in the op's own signature.


def _qk_norm_rope(d, T, ctx) -> Inputs:
    q = _normal((1, T, d["hq"], d["head_dim"]), 1)
    k = _normal((1, T, d["hkv"], d["head_dim"]), 2)
    w = mx.ones((d["head_dim"],), dtype=mx.bfloat16)
    rope = nn.RoPE(d["rope_dims"], base=d["rope_theta"])
    return (q, k, w, w, d["eps"], rope, ctx - T), {}


# mlx-lm's KVCache grows its buffers in steps of 256 rows and hands attention
# the filled rows, a strided view.
KV_CACHE_STEP = 256


def _attention(d, T, ctx) -> Inputs:
    D = d["head_dim"]
    q = _normal((1, d["hq"], T, D), 3)
    rows = (ctx // KV_CACHE_STEP + 1) * KV_CACHE_STEP  # a cache that just grew past ctx
    k = _normal((1, d["hkv"], rows, D), 4)[:, :, :ctx, :]
    v = _normal((1, d["hkv"], rows, D), 5)[:, :, :ctx, :]
    # mlx-lm passes "causal" for multi-token calls and no mask for one token.
    return (q, k, v, D**-0.5, "causal" if T > 1 else None), {}


def _conv_qk_norm(d, T, ctx) -> Inputs:
    conv_dim = 2 * d["hk"] * d["dk"] + d["hv"] * d["dv"]
    qkv = _normal((1, T, conv_dim), 6)
    state = _normal((1, d["conv_k"] - 1, conv_dim), 8)
    w = _normal((conv_dim, d["conv_k"], 1), 7)
    return (qkv, state, w, d["hk"], d["hv"], d["dk"], d["dv"]), {}


def _gated_delta(d, T, ctx) -> Inputs:
    from mlx_lm.models.gated_delta import normalize_qk

    q, k = normalize_qk(_normal((1, T, d["hk"], d["dk"]), 10), _normal((1, T, d["hk"], d["dk"]), 11),
                        inv_scale=d["dk"] ** -0.5, eps=1e-6)
    v = _normal((1, T, d["hv"], d["dv"]), 12)
    a = _normal((1, T, d["hv"]), 13)
    b = _normal((1, T, d["hv"]), 14)
    A_log = mx.log(mx.random.uniform(1, 16, (d["hv"],), key=mx.random.key(15)))
    dt_bias = mx.ones((d["hv"],), dtype=mx.bfloat16)
    state = 0.1 * _normal((1, d["hv"], d["dv"], d["dk"]), 16, mx.float32)
    return (q, k, v, a, b, A_log, dt_bias, state), {}


def _gated_rms_norm(d, T, ctx) -> Inputs:
    x = _normal((1, T, d["hv"], d["dv"]), 17)
    z = _normal((1, T, d["hv"], d["dv"]), 18)
    w = (1 + 0.1 * _normal((d["dv"],), 19, mx.float32)).astype(mx.bfloat16)
    return (x, z, w, d["eps"]), {}


def _router_topk(d, T, ctx) -> Inputs:
    return (_normal((1, T, d["experts"]), 20), d["top_k"], True), {}


_EXPERTS: Dict[Tuple, Any] = {}


def _experts_module(d) -> Any:
    """A 4-bit group-64 SwitchGLU at the model's expert shapes, built once."""
    from mlx_lm.models.switch_layers import SwitchGLU

    key = (d["hidden"], d["expert_dim"], d["experts"])
    if key not in _EXPERTS:
        mx.random.seed(21)
        experts = SwitchGLU(d["hidden"], d["expert_dim"], d["experts"])
        experts.set_dtype(mx.bfloat16)
        nn.quantize(experts, group_size=64, bits=4)
        mx.eval(experts.parameters())
        _EXPERTS[key] = experts
    return _EXPERTS[key]


def _route(d, T, seed) -> mx.array:
    """Top-k expert ids per token from random router logits (uniform load)."""
    logits = _normal((1, T, d["experts"]), seed, mx.float32)
    return mx.argpartition(logits, kth=-d["top_k"], axis=-1)[..., -d["top_k"]:].astype(mx.uint32)


def _moe_experts(d, T, ctx) -> Inputs:
    return (_normal((1, T, d["hidden"]), 22), _route(d, T, 23), _experts_module(d)), {}


def _moe_combine(d, T, ctx) -> Inputs:
    y = _normal((1, T, d["top_k"], d["hidden"]), 24)
    scores = mx.softmax(_normal((1, T, d["top_k"]), 25, mx.float32), axis=-1).astype(mx.bfloat16)
    shared = _normal((1, T, d["hidden"]), 26)
    gate = _normal((1, T, 1), 27)
    return (y, scores, shared, gate), {}


# The tile layer's proof: one square bf16 GEMM of this size, in TFLOP/s beside
# mx.matmul's (the op is not in the model, so it has no decode phase). Small
# shapes take 8x their hidden size: a CPU's bf16 matmul at 4096 takes ~50 s.
GEMM_SIZE = 4096


def _matmul_nt(d, T, ctx) -> Inputs:
    n = min(GEMM_SIZE, 8 * d["hidden"])
    return (_normal((n, n), 28), _normal((n, n), 29)), {}


def _gemm_flops(args: tuple) -> float:
    x, w = args
    return 2.0 * x.shape[0] * x.shape[1] * w.shape[0]


# Ops timed in the prefill phase only, and those whose rows carry TFLOP/s.
PREFILL_ONLY = {"matmul_nt"}
FLOPS: Dict[str, Callable[[tuple], float]] = {"matmul_nt": _gemm_flops}

# name -> (builder, depends on the context length?)
BUILDERS: Dict[str, Tuple[Callable[..., Inputs], bool]] = {
    "qk_norm_rope": (_qk_norm_rope, True),
    "attention": (_attention, True),
    "conv_qk_norm": (_conv_qk_norm, False),
    "gated_delta": (_gated_delta, False),
    "gated_rms_norm": (_gated_rms_norm, False),
    "router_topk": (_router_topk, False),
    "moe_experts": (_moe_experts, False),
    "moe_combine": (_moe_combine, False),
    "matmul_nt": (_matmul_nt, False),
}


def cases(chunk: int, contexts: List[int]) -> List[Tuple[str, str, int, Optional[int]]]:
    """(op, phase, tokens, context) for every known op. Context-free ops run
    once per phase; their context is recorded as None."""
    from mlx_lily.kernels import OPS

    out = []
    for name in OPS:
        if name not in BUILDERS:
            out.append((name, "sample", 0, None))
            continue
        _, by_context = BUILDERS[name]
        for phase in ("prefill",) if name in PREFILL_ONLY else ("prefill", "decode"):
            if by_context:
                for ctx in contexts:
                    T = min(chunk, ctx) if phase == "prefill" else 1
                    out.append((name, phase, T, ctx))
            else:
                out.append((name, phase, chunk if phase == "prefill" else 1, None))
    return out


# ------------------------------------------------------------------ timing


def time_call(fn: Callable, args: tuple, kwargs: dict) -> Dict[str, float]:
    """Median milliseconds of fn(*args) with its result evaluated."""
    start = time.perf_counter()
    mx.eval(fn(*args, **kwargs))
    # A call slower than a second (a reference on a CPU at real shapes) gets
    # one warmup and three timed calls: enough for a median, not minutes more.
    slow = time.perf_counter() - start > 1.0
    for _ in range(0 if slow else WARMUP_ITERS - 1):
        mx.eval(fn(*args, **kwargs))
    min_iters = 3 if slow else MIN_ITERS
    times: List[float] = []
    spent = 0.0
    while len(times) < min_iters or (spent < TARGET_S and len(times) < MAX_ITERS):
        start = time.perf_counter()
        mx.eval(fn(*args, **kwargs))
        times.append(time.perf_counter() - start)
        spent += times[-1]
    times.sort()
    return {"ms": 1000 * times[len(times) // 2], "min_ms": 1000 * times[0], "iters": len(times)}


def time_in_graph(fn: Callable, args: tuple, kwargs: dict, calls: int = GRAPH_CALLS,
                  graphs: int = GRAPHS_TIMED) -> float:
    """Median milliseconds per call of ``calls`` calls built first and then
    evaluated together (building a graph is host work, not timed)."""
    many = lambda: [fn(*args, **kwargs) for _ in range(calls)]  # noqa: E731
    mx.eval(many())
    times = []
    for _ in range(graphs):
        outs = many()
        start = time.perf_counter()
        mx.eval(outs)
        times.append(time.perf_counter() - start)
        del outs
    return 1e3 * sorted(times)[len(times) // 2] / calls


def _in_graph(row: Dict[str, Any], key: str, fn: Callable, args: tuple, kwargs: dict, alone_ms: float) -> None:
    """row[key]: fn's in-graph milliseconds, where that timing applies."""
    from mlx_lily.toolchain.registry import gpu_backend

    if gpu_backend() is not None and alone_ms <= IN_GRAPH_UP_TO_MS:
        row[key] = time_in_graph(fn, args, kwargs)


def _declined_kernel_path(op, args, kwargs) -> Optional[Tuple[str, str]]:
    """(backend, kernel path) when the op's kernel takes this call but the op
    prefers its reference on this backend (``LilyOp.prefers_reference``)."""
    from mlx_lily.toolchain.registry import kernel_backend

    backend, _ = kernel_backend()
    if backend is None or op.kernel is None or op.prefers_reference is None:
        return None
    if op.supports is not None and op.supports(*args, **kwargs) is not None:
        return None
    if op.prefers_reference(backend, *args, **kwargs) is None or not op.kernel.ready_on(backend)[0]:
        return None
    path_for = getattr(op.kernel, "path_for", None)
    return backend, (path_for(backend, *args, **kwargs) if path_for is not None else "its")


def run_case(name: str, phase: str, T: int, ctx: Optional[int], dims: Dict[str, Any]) -> Dict[str, Any]:
    from mlx_lily.kernels import OPS

    op = OPS[name]
    row: Dict[str, Any] = {"op": name, "phase": phase, "tokens": T, "context": ctx}
    if name in BUILDERS:
        args, kwargs = BUILDERS[name][0](dims, T, ctx or T)
    elif op.sample is not None:
        args, kwargs = op.sample()
        row["note"] = "bench has no real-shape inputs for this op yet: timed on its sample() inputs"
        row["tokens"] = "-"
    else:
        return row | {"error": "no inputs: bench has no builder and the op has no sample()"}
    mx.eval([a for a in list(args) + list(kwargs.values()) if isinstance(a, mx.array)])

    fn, path, reason = op.choose(*args, **kwargs)
    row.update(path=path, reason=reason)
    # An op with several kernels (gated_delta: sequential or chunked) names the one timed.
    path_for = getattr(op.kernel, "path_for", None)
    if path == "kernel" and path_for is not None:
        row["kernels"] = path_for(fn.args[0], *args, **kwargs)
    stock = time_call(op.reference, args, kwargs)
    row.update(stock_ms=stock["ms"], stock_min_ms=stock["min_ms"], stock_iters=stock["iters"])
    _in_graph(row, "stock_graph_ms", op.reference, args, kwargs, stock["ms"])
    if path == "kernel":
        lily = time_call(fn, args, kwargs)
        row.update(lily_ms=lily["ms"], lily_min_ms=lily["min_ms"], lily_iters=lily["iters"],
                   speedup=stock["ms"] / lily["ms"])
        _in_graph(row, "lily_graph_ms", fn, args, kwargs, lily["ms"])
    else:
        row.update(lily_ms=None, speedup=None)
        kernel_path = _declined_kernel_path(op, args, kwargs)
        if kernel_path is not None:
            # The op sends this call to its reference by choice, not because no
            # kernel can take it (attention prefill on CUDA): the kernel's own
            # time is what its issue tracks.
            backend, kernels = kernel_path
            declined = time_call(functools.partial(op.kernel.run_on, backend), args, kwargs)
            row.update(declined_kernel_ms=declined["ms"], kernels=kernels)
    if name in FLOPS:
        x, w = args
        row["tokens"] = "-"
        row["shape"] = f"bf16 [{x.shape[0]}, {x.shape[1]}] @ [{w.shape[0]}, {w.shape[1]}].T"
        flops = FLOPS[name](args)
        row["stock_tflops"] = flops / stock["ms"] / 1e9
        if row.get("lily_ms"):
            row["lily_tflops"] = flops / row["lily_ms"] / 1e9
    return row


def run_ops(args: argparse.Namespace) -> int:
    from bench import report

    if args.model:
        raise SystemExit("--ops builds inputs from a shape; use --shape, not --model")
    shape = args.shape or "qwen3.6-35b-a3b"
    contexts = parse_lengths(args.lengths or DEFAULT_CONTEXTS)
    dims = dims_for(shape)
    todo = cases(args.ops_chunk, contexts)
    started = now_iso()
    machine, software = machine_info(), software_info()
    progress = Progress([(ctx or T or 1) + 64 for _, _, T, ctx in todo])
    rows = []
    for i, (name, phase, T, ctx) in enumerate(todo):
        where = f"context {length_label(ctx)}" if ctx else f"{T} tokens"
        log(f"op {i + 1}/{len(todo)}: {name} {phase} {where} ({progress.status()})")
        try:
            row = run_case(name, phase, T, ctx, dims)
        except Exception as exc:  # noqa: BLE001 - one failing op must not stop the table
            log(f"  failed: {type(exc).__name__}: {exc}")
            row = {"op": name, "phase": phase, "tokens": T, "context": ctx,
                   "error": f"{type(exc).__name__}: {exc}"}
        rows.append(row)
        progress.finish((ctx or T or 1) + 64)
    doc = {
        "tool": "mlx-lily bench (ops)",
        "schema": 1,
        "started": started,
        "finished": now_iso(),
        "machine": machine,
        "software": software,
        "settings": {"shape": shape, "dims": dims, "chunk": args.ops_chunk, "contexts": contexts,
                     "timing": {"warmup_iters": WARMUP_ITERS, "min_iters": MIN_ITERS,
                                "max_iters": MAX_ITERS, "target_s": TARGET_S, "statistic": "median",
                                "graph_calls": GRAPH_CALLS, "graphs_timed": GRAPHS_TIMED,
                                "in_graph_up_to_ms": IN_GRAPH_UP_TO_MS}},
        "op_paths": op_paths(),
        "rows": rows,
    }
    report.finish_ops(doc, Path(args.out))
    return 0


__all__ = ["run_ops", "cases", "dims_for", "BUILDERS"]
