"""Which MLX op is not deterministic on this GPU? One table, one command:

    python3 bench/diagnostics/numerics/determinism.py [--runs 5] [--out DIR]

Each candidate op of stock mlx-lm's forward runs RUNS times on identical
inputs (built once, evaluated, then reused; freed memory filled with NaN
between runs, so reads of unwritten memory show) on the default device, at the
shapes the model uses, in fp32 and bf16; a row says whether every run is
bit-identical to the first, and how far the worst one is. The last rows run
whole models (stock and lily, a small random checkpoint in fp32 and bf16,
and the real shapes' first layer) the same way. The table goes to stdout
and, with --out, to DIR/determinism.txt.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402

from bench.common import write_report  # noqa: E402


def _arrays(result):
    return list(result) if isinstance(result, (list, tuple)) else [result]


def fill_freed_memory() -> None:
    """Leave NaN in the buffers MLX's allocator hands out next (up to 64 MiB
    each), so that a kernel reading memory it never wrote differs run to run."""
    for shift in range(6, 25):
        junk = mx.full((1 << shift,), float("nan"), mx.float32)
        mx.eval(junk)
        del junk


def repeat(fn, runs: int):
    """(bit-identical, max |diff| over runs (inf where NaN differs), ms per run)."""
    first = _arrays(fn())
    mx.eval(first)
    same, worst = True, 0.0
    elapsed = 0.0
    for _ in range(runs - 1):
        fill_freed_memory()
        start = time.perf_counter()
        again = _arrays(fn())
        mx.eval(again)
        elapsed += time.perf_counter() - start
        for a, b in zip(first, again):
            if not mx.array_equal(a, b, equal_nan=True).item():
                same = False
                if mx.issubdtype(a.dtype, mx.inexact):
                    d = mx.abs(a.astype(mx.float32) - b.astype(mx.float32))
                    # NaN in one run only: a GPU's max may skip it, so say so.
                    d = math.inf if mx.any(mx.isnan(d)).item() else d.max().item()
                else:
                    d = float((a != b).sum().item())
                worst = max(worst, d)
    ms = 1e3 * elapsed / max(runs - 1, 1)
    return same, worst, ms


def op_cases(dtype, L: int = 256):
    """(name, fn) for each candidate op at the model's shapes (L tokens)."""
    k = iter(mx.random.split(mx.random.key(0), 64))
    normal = lambda *s: mx.random.normal(s, key=next(k)).astype(dtype)  # noqa: E731
    # 64 experts (not 256) keep the random fp32 draw of the experts small.
    D, E, TOPK, F = 2048, 64, 8, 512
    x = normal(1, L, D)
    w = normal(4096, D)

    def quantized(d_in: int, d_out: int) -> nn.QuantizedLinear:
        layer = nn.QuantizedLinear(d_in, d_out, bias=False, group_size=64, bits=4)
        layer.update({"scales": layer.scales.astype(dtype), "biases": layer.biases.astype(dtype)})
        return layer

    lin = quantized(D, 4096)
    narrow = quantized(64, 128)  # one quantization group per row, as 64-wide experts' down projections
    x64 = normal(1, L, 64)
    from mlx_lm.models.switch_layers import SwitchGLU

    experts = SwitchGLU(D, F, E)
    nn.quantize(experts, group_size=64, bits=4)
    experts.set_dtype(dtype)
    inds = mx.random.randint(0, E, (1, L, TOPK), key=next(k)).astype(mx.uint32)
    gates = normal(1, L, E)
    q, kk, v = normal(1, 16, L, 256), normal(1, 2, L, 256), normal(1, 2, L, 256)
    conv_x, conv_w = normal(1, L + 3, 8192), normal(8192, 4, 1)
    from mlx_lm.models.gated_delta import gated_delta_update, normalize_qk

    gq, gk = normalize_qk(normal(1, L, 16, 128), normal(1, L, 16, 128), inv_scale=128**-0.5, eps=1e-6)
    gv, ga, gb = normal(1, L, 32, 128), normal(1, L, 32), normal(1, L, 32)
    A_log, dt_bias = mx.zeros((32,)), mx.ones((32,))
    rope = nn.RoPE(64, base=1e7)
    mx.eval(x, w, lin.parameters(), narrow.parameters(), x64, experts.parameters(), inds, gates, q, kk, v, conv_x, conv_w, gq, gk, gv, ga, gb)
    return [
        ("matmul x @ W^T", lambda: x @ w.T),
        ("quantized_matmul (QuantizedLinear)", lambda: lin(x)),
        ("quantized_matmul, one group per row (K=64)", lambda: narrow(x64)),
        ("gather_qmm (SwitchGLU, sorted)", lambda: experts(x, inds)),
        ("gather_qmm (SwitchGLU, 1 token)", lambda: experts(x[:, :1], inds[:, :1])),
        ("softmax precise", lambda: mx.softmax(gates, axis=-1, precise=True)),
        ("argpartition top-8", lambda: mx.argpartition(gates, kth=-TOPK, axis=-1)),
        ("sum over last axis", lambda: x.sum(axis=-1)),
        ("sum over tokens (axis 1)", lambda: x.sum(axis=1)),
        ("rms_norm", lambda: mx.fast.rms_norm(x, mx.ones((D,), dtype), 1e-6)),
        ("rope", lambda: rope(q)),
        (f"sdpa causal (GQA 16/2, L={L})", lambda: mx.fast.scaled_dot_product_attention(q, kk, v, scale=1 / 16, mask="causal")),
        ("sdpa decode (1 query)", lambda: mx.fast.scaled_dot_product_attention(q[:, :, -1:], kk, v, scale=1 / 16)),
        ("conv1d depthwise", lambda: mx.conv1d(conv_x, conv_w, groups=8192)),
        ("gated_delta_update (stock)", lambda: gated_delta_update(gq, gk, gv, ga, gb, A_log, dt_bias)),
        ("logsumexp", lambda: mx.logsumexp(gates, axis=-1)),
    ]


def model_cases(dtype, real: bool):
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lily.random_checkpoints import build_model
    from mlx_lily.models.qwen3_5_moe import specialize

    cases = []
    model, _ = build_model("small-alt", seed=1, dtype=dtype)
    tokens = mx.array([[(i * 2654435761) % 2**32 % 1024 for i in range(300)]])

    def forward(model):
        def run():
            cache = make_prompt_cache(model)
            return model(tokens, cache=cache)
        return run

    for engine in ("stock", "lily"):
        def run(engine=engine):
            specialize(model, lily=engine == "lily")
            return forward(model)()
        cases.append((f"{engine}: small-alt model, 300 tokens", run))
    if real:
        big, config = build_model("qwen3.6-35b-a3b", seed=0, dtype=dtype)
        lm = big.language_model
        x = (0.5 * mx.random.normal((1, 256, 2048), key=mx.random.key(1))).astype(dtype)
        for i in (0, 3):  # a Gated DeltaNet layer and a full-attention layer
            for engine in ("stock", "lily"):
                def run(i=i, engine=engine):
                    specialize(big, lily=engine == "lily")
                    layer = lm.model.layers[i]
                    cache = lm.make_cache()[i]
                    mask = None if layer.is_linear else "causal"
                    return layer(x, mask, cache)
                cases.append((f"{engine}: real-shape layer {i} ({'linear' if lm.model.layers[i].is_linear else 'full'}), 256 tokens", run))
    return cases


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=5, help="runs per case (default: 5)")
    p.add_argument("--tokens", type=int, default=256, help="tokens per op case (default: 256)")
    p.add_argument("--no-real", action="store_true", help="skip the real-shape layers (~20 GB of weights)")
    p.add_argument("--out", help="also write DIR/determinism.txt")
    args = p.parse_args(argv)

    lines = [
        f"device {mx.default_device()}, mlx {mx.__version__}, {args.runs} runs per case on identical inputs",
        "",
        f"{'case':58s} {'dtype':9s} {'bit-identical':>13s} {'max |diff|':>11s} {'ms/run':>8s}",
    ]
    print("\n".join(lines), flush=True)

    def row(name, dtype, fn):
        try:
            same, worst, ms = repeat(fn, args.runs)
            text = f"{name:58s} {dtype:9s} {('yes' if same else 'NO'):>13s} {worst:11.3g} {ms:8.1f}"
        except Exception as exc:  # noqa: BLE001 - an op missing on this backend is a row too
            text = f"{name:58s} {dtype:9s} {'error':>13s} {type(exc).__name__}: {str(exc)[:60]}"
        lines.append(text)
        print(text, flush=True)

    for dtype in (mx.float32, mx.bfloat16):
        dname = str(dtype).rsplit(".", 1)[-1]
        for name, fn in op_cases(dtype, args.tokens):
            row(name, dname, fn)
    for dtype in (mx.float32, mx.bfloat16):
        dname = str(dtype).rsplit(".", 1)[-1]
        for name, fn in model_cases(dtype, real=not args.no_real and dtype == mx.bfloat16):
            row(name, dname, fn)
    write_report(args.out, "determinism.txt", "\n".join(lines) + "\n", echo=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
