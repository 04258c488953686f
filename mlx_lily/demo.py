"""``python -m mlx_lily demo``: one prompt through stock mlx-lm and through lily.

The checkpoint is a random ``qwen3_5_moe`` made once and cached (see
checkpoints.py), so the text is gibberish; what matters is that both engines
produce the same greedy tokens and how fast each is.
"""

from __future__ import annotations

import argparse
from typing import List

import mlx.core as mx
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler

from . import backend
from .checkpoints import SHAPES, make_checkpoint


def run_engine(path: str, engine: str, prompt: str, max_tokens: int):
    """Greedy-generate with one engine; returns (text, tokens, last response)."""
    model, tokenizer = backend.load(path, backend=engine)
    messages = [{"role": "user", "content": prompt}]
    prompt_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    text, tokens, last = "", [], None
    for response in stream_generate(
        model, tokenizer, prompt_ids, max_tokens=max_tokens, sampler=make_sampler(temp=0.0)
    ):
        text += response.text
        tokens.append(response.token)
        last = response
    return text, tokens, last


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlx_lily demo", description=__doc__)
    parser.add_argument("--shape", default="demo", choices=sorted(SHAPES))
    parser.add_argument("--model", help="use this checkpoint instead of a random one")
    parser.add_argument("--prompt", default="Tell me a story about a fast engine.")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    path = args.model or str(make_checkpoint(shape=args.shape, quiet=False))
    print(f"checkpoint: {path}")
    print(f"device: {mx.default_device()}")
    results = {}
    for engine in ("mlx", "lily"):
        text, tokens, last = run_engine(path, engine, args.prompt, args.max_tokens)
        results[engine] = tokens
        label = "stock mlx-lm" if engine == "mlx" else "lily"
        print(f"\n== {label} ==")
        print(text)
        print(
            f"prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tok/s; "
            f"generation: {last.generation_tokens} tokens, {last.generation_tps:.1f} tok/s"
        )
    same = results["mlx"] == results["lily"]
    print(f"\ngreedy tokens agree: {'yes' if same else 'NO'}")
    return 0 if same else 1
