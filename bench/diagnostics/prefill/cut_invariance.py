"""Whether a prompt's prefill bits depend on where its calls are cut (a GPU run).

    python3 -m bench.diagnostics.prefill.cut_invariance --checkpoint-dir CKPT [--out DIR]

Prefix reuse (mlx_lily/prefix_reuse.py) can give a cold prefill's bits only
from a point where cutting the prefill changes nothing. This runs one prompt
through lily's model cut several ways (each a list of call ends; the last
token is then one decode step, as mlx-lm runs it) and compares each with the
server's cold cuts (every 2048 tokens): the first token's logits, bit for
bit, and where they differ the first layer whose cache differs (its kind
says which op is not invariant). Cut points are multiples of 64 (the chunked
Gated DeltaNet's pieces) unless a variant says otherwise; one off-grid
variant shows that the check can fail. With ``--all-settings`` also the
chunked DeltaNet from 192 tokens (the shipped 64 is what makes calls of 64 to
191 tokens keep their bits) and lily's prefill attention kernel for every
call instead of MLX's sdpa on CUDA.

Prints a table and writes ``cut_invariance.json`` to DIR.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
from typing import Dict, List, Optional, Sequence

import mlx.core as mx

from bench.common import prompt_ids, write_json, write_report

PROMPT_TOKENS = 6000
COLD = (2048, 4096, 5999)
# (name, call ends): all end at the prompt's last token but one.
VARIANTS = (
    ("cold again", COLD),
    ("cut inside a call at a 64 multiple", (2048, 4032, 5999)),
    ("resumed call ends on the cold grid", (2048, 4032, 4096, 5999)),
    ("a call of 64", (2048, 4096, 4160, 5999)),
    ("a call of 128", (2048, 4096, 4224, 5999)),
    ("a call of 256", (2048, 4096, 4352, 5999)),
    ("a last call of 47", (2048, 4096, 5952, 5999)),
    ("one call", (5999,)),
    ("cut off the grid (4100)", (2048, 4100, 5999)),
)
# (label, DeltaNet CHUNKED_FROM, CUDA_PREFILL_REFERENCE_FROM); None: as shipped.
# The first run (bench/results/2026-12-03-nvidia-h200-7186957969) tried
# chunked from 192 (then shipped) and from 64, and lily's attention kernel for
# every call; ``--all-settings`` repeats that.
SETTINGS = (
    ("shipped", None, None),
    ("chunked from 192", 192, None),
    ("lily attention for every call", None, math.inf),
)


@contextlib.contextmanager
def settings(chunked_from: Optional[int], sdpa_from: Optional[float]):
    from mlx_lily.kernels.attention import sdpa
    from mlx_lily.kernels.gated_delta import recurrence
    from mlx_lily.layers import gated_deltanet

    saved = (recurrence.CHUNKED_FROM, gated_deltanet.CHUNKED_FROM, sdpa.CUDA_PREFILL_REFERENCE_FROM)
    try:
        if chunked_from is not None:
            recurrence.CHUNKED_FROM = gated_deltanet.CHUNKED_FROM = chunked_from
        if sdpa_from is not None:
            sdpa.CUDA_PREFILL_REFERENCE_FROM = sdpa_from
        yield
    finally:
        recurrence.CHUNKED_FROM, gated_deltanet.CHUNKED_FROM, sdpa.CUDA_PREFILL_REFERENCE_FROM = saved


def layer_states(cache) -> List[List[mx.array]]:
    """Each layer's cache arrays: DeltaNet conv and recurrent state; KV keys and values."""
    out = []
    for c in cache:
        if hasattr(c, "keys") and not hasattr(c, "cache"):
            out.append([c.keys[..., : c.offset, :], c.values[..., : c.offset, :]])
        else:
            out.append([a for a in c.cache if a is not None])
    return out


def prefill(model, tokens: mx.array, ends: Sequence[int]):
    """(first token's logits, each layer's cache arrays after the prompt but its last token)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    start = 0
    for end in ends:
        model(tokens[None, start:end], cache=cache)
        mx.eval([c.state for c in cache])
        start = end
    states = layer_states(cache)
    logits = model(tokens[None, start:], cache=cache)[:, -1]
    mx.eval(logits, states)
    return logits, states


def compare(model, tokens, kinds: List[str], cold, ends) -> Dict[str, object]:
    logits, states = prefill(model, tokens, ends)
    first: Optional[str] = None
    for i, (a, b) in enumerate(zip(cold[1], states)):
        if not all(mx.array_equal(x, y).item() for x, y in zip(a, b)):
            first = f"{i} ({kinds[i]})"
            break
    diff = float(mx.abs(logits.astype(mx.float32) - cold[0].astype(mx.float32)).max().item())
    return {"logits_equal": bool(mx.array_equal(logits, cold[0]).item()), "max_abs_logit_diff": diff,
            "first_layer_differing": first}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--out", default="bench/out")
    parser.add_argument("--all-settings", action="store_true", help="also the settings other than the shipped one")
    args = parser.parse_args()
    import mlx_lily

    model, _ = mlx_lily.load(args.checkpoint_dir, backend="lily")
    text = model.language_model.model if hasattr(model, "language_model") else model.model
    kinds = ["Gated DeltaNet" if layer.is_linear else "attention" for layer in text.layers]
    vocab = text.embed_tokens.weight.shape[0]
    tokens = mx.array(prompt_ids(PROMPT_TOKENS, vocab))
    rows = []
    for label, chunked_from, sdpa_from in SETTINGS if args.all_settings else SETTINGS[:1]:
        with settings(chunked_from, sdpa_from):
            cold = prefill(model, tokens, COLD)
            for name, ends in VARIANTS:
                row = {"setting": label, "variant": name, "ends": list(ends),
                       **compare(model, tokens, kinds, cold, ends)}
                print(json.dumps(row), flush=True)
                rows.append(row)
    lines = [f"One prompt of {PROMPT_TOKENS} tokens; cold cuts {list(COLD)}; each variant against "
             "the cold cuts under the same setting.", "",
             "| setting | variant | call ends | logits equal | max abs diff | first layer differing |",
             "|---|---|---|---|---:|---|"]
    for r in rows:
        lines.append(f"| {r['setting']} | {r['variant']} | {r['ends']} | {r['logits_equal']} | "
                     f"{r['max_abs_logit_diff']:.3g} | {r['first_layer_differing'] or ''} |")
    write_report(args.out, "cut_invariance.md", "\n".join(lines) + "\n")
    write_json(args.out, "cut_invariance.json", {"prompt_tokens": PROMPT_TOKENS, "cold": list(COLD), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
