"""Whether a batch's prompts could share one prefill call, at the real shapes (a GPU run).

    python3 -m bench.diagnostics.prefill.packed_rows --checkpoint-dir CKPT [--costs] [--out DIR]
    python3 -m bench.diagnostics.prefill.packed_rows --checkpoint-dir CKPT --generator [--prefill-batch 16]

The server prefills prompts that arrive together as one batch; lily runs
such a batch row by row (``layers/prompt_rows.py``), so that each row's
caches are the bits the request alone would have. Two questions decide
whether the rows' token-wise work (projections, the MoE) could instead run
once over all rows' tokens, packed one after another:

* **row invariance**: does each token-wise module of a layer give a row the
  same bits when its tokens are packed with other rows' as when they run
  alone? Checked for every quantized linear of the first Gated DeltaNet and
  the first attention layer, and for each of those layers' MoE block, on
  rows of several lengths;
* **what a prefill call costs** at few tokens: the host's time to build the
  graph of one prefill call (the model's call, before evaluation; lily's
  prefill waits for each layer's input, so this includes the GPU's work on
  all but the last layers) and the whole call, for 256 and 2,048 tokens
  alone, for 8 rows of 256 run one after another, for the same 8 rows
  packed as the server's batch prefill packs them (``packed_call``), and
  for 16 rows of 211 to 256 packed (a 16-stream wave's prompts). With
  ``--costs`` only these.

* **through mlx-lm's batch generator** (``--generator``): 16 prompts of 211
  to 256 tokens inserted together into a ``BatchGenerator`` (prefill batches
  of ``--prefill-batch``, 8 by default as ``mlx_lm.server``'s; lily's server
  takes 16 where it packs), timed until every request has its first token, with
  packing on and off (``MLX_LILY_PACK_PROMPTS``), alternating; and whether
  each request's first log-probabilities are the same bits either way.

Prints a table and writes ``packed_rows.json`` to DIR (with ``--generator``,
``packed_rows_generator.json``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Dict, List

import mlx.core as mx
import mlx.nn as nn

from bench.common import machine_info, software_info, write_report

ROW_LENGTHS = (256, 7, 8, 9, 16, 33, 64, 1024, 257)


def _token_wise_modules(layer) -> Dict[str, nn.Module]:
    """The layer's quantized linears (by path) and its MoE block."""
    found = {name: m for name, m in layer.named_modules() if isinstance(m, nn.QuantizedLinear)}
    found["mlp (whole block)"] = layer.mlp
    return found


def row_invariance(model, dims: int) -> List[dict]:
    """For each token-wise module: is each row's output, packed, the bits of the row alone?"""
    layers = model.language_model.model.layers if hasattr(model, "language_model") else model.model.layers
    picked = {}
    for i, layer in enumerate(layers):
        kind = "Gated DeltaNet" if layer.is_linear else "attention"
        if kind not in picked:
            picked[kind] = (i, layer)
    rows_out = []
    for kind, (index, layer) in picked.items():
        for name, module in _token_wise_modules(layer).items():
            in_dims = dims if name == "mlp (whole block)" else module.weight.shape[-1] * 32 // module.bits
            parts = [mx.random.normal((1, n, in_dims), key=mx.random.key(7 + n)).astype(mx.bfloat16)
                     for n in ROW_LENGTHS]
            packed = module(mx.concatenate(parts, axis=1))
            alone = [module(p) for p in parts]
            mx.eval(packed, *alone)
            start, equal, worst = 0, [], 0.0
            for p, a in zip(parts, alone):
                n = p.shape[1]
                got = packed[:, start:start + n]
                start += n
                equal.append(bool(mx.array_equal(got, a).item()))
                worst = max(worst, float(mx.abs(got.astype(mx.float32) - a.astype(mx.float32)).max().item()))
            rows_out.append({"layer": f"{index} ({kind})", "module": name, "rows_equal": equal, "max_abs_diff": worst})
    return rows_out


def prefill_costs(model, vocab: int, repeats: int = 3) -> List[dict]:
    """Build and total time of prefill calls at few tokens, each on a fresh cache."""
    from mlx_lm.models.cache import make_prompt_cache

    def one(tokens: int) -> tuple:
        cache = make_prompt_cache(model)
        ids = mx.random.randint(0, vocab, (1, tokens), key=mx.random.key(tokens)).astype(mx.int32)
        mx.eval(ids)
        mx.synchronize()
        t0 = time.perf_counter()
        logits = model(ids, cache=cache)
        t1 = time.perf_counter()
        mx.eval(logits, [c.state for c in cache])
        t2 = time.perf_counter()
        return t1 - t0, t2 - t0

    def packed(lengths: List[int]) -> tuple:
        from mlx_lily.layers.prompt_rows import packed_call

        text = model.language_model.model
        caches = [make_prompt_cache(model) for _ in lengths]
        ids = [mx.random.randint(0, vocab, (1, n), key=mx.random.key(r)).astype(mx.int32)
               for r, n in enumerate(lengths)]
        mx.eval(ids)
        mx.synchronize()
        t0 = time.perf_counter()
        head = getattr(model.language_model, "lm_head", None) or text.embed_tokens.as_linear
        outs = [head(h) for h in packed_call(text, ids, caches)]  # every position's logits, as a model call
        t1 = time.perf_counter()
        mx.eval(outs, [c.state for cache in caches for c in cache])
        t2 = time.perf_counter()
        return t1 - t0, t2 - t0

    out = []
    for label, lengths in (("8 rows of 256 packed (prompt_rows.packed_call)", [256] * 8),
                           ("16 rows of 211 to 256 packed (like a 16-stream wave's prompts)", wave_lengths(16, 256))):
        for _ in range(2):
            packed(lengths)
        builds, totals = zip(*(packed(lengths) for _ in range(repeats)))
        out.append({"prefill": label, "build_ms": 1e3 * statistics.median(builds),
                    "total_ms": 1e3 * statistics.median(totals)})
    for label, calls in (("256 tokens", [256]), ("2,048 tokens", [2048]), ("8 rows of 256, one after another", [256] * 8)):
        for n in calls:  # warm: each length's kernels built once
            one(n)
        builds, totals = [], []
        for _ in range(repeats):
            b = t = 0.0
            for n in calls:
                bb, tt = one(n)
                b, t = b + bb, t + tt
            builds.append(b)
            totals.append(t)
        out.append({"prefill": label, "build_ms": 1e3 * statistics.median(builds),
                    "total_ms": 1e3 * statistics.median(totals)})
    return out


def wave_lengths(prompts: int, tokens: int) -> List[int]:
    """Lengths from ``tokens`` down by up to 45: rows padded unlike each other."""
    return [tokens - (7 * r) % 46 for r in range(prompts)]


def through_generator(model, vocab: int, rounds: int = 2, prompts: int = 16, tokens: int = 256,
                      prefill_batch: int = 8) -> dict:
    """First-token time of ``prompts`` requests inserted together, packing on
    and off, and whether their first log-probabilities agree bit for bit."""
    import os

    import numpy as np
    from mlx_lm.generate import BatchGenerator

    from mlx_lily.layers.prompt_rows import PACK_ENV

    lengths = wave_lengths(prompts, tokens)
    ids = [[int(t) for t in np.random.default_rng(r).integers(0, vocab, n)] for r, n in enumerate(lengths)]

    def run(packing: bool) -> tuple:
        os.environ[PACK_ENV] = "1" if packing else "0"
        gen = BatchGenerator(model, completion_batch_size=32, prefill_batch_size=prefill_batch)
        start = time.perf_counter()
        uids = gen.insert(ids, max_tokens=[1] * prompts)
        first = {}
        while len(first) < prompts:
            _, responses = gen.next()
            for r in responses:
                first[r.uid] = np.array(r.logprobs.astype(mx.float32))
        seconds = time.perf_counter() - start
        gen.close()
        return seconds, [first[u] for u in uids]

    run(True)  # warm: every kernel instance of both forms built once
    run(False)
    times = {True: [], False: []}
    logprobs = {}
    for _ in range(rounds):
        for packing in (False, True):
            seconds, logprobs[packing] = run(packing)
            times[packing].append(seconds)
    os.environ.pop(PACK_ENV, None)
    same = [bool(np.array_equal(a, b)) for a, b in zip(logprobs[True], logprobs[False])]
    return {"prompts": prompts, "tokens": tokens, "lengths": lengths, "first_token_s_packed": statistics.median(times[True]),
            "first_token_s_row_by_row": statistics.median(times[False]), "rounds": rounds,
            "prefill_batch": prefill_batch, "first_logprobs_same_bits": same}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--generator", action="store_true",
                        help="only the batch generator's first-token times, packing on and off")
    parser.add_argument("--prefill-batch", type=int, default=8,
                        help="with --generator: prompts a prefill call (mlx_lm.server's default 8; "
                             "lily's server takes 16 where it packs)")
    parser.add_argument("--costs", action="store_true",
                        help="only the prefill calls' times (no row-invariance check)")
    args = parser.parse_args()
    if args.costs and args.generator:
        parser.error("--costs and --generator measure different things: give one")
    if args.prefill_batch != 8 and not args.generator:
        parser.error("--prefill-batch applies to --generator only")
    import mlx_lily

    model, _ = mlx_lily.load(args.checkpoint_dir, backend="lily")
    text = model.language_model.model if hasattr(model, "language_model") else model.model
    dims = text.layers[0].input_layernorm.weight.shape[0]
    vocab = text.embed_tokens.weight.shape[0]  # rows: one per token, packed or not
    if args.generator:
        result = through_generator(model, vocab, prefill_batch=args.prefill_batch)
        same = result["first_logprobs_same_bits"]
        text_out = (f"{result['prompts']} prompts of {min(result['lengths'])} to {result['tokens']} tokens inserted together "
                    f"(BatchGenerator, prefill batches of {result['prefill_batch']}), until each has its first token, median of "
                    f"{result['rounds']}: packed {result['first_token_s_packed']:.3f} s, row by row "
                    f"{result['first_token_s_row_by_row']:.3f} s; first log-probabilities the same bits "
                    f"packed and row by row: {sum(same)}/{len(same)}\n")
        write_report(args.out, "packed_rows_generator.md", text_out)
        (Path(args.out) / "packed_rows_generator.json").write_text(json.dumps(
            {"machine": machine_info(), "software": software_info(), **result}, indent=1))
        return 0
    invariance = [] if args.costs else row_invariance(model, dims)
    costs = prefill_costs(model, vocab)
    lines = [] if args.costs else [f"Row lengths packed: {list(ROW_LENGTHS)}", "",
                                   "| layer | module | each row's bits alone = packed | max abs diff |", "|---|---|---|---:|"]
    for r in invariance:
        lines.append(f"| {r['layer']} | {r['module']} | {''.join('=' if e else 'x' for e in r['rows_equal'])} "
                     f"| {r['max_abs_diff']:.3g} |")
    lines += ["", "| prefill | build ms | total ms |", "|---|---:|---:|"]
    for c in costs:
        lines.append(f"| {c['prefill']} | {c['build_ms']:.1f} | {c['total_ms']:.1f} |")
    write_report(args.out, "packed_rows.md", "\n".join(lines) + "\n")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "packed_rows.json").write_text(json.dumps(
        {"machine": machine_info(), "software": software_info(),
         "row_lengths": None if args.costs else list(ROW_LENGTHS),
         "invariance": invariance, "prefill": costs}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
