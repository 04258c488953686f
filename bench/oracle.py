"""Numerics against an fp32 oracle: ``python -m bench --oracle``.

The oracle is the same model, with the same quantized weights, computed with
fp32 activations (quantization scales and biases and every other parameter
widened to fp32, which is exact) on the CPU, which is deterministic. Each
engine (lily, stock) is measured against it:

* **end to end**: the engine's own forward over the sequence (its activation
  dtype, its device) against the oracle's: KL(oracle || engine) per position
  (mean and max) and top-1 agreement;
* **per layer, teacher-forced**: every decoder layer of each engine gets the
  oracle's input to that layer (rounded to the activation dtype) and a fresh
  cache, so errors do not compound across layers; its output is compared with
  the oracle layer's: relative error ``||engine - oracle|| / ||oracle||`` of
  the layer's output, and of its residual update (output minus input); and,
  to say where an error comes from, of the token mixer's update and the MoE's
  update, each fed the oracle's own input to it; and of the MoE's arithmetic
  alone: its update with the experts the engines choose held in the oracle
  too (``_moe_routed``), beside how often that choice is the oracle's.

The criterion: lily's error against the oracle is no larger than stock's, per
layer in the parts on held-equal inputs (``JUDGED_PARTS``: the token mixer and
the MoE's arithmetic) and end to end. The whole layer's error is reported, not
judged (``JUDGED_PARTS`` says why). CRITERION_SLACK (1.0: none) can loosen it
for a study; each row also records both errors, so how close a breach is shows.

Memory: the engines' weights exist once (``switch``); the oracle widens one
layer's scales and biases at a time (tens of MB at the real shapes) and
restores them after, so no fp32 copy of the model exists.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from .common import log, prompt_ids
from .engines import ENGINES, switch

# Positions scored by default: enough for stable KL means, and at the real
# shapes the CPU oracle (fp32, 40 layers and a 248K-way lm_head) stays within
# minutes.
DEFAULT_TOKENS = 128
# lily may exceed stock's error by this factor and still meet the criterion:
# none, as the project's numerics rule states it.
CRITERION_SLACK = 1.0
# What the per-layer criterion judges: the token mixer on the oracle's input,
# and the MoE's arithmetic with the experts held equal (``_moe_routed``). The
# whole layer's error is reported beside them but not judged: there a bf16
# engine's expert choice flips wherever two scores are within rounding, and a
# flip costs a whole expert's output, so which engine the whole layer favours
# follows a few near-ties, not the arithmetic.
JUDGED_PARTS = ("mixer", "moe_arith")


def _widened(module) -> Dict[str, Any]:
    """The module's parameters with every floating one in fp32 (exact)."""
    flat = []
    for name, value in tree_flatten(module.parameters()):
        if mx.issubdtype(value.dtype, mx.floating) and value.dtype != mx.float32:
            value = value.astype(mx.float32)
        flat.append((name, value))
    return tree_unflatten(flat)


class _InFp32:
    """Run a module with fp32 parameters on ``device``; restore them after."""

    def __init__(self, module, device):
        self.module, self.device = module, device

    def __enter__(self):
        self.saved = self.module.parameters()
        self.stream = mx.stream(self.device)
        self.stream.__enter__()
        self.module.update(_widened(self.module))
        return self.module

    def __exit__(self, *exc):
        self.module.update(self.saved)
        self.stream.__exit__(*exc)


def _masks(h: mx.array, layer, cache):
    from mlx_lm.models.base import create_attention_mask, create_ssm_mask

    return create_ssm_mask(h, cache) if layer.is_linear else create_attention_mask(h, cache)


def _mixer(layer, x: mx.array, mask, cache):
    """(the token mixer's update, x + update): the first half of a decoder
    layer (mlx-lm's qwen3_5 DecoderLayer), the MoE being the second."""
    mixer = layer.linear_attn if layer.is_linear else layer.self_attn
    update = mixer(layer.input_layernorm(x), mask, cache)
    return update, x + update


def _experts_chosen(mlp, x: mx.array) -> mx.array:
    """The experts the block's router picks for x (stock's rule)."""
    gates = mx.softmax(mlp.gate(x), axis=-1, precise=True)
    return mx.argpartition(gates, kth=-mlp.top_k, axis=-1)[..., -mlp.top_k:]


def _moe_routed(mlp, x: mx.array, inds: mx.array, lily: bool) -> mx.array:
    """The MoE block's update on x with the experts ``inds`` (the oracle's
    choice), each engine's own arithmetic: stock's block sequence, or lily's
    ops (``LilySparseMoeBlock``) for everything after the choice. A bf16
    engine and the fp32 oracle choose differently where two experts' scores
    are within rounding of each other; such a flip moves that token's update
    by a whole expert's output, whichever engine rounds better, so the MoE's
    arithmetic is judged with the choice held equal."""
    from mlx_lily import kernels as K

    gates = mx.softmax(mlp.gate(x), axis=-1, precise=True)
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if mlp.norm_topk_prob:
        scores = scores / scores.sum(axis=-1, keepdims=True)
    gate_logit = mlp.shared_expert_gate(x)
    if lily:
        y = K.moe_experts(x, inds, mlp.switch_mlp)
        return K.moe_combine(y, scores, mlp.shared_expert(x), gate_logit)
    y = (mlp.switch_mlp(x, inds) * scores[..., None]).sum(axis=-2)
    return y + mx.sigmoid(gate_logit) * mlp.shared_expert(x)


def _np32(a: mx.array) -> np.ndarray:
    return np.array(a[0].astype(mx.float32))


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    scale = float(np.linalg.norm(want))
    return float(np.linalg.norm(got - want)) / max(scale, 1e-30)


def _logprobs(logits: mx.array) -> np.ndarray:
    logits = logits.astype(mx.float32)
    out = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(out)
    return np.array(out)


def kl_and_top1(oracle: np.ndarray, engine: np.ndarray) -> Dict[str, float]:
    """KL(oracle || engine) per position (mean, max) and top-1 agreement, in fp64."""
    kls = []
    for i in range(0, len(oracle), 32):  # a few rows at a time: 248K vocabulary
        o, e = oracle[i:i + 32].astype(np.float64), engine[i:i + 32].astype(np.float64)
        kls.append((np.exp(o) * (o - e)).sum(-1))
    kl = np.concatenate(kls)
    return {
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "top1": float((oracle.argmax(-1) == engine.argmax(-1)).mean()),
    }


def run_oracle_here(model, vocab: int, n_tokens: int, device: str = "cpu") -> Dict[str, Any]:
    """The oracle comparison on a model built by ``engines.load_shared``."""
    from .measure import score

    oracle_device = mx.cpu if device == "cpu" else mx.gpu
    lm = model.language_model
    text = lm.model
    layers = text.layers
    tokens = mx.array(prompt_ids(n_tokens, vocab))[None]
    act_dtype = text.norm.weight.dtype

    # End to end: each engine's own forward, as a user runs it.
    engine_logprobs = {}
    for engine in ENGINES:
        switch(model, engine)
        start = time.perf_counter()
        engine_logprobs[engine] = score(model, tokens[0])
        log(f"oracle: {engine} end to end in {time.perf_counter() - start:.1f}s")

    # The oracle, layer by layer, with each engine's layer teacher-forced.
    start = time.perf_counter()
    with _InFp32(text.embed_tokens, oracle_device) as embed:
        h = embed(tokens)
        mx.eval(h)
    rows: List[Dict[str, Any]] = []
    for i, layer in enumerate(layers):
        with _InFp32(layer, oracle_device):
            cache = lm.make_cache()[i]
            mixer_update, mid = _mixer(layer, h, _masks(h, layer, cache), cache)
            moe_in = layer.post_attention_layernorm(mid)
            moe_update = layer.mlp(moe_in)
            out = mid + moe_update
            oracle_experts = _experts_chosen(layer.mlp, moe_in)
            mx.eval(out, oracle_experts)
        row: Dict[str, Any] = {"layer": i, "kind": "linear" if layer.is_linear else "full"}
        x = h.astype(act_dtype)
        x_np = np.array(x[0].astype(mx.float32))
        mid_x = mid.astype(act_dtype)
        # The experts both engines pick on the oracle's MoE input (stock's gate
        # and rule; lily's router is stock's to the bit), and the oracle's MoE
        # with that choice: the reference for the MoE's arithmetic.
        switch(model, "stock")
        moe_in_x = layer.post_attention_layernorm(mid_x)
        chosen = _experts_chosen(layer.mlp, moe_in_x)
        mx.eval(chosen)
        row["routing_agreement"] = float(
            (mx.sort(chosen, axis=-1) == mx.sort(oracle_experts, axis=-1)).all(axis=-1).mean()
        )
        with _InFp32(layer, oracle_device):
            moe_routed = _moe_routed(layer.mlp, moe_in, chosen, lily=False)
            mx.eval(moe_routed)
        oracle = {name: np.array(a[0]) for name, a in
                  (("in", h), ("out", out), ("mixer", mixer_update), ("moe", moe_update),
                   ("moe_routed", moe_routed))}
        for engine in ENGINES:
            switch(model, engine)
            cache = lm.make_cache()[i]
            got = layer(x, _masks(x, layer, cache), cache)
            got = np.array(got[0].astype(mx.float32))
            row[f"{engine}_rel_err"] = _rel(got, oracle["out"])
            row[f"{engine}_update_rel_err"] = _rel(got - x_np, oracle["out"] - oracle["in"])
            # Where the error comes from: the token mixer and the MoE, each
            # teacher-forced on the oracle's own input to it.
            cache = lm.make_cache()[i]
            mixer_got, _ = _mixer(layer, x, _masks(x, layer, cache), cache)
            row[f"{engine}_mixer_rel_err"] = _rel(_np32(mixer_got), oracle["mixer"])
            row[f"{engine}_moe_rel_err"] = _rel(_np32(layer.mlp(moe_in_x)), oracle["moe"])
            routed = _moe_routed(layer.mlp, moe_in_x, chosen, lily=engine == "lily")
            row[f"{engine}_moe_arith_rel_err"] = _rel(_np32(routed), oracle["moe_routed"])
        switch(model, "stock")
        row["ratio"] = row["lily_rel_err"] / max(row["stock_rel_err"], 1e-30)
        row["lily_no_worse"] = all(
            row[f"lily_{part}_rel_err"] <= CRITERION_SLACK * row[f"stock_{part}_rel_err"]
            for part in JUDGED_PARTS
        )
        rows.append(row)
        h = out
        log(
            f"oracle: layer {i + 1}/{len(layers)} ({row['kind']}): rel err lily "
            f"{row['lily_rel_err']:.3e} stock {row['stock_rel_err']:.3e}; mixer lily "
            f"{row['lily_mixer_rel_err']:.3e} stock {row['stock_mixer_rel_err']:.3e}; MoE lily "
            f"{row['lily_moe_rel_err']:.3e} stock {row['stock_moe_rel_err']:.3e}; MoE arithmetic lily "
            f"{row['lily_moe_arith_rel_err']:.3e} stock {row['stock_moe_arith_rel_err']:.3e}; routing "
            f"{row['routing_agreement']:.3f} ({time.perf_counter() - start:.0f}s)"
        )
    with _InFp32(text.norm, oracle_device) as norm, _InFp32(lm.lm_head, oracle_device) as head:
        oracle_logprobs = _logprobs(head(norm(h))[0])
    log(f"oracle: fp32 forward done in {time.perf_counter() - start:.1f}s")

    engines = {e: kl_and_top1(oracle_logprobs, engine_logprobs[e]) for e in ENGINES}
    lily, stock = engines["lily"], engines["stock"]
    worse_layers = [r["layer"] for r in rows if not r["lily_no_worse"]]
    whole_worse = [r["layer"] for r in rows if r["lily_rel_err"] > CRITERION_SLACK * r["stock_rel_err"]]
    return {
        "positions": n_tokens,
        "oracle_device": device,
        "activation_dtype": str(act_dtype).rsplit(".", 1)[-1],
        "engines": engines,
        "layers": rows,
        "criterion": {
            "rule": f"lily's error <= {CRITERION_SLACK} x stock's: per layer, in each part on "
                    "held-equal inputs ({}), and end to end".format(", ".join(JUDGED_PARTS)),
            "slack": CRITERION_SLACK,
            "layers_lily_worse": worse_layers,
            "layers_whole_layer_lily_worse": whole_worse,
            "end_to_end_lily_no_worse": lily["kl_mean"] <= CRITERION_SLACK * stock["kl_mean"],
            "met": not worse_layers and lily["kl_mean"] <= CRITERION_SLACK * stock["kl_mean"],
        },
    }


def markdown(doc: Dict[str, Any]) -> str:
    r = doc["oracle"]
    e = r["engines"]
    s = doc["settings"]
    what = s["model"] or f"random {s['shape']} (seed {s['seed']}{', conditioned' if s['conditioned'] else ''})"
    lines = [
        f"# lily vs stock against an fp32 oracle ({what})",
        "",
        f"{r['positions']} positions; oracle: the same quantized weights, fp32 activations, on the "
        f"{r['oracle_device'].upper()}; engines in {r['activation_dtype']} on "
        f"{doc['machine']['accelerator'].get('name', '?')}. Revision {doc['software']['git_revision']}.",
        "",
        "## End to end",
        "",
        "| engine | KL(oracle ‖ engine) mean | KL max | top-1 agreement with the oracle |",
        "|---|---:|---:|---:|",
    ]
    for name in ENGINES:
        lines.append(f"| {name} | {e[name]['kl_mean']:.3e} | {e[name]['kl_max']:.3e} | {e[name]['top1']:.4f} |")
    c = r["criterion"]
    lines += [
        "",
        f"Criterion ({c['rule']}): **{'met' if c['met'] else 'NOT met'}**"
        + (f"; lily worse at layers {c['layers_lily_worse']}" if c["layers_lily_worse"] else "")
        + ("" if c["end_to_end_lily_no_worse"] else "; lily worse end to end"),
        "",
        "## Per layer (teacher-forced: each layer gets the oracle's input)",
        "",
        "Relative error `||engine - oracle|| / ||oracle||` of the layer's output, and of its "
        "residual update (output - input); then of the token mixer's and the MoE's updates, each fed "
        "the oracle's own input to it (where an error comes from); routing agreement: the share of "
        "tokens whose experts the bf16 engines choose as the oracle does; MoE arithmetic: the MoE's "
        "update with the engines' choice of experts held in the oracle too. 'no worse' judges the "
        "mixer and the MoE arithmetic (see JUDGED_PARTS in bench/oracle.py).",
        "",
        "| layer | kind | lily | stock | lily / stock | lily update | stock update | lily mixer | "
        "stock mixer | lily MoE | stock MoE | routing agreement | lily MoE arithmetic | "
        "stock MoE arithmetic | no worse |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:---:|",
    ]
    for row in r["layers"]:
        lines.append(
            f"| {row['layer']} | {row['kind']} | {row['lily_rel_err']:.3e} | {row['stock_rel_err']:.3e} | "
            f"{row['ratio']:.3f} | {row['lily_update_rel_err']:.3e} | {row['stock_update_rel_err']:.3e} | "
            f"{row['lily_mixer_rel_err']:.3e} | {row['stock_mixer_rel_err']:.3e} | "
            f"{row['lily_moe_rel_err']:.3e} | {row['stock_moe_rel_err']:.3e} | "
            f"{row['routing_agreement']:.3f} | {row['lily_moe_arith_rel_err']:.3e} | "
            f"{row['stock_moe_arith_rel_err']:.3e} | "
            f"{'yes' if row['lily_no_worse'] else '**no**'} |"
        )
    return "\n".join(lines) + "\n"


def run_oracle(args) -> int:
    import json
    from pathlib import Path

    from .common import file_stem, machine_info, now_iso, software_info, op_paths
    from .engines import load_shared

    source = {"model": args.model, "shape": None if args.model else (args.shape or "demo"),
              "seed": args.seed, "conditioned": args.conditioned}
    started = now_iso()
    machine, software = machine_info(), software_info()
    log(f"oracle: building/loading the model ({source['model'] or source['shape']})")
    model, vocab, load_s, note = load_shared(source)
    if note:
        raise SystemExit(f"--oracle needs a qwen3_5_moe model: {note}")
    log(f"oracle: model ready in {load_s:.1f}s; {args.oracle_tokens} positions")
    result = run_oracle_here(model, vocab, args.oracle_tokens, args.oracle_device)
    doc = {
        "tool": "mlx-lily bench (oracle)",
        "schema": 1,
        "started": started,
        "finished": now_iso(),
        "machine": machine,
        "software": software,
        "settings": {**source, "positions": args.oracle_tokens, "oracle_device": args.oracle_device,
                     "prompt": "token i = ((i * 2654435761) mod 2**32) mod vocab_size"},
        "op_paths": op_paths(),
        "engines": result["engines"],
        "oracle": result,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = file_stem("oracle", machine, software["git_revision"])
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1))
    text = markdown(doc)
    (out / f"{stem}.md").write_text(text)
    print(text)
    log(f"wrote {out / stem}.json and .md")
    return 0
