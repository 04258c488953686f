"""``python -m mlx_lily demo``: one prompt through stock mlx-lm and through lily.

The checkpoint is a random ``qwen3_5_moe`` made once and cached (see
checkpoints.py), so the text is gibberish; what matters is which of lily's ops
ran kernels, whether both engines produce the same greedy tokens, and how fast
each is.

Where the tokens differ, the demo looks at the first step that differs: it
feeds both engines the same tokens up to there and compares their logits. A
difference at bf16 rounding level that flips a near-tie is expected from
kernels that sum in another order; a larger one means a kernel disagrees with
its reference, and the demo fails.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections import Counter, defaultdict
from typing import Dict, Iterator, List, NamedTuple, Optional

import mlx.core as mx
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler

from . import backend
from .checkpoints import SHAPES, make_checkpoint
from .errors import LilyError, one_line, want_traceback
from .kernels import OPS, LilyOp

# The largest lily-vs-stock logit difference, relative to the spread (standard
# deviation) of stock's logits at that step, still counted as rounding: bf16
# keeps 8 significant bits (relative step 2**-8 = 0.4%), and a handful of
# layers re-rounding activations compounds that to about 1%; a wrong kernel
# gives differences of the order of the spread itself.
ROUNDING_TOLERANCE = 0.05
# With the kernels in the CPU emulator, stock runs on the CPU, where MLX's bf16
# quantized matmul sums bf16 products in bf16 (~4% of the scale per product at
# these widths), while lily's GEMV and MoE kernels sum in fp32 as stock's GPU
# kernels do: the gap is stock's rounding, and a wrong kernel still shows as
# differences of the order of the spread.
CPU_STOCK_TOLERANCE = 0.25


def rounding_tolerance() -> float:
    from .toolchain.registry import kernel_backend

    return CPU_STOCK_TOLERANCE if kernel_backend()[0] == "emulator" else ROUNDING_TOLERANCE


class Run(NamedTuple):
    text: str
    tokens: List[int]
    last: object  # mlx-lm's last GenerationResponse
    model: object
    prompt_ids: List[int]


def run_engine(path: str, engine: str, prompt: str, max_tokens: int) -> Run:
    """Greedy-generate with one engine."""
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
    return Run(text, tokens, last, model, list(prompt_ids))


@contextlib.contextmanager
def recording_op_paths() -> Iterator[Dict[str, Counter]]:
    """Count, per lily op, the calls that ran its kernel and its reference
    (with the reason), while the block runs."""
    taken: Dict[str, Counter] = defaultdict(Counter)
    stock_call = LilyOp.__call__

    def call(op, *args, **kwargs):
        out = stock_call(op, *args, **kwargs)
        taken[op.name][(op.last_path, op.last_reason)] += 1
        return out

    LilyOp.__call__ = call
    try:
        yield taken
    finally:
        LilyOp.__call__ = stock_call


def describe_op_paths(taken: Dict[str, Counter]) -> List[str]:
    lines = []
    for name in OPS:
        paths = taken.get(name)
        if not paths:
            lines.append(f"  {name:16s} not called")
            continue
        parts = [f"{path} ({why}) x{count}" for (path, why), count in paths.most_common()]
        lines.append(f"  {name:16s} " + "; ".join(parts))
    return lines


def kernels_that_ran(taken: Dict[str, Counter]) -> List[str]:
    return [name for name, paths in taken.items() if any(p == "kernel" for p, _ in paths)]


class Divergence(NamedTuple):
    step: int  # index of the first generated token that differs
    stock_token: int
    lily_token: int
    stock_margin: float  # stock's logit for its token minus for lily's
    max_difference: float  # largest |lily - stock| logit at that step
    spread: float  # standard deviation of stock's logits at that step

    @property
    def relative(self) -> float:
        return self.max_difference / max(self.spread, 1e-30)

    @property
    def rounding_level(self) -> bool:
        return self.relative <= rounding_tolerance()


def judge(step: int, stock_logits: mx.array, lily_logits: mx.array, stock_token: int,
          lily_token: int) -> Divergence:
    stock_logits = stock_logits.astype(mx.float32)
    lily_logits = lily_logits.astype(mx.float32)
    return Divergence(
        step=step,
        stock_token=stock_token,
        lily_token=lily_token,
        stock_margin=(stock_logits[stock_token] - stock_logits[lily_token]).item(),
        max_difference=mx.abs(lily_logits - stock_logits).max().item(),
        spread=mx.std(stock_logits).item(),
    )


def first_divergence(lily_model, prompt_ids: List[int], stock_tokens: List[int],
                     lily_tokens: List[int]) -> Optional[Divergence]:
    """Both engines' logits for the first step whose greedy tokens differ, on
    the same input (the prompt and the tokens both generated before it).

    Stock's logits come from the same model switched back to stock's layers
    (``specialize``): the same weights through stock mlx-lm's own code."""
    from .models.qwen3_5_moe import specialize

    step = next((i for i, (a, b) in enumerate(zip(stock_tokens, lily_tokens)) if a != b), None)
    if step is None:
        return None
    inputs = mx.array([prompt_ids + stock_tokens[:step]])
    lily_logits = lily_model(inputs)[0, -1]
    specialize(lily_model, lily=False)
    try:
        stock_logits = lily_model(inputs)[0, -1]
    finally:
        specialize(lily_model, lily=True)
    return judge(step, stock_logits, lily_logits, stock_tokens[step], lily_tokens[step])


def explain(same: bool, ran: List[str], divergence: Optional[Divergence]) -> tuple[List[str], bool]:
    """(lines saying what the agreement line means, whether the demo passes)."""
    if not ran:
        lines = [
            "greedy tokens agree: " + ("yes" if same else "NO"),
            "No lily op ran a kernel here, so lily computed every op with its reference,",
            "which is stock mlx-lm's math: the two runs execute the same computation, and",
            "agreement checks that lily's model is wired like stock's, not kernel accuracy.",
        ]
        if not same:
            lines.append("They differ, so lily's model does not compute what stock's does: a bug in lily.")
        return lines, same
    lines = [f"Lily ran kernels for {', '.join(sorted(ran))}; the other ops ran their references."]
    if same:
        return ["greedy tokens agree: yes"] + lines + [
            "Every greedy token matches stock's: the kernels' results agree with stock's",
            "closely enough that no choice of next token changed.",
        ], True
    if divergence is None:  # different lengths only (one engine stopped early)
        return ["greedy tokens agree: NO (one run stopped earlier)"] + lines, False
    d = divergence
    lines += [
        f"The first difference is generated token {d.step}: stock picks id {d.stock_token}, lily "
        f"id {d.lily_token}, which stock scores {d.stock_margin:.3g} lower.",
        f"On the same input there, lily's logits differ from stock's by at most "
        f"{d.max_difference:.3g}, {100 * d.relative:.2g}% of their spread "
        f"(standard deviation {d.spread:.3g}).",
    ]
    if d.rounding_level:
        return ["greedy tokens agree: up to a rounding-level near-tie"] + lines + [
            f"That is within bf16 rounding (at most {100 * rounding_tolerance():.0f}% of the spread): "
            "kernels sum in another order",
            "than stock, and on random weights two candidates can be that close; after one",
            "token differs, the rest of the text follows it. This is not an error.",
        ], True
    return ["greedy tokens agree: NO"] + lines + [
        f"That is more than rounding (over {100 * rounding_tolerance():.0f}% of the spread): a kernel "
        "disagrees with its reference.",
        "Run `python -m mlx_lily doctor` to see which; MLX_LILY_KERNELS=0 turns kernels off.",
    ], False


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlx_lily demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="demo", choices=sorted(SHAPES))
    parser.add_argument("--model", help="use this checkpoint instead of a random one")
    parser.add_argument("--prompt", default="Tell me a story about a fast engine.")
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args(argv)

    path = args.model or str(make_checkpoint(shape=args.shape, quiet=False))
    try:
        # Before either run: a checkpoint lily refuses would otherwise run
        # stock's whole arm first and then fail inside lily's.
        backend.check_checkpoint(path)
    except LilyError as e:
        if want_traceback():
            raise
        print(one_line(e), file=sys.stderr)
        return 1
    print(f"checkpoint: {path}")
    print(f"device: {mx.default_device()}")
    runs = {}
    taken: Dict[str, Counter] = {}
    for engine in ("mlx", "lily"):
        with recording_op_paths() as taken_here:
            run = run_engine(path, engine, args.prompt, args.max_tokens)
        if engine == "lily":
            taken = taken_here
        runs[engine] = run
        label = "stock mlx-lm" if engine == "mlx" else "lily"
        print(f"\n== {label} ==")
        print(run.text)
        print(
            f"prompt: {run.last.prompt_tokens} tokens, {run.last.prompt_tps:.1f} tok/s; "
            f"generation: {run.last.generation_tokens} tokens, {run.last.generation_tps:.1f} tok/s"
        )
    print("\nlily's ops in this run (path, why, calls):")
    print("\n".join(describe_op_paths(taken)))

    stock, lily = runs["mlx"], runs["lily"]
    same = stock.tokens == lily.tokens
    divergence = None
    if not same and type(lily.model).__module__.startswith("mlx_lily."):
        divergence = first_divergence(lily.model, lily.prompt_ids, stock.tokens, lily.tokens)
    lines, ok = explain(same, kernels_that_ran(taken), divergence)
    print("\n" + "\n".join(lines))
    return 0 if ok else 1
