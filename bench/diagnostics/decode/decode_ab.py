"""Decode with one setting against another, in one process: does a launch choice pay in a step?

    python3 -m bench.diagnostics.decode.decode_ab --arm "LABEL:MODULE.NAME=VALUE[;...]" --arm ... \\
        [--shape qwen3.6-35b-a3b] [--conditioned] [--context 4K] [--tokens 48] [--rounds 3] [--greedy 64] [--out DIR]

A kernel's device time (``moe_decode_sweep``, ``gemv_sweep``) does not say
what a choice does to a decode step: on the H200 40 launches more a token
took 0.7 ms off the GPU and cost 2 ms on the host. This loads the model once
(lily's layers) and alternates the arms ``--rounds`` times. Each arm sets
module constants (``mlx_lily.kernels.moe.decode.COMBINED_DOWN_MAX_ROWS=1``;
values as Python literals; an arm with no setting is the defaults), drops
every compiled decode step so the next one is traced under it, and measures:

* ms per token as mlx-lm's ``generate_step`` yields them (median over
  ``--tokens``), after a prompt of ``--context`` tokens;
* device ms and kernels per token (NVIDIA with PyTorch: CUPTI over 8
  synchronous steps; elsewhere None);
* in the first round, ``--greedy`` greedy tokens, which must not change
  between arms that claim the same bits.

Each arm starts from the defaults, and the defaults are restored at the end.
Alternating the arms within one process spreads the host's drift over all
of them, and each round starts one arm later than the round before.
Writes DIR/decode-ab.json and DIR/decode-ab.md with --out.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx

from bench.common import log, parse_length, parse_setting, write_json, write_report

DEVICE_STEPS = 8


def parse_arm(text: str) -> Tuple[str, List[Tuple[str, str, Any]]]:
    """'LABEL:mod.NAME=1;mod.OTHER=(1, 2)' -> (label, [(module, name, value)])."""
    label, colon, rest = text.partition(":")
    if not colon or not label.strip():
        raise ValueError(f"--arm {text!r}: LABEL:MODULE.NAME=VALUE[;...] (LABEL: alone for the defaults)")
    settings = [parse_setting(part, f"--arm {label.strip()!r}")
                for part in filter(None, (p.strip() for p in rest.split(";")))]
    return label.strip(), settings


def drop_compiled_steps(model: Any) -> int:
    """Forget every compiled decode step lily keeps on the model's modules
    (``_lily_*`` dicts of compiled calls and ``(key, fn)`` pairs; not the
    weights' record), so the next call traces under the current settings."""
    dropped = 0
    for module in model.modules():
        for key, value in list(module.__dict__.items()):
            if not key.startswith("_lily_") or key == "_lily_weights":
                continue
            if isinstance(value, dict):
                dropped += len(value)
                module.__dict__[key] = {}
            elif isinstance(value, tuple) and len(value) == 2 and callable(value[1]):
                del module.__dict__[key]
                dropped += 1
    return dropped


def _apply(settings, originals: Dict[Tuple[str, str], Any]) -> None:
    for (module, name), value in originals.items():
        setattr(importlib.import_module(module), name, value)
    for module, name, value in settings:
        setattr(importlib.import_module(module), name, value)


def _greedy(model, prompt: mx.array, n: int) -> List[int]:
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    return [int(t) for t, _ in generate_step(prompt, model, max_tokens=n, prompt_cache=make_prompt_cache(model))]


def _device(model, prompt: mx.array) -> Tuple[Optional[float], Optional[float]]:
    """(device ms, kernels) per synchronous decode step, or (None, None)."""
    from mlx_lm.models.cache import make_prompt_cache

    from bench.gpu_time import kernel_times, why_unavailable

    if why_unavailable() is not None:
        return None, None
    cache = make_prompt_cache(model)
    tok = mx.argmax(model(prompt[None], cache=cache)[:, -1:], axis=-1)
    mx.eval(tok)

    def run():
        nonlocal tok
        for _ in range(DEVICE_STEPS):
            tok = mx.argmax(model(tok, cache=cache)[:, -1:], axis=-1)
            mx.eval(tok)

    run()
    times = kernel_times(run)
    return (sum(sum(v) for v in times.values()) / DEVICE_STEPS / 1e3,
            sum(len(v) for v in times.values()) / DEVICE_STEPS)


def arm_order(arms: List[Any], rnd: int) -> List[Any]:
    """Round ``rnd``'s order: the arms rotated by ``rnd``, so that no arm
    always runs right after the same other one (an order effect in the host's
    state would otherwise favour one arm every round)."""
    shift = rnd % len(arms)
    return arms[shift:] + arms[:shift]


def run(model, prompt: mx.array, arms, tokens: int, rounds: int, greedy: int) -> Dict[str, Any]:
    from mlx_lm.models.cache import make_prompt_cache

    from bench.diagnostics.decode.decode_split import generate_token_ms

    originals = {(m, n): getattr(importlib.import_module(m), n) for _, settings in arms for m, n, _ in settings}
    rows = {label: {"settings": {f"{m}.{n}": repr(v) for m, n, v in settings}, "ms_per_token": [],
                    "gpu_ms_per_token": [], "kernels_per_token": [], "greedy": None} for label, settings in arms}
    try:
        for rnd in range(rounds):
            for label, settings in arm_order(arms, rnd):
                _apply(settings, originals)
                dropped = drop_compiled_steps(model)
                _greedy(model, prompt, 4)  # traces the step under this arm
                ms = statistics.median(generate_token_ms(model, prompt, make_prompt_cache(model), tokens))
                gpu, kernels = _device(model, prompt)
                row = rows[label]
                row["ms_per_token"].append(round(ms, 3))
                if gpu is not None:
                    row["gpu_ms_per_token"].append(round(gpu, 4))
                    row["kernels_per_token"].append(round(kernels, 1))
                if rnd == 0 and greedy:
                    row["greedy"] = _greedy(model, prompt, greedy)
                log(f"round {rnd + 1}, {label} ({dropped} compiled steps dropped): {ms:.2f} ms a token"
                    + (f", device {gpu:.3f} ms, {kernels:.1f} kernels" if gpu is not None else ""))
    finally:
        _apply([], originals)
        drop_compiled_steps(model)
    first = rows[arms[0][0]]["greedy"]
    for row in rows.values():
        row["greedy_same_as_first_arm"] = None if first is None else row["greedy"] == first
        for key in ("ms_per_token", "gpu_ms_per_token", "kernels_per_token"):
            row[f"median_{key}"] = statistics.median(row[key]) if row[key] else None
    return rows


def markdown(record: Dict[str, Any]) -> str:
    lines = [f"# Decode A/B: {record['shape']}, context {record['context']}, {record['rounds']} rounds alternated"
             " (each round's order rotated by one)", "",
             "| arm | settings | ms per token (each round) | median | device ms | kernels | greedy = first arm |",
             "|---|---|---|---:|---:|---:|---|"]
    for label, r in record["arms"].items():
        settings = "; ".join(f"`{k}={v}`" for k, v in r["settings"].items()) or "defaults"
        fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
        same = {None: "", True: "yes", False: "NO"}[r["greedy_same_as_first_arm"]]
        lines.append(f"| {label} | {settings} | {', '.join(f'{x:.2f}' for x in r['ms_per_token'])} | "
                     f"{fmt(r['median_ms_per_token'], '.2f')} | {fmt(r['median_gpu_ms_per_token'], '.3f')} | "
                     f"{fmt(r['median_kernels_per_token'], '.1f')} | {same} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", action="append", required=True,
                        help="LABEL:MODULE.NAME=VALUE[;...] (two or more; LABEL: alone for the defaults)")
    parser.add_argument("--shape", default="qwen3.6-35b-a3b", help="random model shape (default qwen3.6-35b-a3b)")
    parser.add_argument("--model", default=None, help="a checkpoint folder instead of random weights")
    parser.add_argument("--conditioned", action="store_true", help="random weights conditioned for stable greedy tokens")
    parser.add_argument("--context", default="4K", help="prompt tokens before decoding (default 4K)")
    parser.add_argument("--tokens", type=int, default=48, help="decode tokens timed per arm and round (default 48)")
    parser.add_argument("--rounds", type=int, default=3, help="times the arms are alternated (default 3)")
    parser.add_argument("--greedy", type=int, default=64, help="greedy tokens compared across arms (0: none)")
    parser.add_argument("--out", default=None, help="folder for decode-ab.json/.md")
    args = parser.parse_args(argv)
    try:
        arms = [parse_arm(a) for a in args.arm]
        context = parse_length(args.context)
    except ValueError as exc:
        parser.error(str(exc))
    if len(arms) < 2 or len({label for label, _ in arms}) != len(arms):
        parser.error("--arm: two or more, each with its own label")
    if args.tokens < 2 or args.rounds < 1 or args.greedy < 0:
        parser.error("--tokens at least 2, --rounds at least 1, --greedy 0 or more")

    from bench.engines import load_shared, switch
    from bench.measure import prompt_array

    t0 = time.perf_counter()
    model, vocab, _, note = load_shared({"model": args.model, "shape": args.shape, "seed": 0,
                                        "conditioned": args.conditioned})
    if note:
        log(note)
    switch(model, "lily")
    log(f"model ready in {time.perf_counter() - t0:.0f} s")
    prompt = prompt_array(context, vocab)
    record = {"command": "python -m bench.diagnostics.decode.decode_ab " + " ".join(sys.argv[1:] if argv is None else argv),
              "shape": args.model or args.shape, "context": context, "tokens": args.tokens, "rounds": args.rounds,
              "arms": run(model, prompt, arms, args.tokens, args.rounds, args.greedy)}
    write_report(args.out, "decode-ab.md", markdown(record))
    write_json(args.out, "decode-ab.json", record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
