"""Where does prefill's peak memory go? Lily against stock, part by part.

    python3 -m bench.diagnostics.prefill.peak_memory [--tokens 2048] [--out DIR]

At the real shapes (random weights), one prompt chunk of TOKENS tokens runs,
for each engine, through: the whole model as mlx-lm's prefill runs it (the
chunk, then the cache state evaluated), one Gated DeltaNet layer, one
full-attention layer, and the parts of a layer alone (token mixer, MoE block,
routed experts). A row gives the peak memory while the part ran
(``mx.get_peak_memory`` after ``mx.reset_peak_memory``) and what was in use
just before it (``mx.get_active_memory``), in MiB; their difference is the
part's own footprint. The whole model runs twice: as mlx-lm's prefill runs
it (the chunk queued at once), and with each layer evaluated before the next
is queued (if the first peaks higher, the difference is work in flight). (A first version printed only the difference; on the
H200 several rows read 0, so both figures are kept now.)
Each part runs twice and the second run is reported, so first-use checks and
compilation are not in it. The table goes to stdout and, with --out, to
DIR/peak_memory.txt.
"""

from __future__ import annotations

import argparse
from typing import Callable, List, Tuple

import mlx.core as mx

MIB = 2**20


def _peak(fn: Callable[[], object]) -> Tuple[float, float]:
    """(MiB in use before ``fn``'s measured run, peak MiB during it)."""
    out = fn()
    mx.eval(out)
    del out
    mx.synchronize()
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    out = fn()
    mx.eval(out)
    mx.synchronize()
    peak = mx.get_peak_memory()
    del out
    mx.clear_cache()
    return before / MIB, peak / MIB


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048, help="tokens in the chunk (default: 2048)")
    p.add_argument("--shape", default="qwen3.6-35b-a3b")
    p.add_argument("--out", help="also write DIR/peak_memory.txt")
    args = p.parse_args()

    from mlx_lm.models.base import create_attention_mask, create_ssm_mask
    from mlx_lm.models.cache import make_prompt_cache

    from bench.common import prompt_ids, write_report
    from bench.engines import load_shared, switch
    from bench.oracle import _masks
    from mlx_lily import kernels as K
    from mlx_lily.layers import LilySparseMoeBlock

    model, vocab, _, _ = load_shared({"model": None, "shape": args.shape, "seed": 0, "conditioned": False})
    text = model.language_model.model
    layers = text.layers
    linear = next(i for i, layer in enumerate(layers) if layer.is_linear)
    full = next(i for i, layer in enumerate(layers) if not layer.is_linear)
    tokens = mx.array(prompt_ids(args.tokens, vocab))[None]
    h = text.embed_tokens(tokens)
    mx.eval(h)

    def whole_model():
        cache = make_prompt_cache(model)
        model(tokens, cache=cache)
        return [c.state for c in cache]

    def layer_by_layer():
        # The same chunk, each layer evaluated before the next is queued: if
        # the whole-model peak is the work in flight (each kernel's buffers
        # kept until the GPU has run it, with the host far ahead), this one is
        # lower.
        cache = make_prompt_cache(model)
        x = text.embed_tokens(tokens)
        fa = next(c for layer, c in zip(layers, cache) if not layer.is_linear)
        ssm = next(c for layer, c in zip(layers, cache) if layer.is_linear)
        fa_mask, ssm_mask = create_attention_mask(x, fa), create_ssm_mask(x, ssm)
        for layer, c in zip(layers, cache):
            x = layer(x, ssm_mask if layer.is_linear else fa_mask, c)
            mx.eval(x, c.state)
        return [c.state for c in cache]

    def layer_call(i: int, part: str):
        layer = layers[i]

        def run():
            cache = model.language_model.make_cache()[i]
            mask = _masks(h, layer, cache)
            if part == "layer":
                return layer(h, mask, cache)
            if part == "mixer":
                mixer = layer.linear_attn if layer.is_linear else layer.self_attn
                return mixer(layer.input_layernorm(h), mask, cache)
            if part == "moe":
                return layer.mlp(layer.post_attention_layernorm(h))
            if part == "experts":
                mlp = layer.mlp
                x = layer.post_attention_layernorm(h)
                inds = mx.argpartition(-mlp.gate(x), kth=mlp.top_k - 1, axis=-1)[..., : mlp.top_k]
                if isinstance(mlp, LilySparseMoeBlock):
                    return K.moe_experts(x, inds, mlp.switch_mlp)
                return mlp.switch_mlp(x, inds)
            raise ValueError(part)

        return run

    parts: List[Tuple[str, Callable]] = [
        ("whole model, one chunk + cache state", whole_model),
        ("whole model, evaluated layer by layer", layer_by_layer),
    ]
    for i, kind in ((linear, "Gated DeltaNet"), (full, "full attention")):
        parts += [
            (f"layer {i} ({kind}), whole layer", layer_call(i, "layer")),
            (f"layer {i} ({kind}), token mixer", layer_call(i, "mixer")),
            (f"layer {i} ({kind}), MoE block", layer_call(i, "moe")),
        ]
    parts.append((f"layer {linear}, routed experts alone", layer_call(linear, "experts")))

    rows = []
    for name, fn in parts:
        figures = {}
        for engine in ("stock", "lily"):
            switch(model, engine)
            figures[engine] = _peak(fn)
        rows.append((name, figures["stock"], figures["lily"]))
        (sb, sp), (lb, lp) = figures["stock"], figures["lily"]
        print(f"{name:48s} stock {sb:9.1f} -> {sp:9.1f} MiB  lily {lb:9.1f} -> {lp:9.1f} MiB", flush=True)

    lines = [f"Memory in use before each part and its peak while it ran, MiB ({args.tokens}-token chunk, "
             f"{args.shape}); footprint = peak - before",
             "", f"{'part':48s} {'stock before':>12s} {'stock peak':>11s} {'lily before':>12s} {'lily peak':>10s} "
             f"{'footprint lily - stock':>23s}"]
    lines += [f"{n:48s} {sb:12.1f} {sp:11.1f} {lb:12.1f} {lp:10.1f} {(lp - lb) - (sp - sb):23.1f}"
              for n, (sb, sp), (lb, lp) in rows]
    write_report(args.out, "peak_memory.txt", "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
