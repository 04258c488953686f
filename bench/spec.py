"""``python -m bench --spec``: speculative decoding with the MTP head, bounded
without trained weights (issue 28, item 5).

At a given context it measures greedy decode tok/s without drafts (the
baseline), then the MTP loop (``mlx_lily.mtp_decode``) at k = 1..3 with three
kinds of drafts: the checkpoint's head (random weights: about nothing
accepted), an *oracle* (the baseline's own continuation: every draft
accepted) and an *adversarial* draft (the oracle's token + 1: none
accepted); every run's tokens are compared with the baseline's. Then the
cost of a verify pass over 2, 3 and 4 positions (``mtp_decode._verify``) relative to
one decode step, from which it projects the speedup at any acceptance rate:
a round of k drafts costs verify(k + 1) and yields (1 - a^(k+1)) / (1 - a)
tokens at per-draft acceptance a (the head's own k calls not counted).

Every row runs ``--rounds`` times, in passes, each run bracketed by two
baseline runs: a row's ratio is its tok/s over the baseline's around it
(their mean time per token), its speedup the median of its ratios, so a host
whose speed drifts within seconds (the H200's does, by up to 1.8x within
one process) moves both sides of each ratio.

Writes ``spec-<label>-<context>.json`` (``summary`` rows {draft, k, decode_tps
(median over passes), baseline_decode_tps (the median of every baseline
run), speedup, speedups (each pass's ratio), tokens_identical (in every pass), accepted, rounds, plain (tokens
decoded without drafts while drafting paused, ``mtp_decode.PAUSE_AFTER_MISSES``;
these three summed over passes),
round_ms: the host's ms per round building the drafts, building the verify
pass, submitting a round built ahead, waiting for the GPU, accepting, and
(where every token came from a round) the rest of the round's wall time;
round_ms_by_pass: those parts but the rest, pass by pass; baseline_around_by_pass:
each pass's baseline tok/s (the mean of the two runs around the row),
plain_token_ms: the median ms from the token before to each token decoded
while drafting paused (None without such tokens)},
``verify_cost`` rows {positions, ms, ratio}, ``projected`` rows
{acceptance, k, speedup}; with --profile, ``profile`` rows {draft, k, per,
kernels, gpu_ms}: per decode token without drafts, per oracle round at each
k, per token of an adversarial run at the first k) under --out and prints
the tables.

    python -m bench --spec --shape qwen3.6-35b-a3b --context 4K     # H200
    python -m bench --spec --shape demo --context 64 --decode-steps 8  # CPU
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

import mlx.core as mx

from bench.common import length_label, parse_length, prompt_ids, run_with_settings

DRAFTS = ("mtp", "oracle", "adversarial")
ACCEPTANCE = (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.95)


def _decode_tps(tokens_and_times: List[float]) -> float:
    """Tokens after the first per second (the first token closes the prefill)."""
    times = tokens_and_times
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else 0.0


def baseline(model: Any, prompt: mx.array, steps: int):
    from mlx_lm.generate import generate_step

    tokens, times = [], []
    for token, _ in generate_step(prompt, model, max_tokens=steps):
        tokens.append(int(token))
        times.append(time.perf_counter())
    return tokens, _decode_tps(times)


def speculative(model: Any, prompt: mx.array, steps: int, k: int, draft: str, want: List[int], vocab: int,
                prompt_cache: Any = None):
    """(tokens, decode tok/s, the loop's stats) of one MTP run. ``want``: the
    baseline's tokens from the first generated one on (the oracle's drafts);
    ``prompt_cache``: caches already holding the tokens before ``prompt``."""
    from mlx_lily.mtp_decode import mtp_generate_step

    def oracle(done: int, drafts: List[int]) -> List[int]:
        out = [want[done + i] if done + i < len(want) else 0 for i in range(k)]
        return out if draft == "oracle" else [(t + 1) % vocab for t in out]

    from mlx_lm.generate import generation_stream

    stats: Dict[str, Any] = {"seconds": {}}
    tokens, times = [], []
    # Seconds from the token before to each plain token (decoded without
    # drafts while drafting pauses): the loop counts it before yielding it.
    plain_gaps: List[float] = []
    plain_seen = 0
    # On mlx-lm's generation stream, as generate_step (the baseline) and the
    # commands' MTP loop (mtp_decode.generate_step) run.
    with mx.stream(generation_stream):
        for token, _, _ in mtp_generate_step(prompt, model, num_draft_tokens=k, max_tokens=steps, stats=stats,
                                             prompt_cache=prompt_cache,
                                             draft_hook=None if draft == "mtp" else oracle):
            tokens.append(int(token))
            times.append(time.perf_counter())
            if stats["plain"] > plain_seen:
                plain_seen = stats["plain"]
                if len(times) > 1:
                    plain_gaps.append(times[-1] - times[-2])
    stats["plain_gaps_s"] = plain_gaps
    return tokens, _decode_tps(times), stats


def _plain_token_ms(passes: List[tuple]) -> Any:
    """Median ms from the token before to a plain token (drafting paused),
    over the passes' runs; None where no token was plain. Set beside the
    baseline's ms per token, it says whether a pause's tokens cost what
    plain decoding costs."""
    gaps = [g for p in passes for g in p[2].get("plain_gaps_s", [])]
    return round(1e3 * statistics.median(gaps), 4) if gaps else None


# Kernel names in the profile, cut to this many characters (MLX's names
# carry their template arguments; lily's their source's hash).
NAME_CHARS = 72
# Kernels printed per round: those a round launches most beyond one token.
ADDED_SHOWN = 12


def _tally(kernels: Dict[str, List[float]], per: int) -> Dict[str, Any]:
    """Launches and device ms per unit (token or round) of a profiled run,
    and launches per unit by kernel name, most first."""
    calls: Dict[str, float] = {}
    for name, times in kernels.items():
        calls[name[:NAME_CHARS]] = calls.get(name[:NAME_CHARS], 0.0) + len(times) / per
    return {"kernels": round(sum(calls.values()), 1),
            "gpu_ms": round(sum(sum(v) for v in kernels.values()) / 1e3 / per, 4),
            "by_kernel": {name: round(n, 2) for name, n in sorted(calls.items(), key=lambda kv: -kv[1])}}


def gpu_profile(model: Any, prompt: mx.array, steps: int, ks: List[int], want: List[int], vocab: int) -> Dict[str, Any]:
    """Kernels and device ms per decode token without drafts, per oracle
    round (every draft kept) at each k, and per token of an adversarial run
    (no draft kept) at the first k, recorded by the CUDA profiler
    (``bench.gpu_time``) over ``steps`` tokens; the prompt but its last token
    is prefilled outside the recording. Where kernels cannot be timed here:
    the reason."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from bench.gpu_time import kernel_times, why_unavailable

    why = why_unavailable()
    if why is not None:
        return {"note": why}

    def prefilled() -> List[Any]:
        cache = make_prompt_cache(model)
        model(prompt[None, :-1], cache=cache)
        mx.eval([c.state for c in cache])
        return cache

    cache = prefilled()
    kernels = kernel_times(lambda: list(generate_step(prompt[-1:], model, max_tokens=steps, prompt_cache=cache)))
    rows = [{"draft": "none", "k": 0, "per": "token", **_tally(kernels, steps)}]
    for k in ks:
        cache, runs = prefilled(), []
        kernels = kernel_times(lambda: runs.append(
            speculative(model, prompt[-1:], steps, k, "oracle", want, vocab, cache)))
        rounds = runs[0][2]["rounds"]
        rows.append({"draft": "oracle", "k": k, "per": "round", "rounds": rounds, **_tally(kernels, max(1, rounds))})
    # The adversarial draft at the first k, per emitted token: mostly the
    # plain tokens of paused drafting, whose wall time is above the
    # baseline's; this says whether their GPU work is too.
    k = ks[0]
    cache, runs = prefilled(), []
    kernels = kernel_times(lambda: runs.append(
        speculative(model, prompt[-1:], steps, k, "adversarial", want, vocab, cache)))
    stats = runs[0][2]
    rows.append({"draft": "adversarial", "k": k, "per": "token", "rounds": stats["rounds"], "plain": stats["plain"],
                 **_tally(kernels, max(1, len(runs[0][0])))})
    return {"rows": rows}


def verify_costs(model: Any, prompt: mx.array, reps: int) -> List[Dict[str, float]]:
    """ms of a verify pass over 2..4 positions after the prompt, as the MTP
    loop runs it (``mtp_decode._verify``: on lily's decode kernels where every
    layer takes them), against one decode step (the model's one-token call);
    the caches trimmed back after each. The widths take turns, one call each
    per repetition (after one untimed call each), and a width's ratio is the
    median over repetitions of its time over the same repetition's decode
    step: a host that drifts during the measurement moves both."""
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_lily.mtp_decode import _verify
    from mlx_lily.trimmable_cache import make_plain, make_trimmable

    cache = make_prompt_cache(model)
    model(prompt[None], cache=cache)
    mx.eval([c.state for c in cache])
    make_trimmable(cache, depth=5)
    widths = (1, 2, 3, 4)
    samples: Dict[int, List[float]] = {p: [] for p in widths}

    def timed(positions: int) -> float:
        ys = prompt[:positions]
        tic = time.perf_counter()
        mx.eval(model(ys[None], cache=cache) if positions == 1 else _verify(model, ys, cache))
        seconds = time.perf_counter() - tic
        for c in cache:
            c.trim(positions)
        return seconds

    try:
        for positions in widths:  # the first call of each builds and warms
            timed(positions)
        for _ in range(reps):
            for positions in widths:
                samples[positions].append(timed(positions))
    finally:
        make_plain(cache)
    rows = []
    for p in widths[1:]:
        ratios = [t / one for t, one in zip(samples[p], samples[1])]
        rows.append({"positions": p, "ms": round(1e3 * statistics.median(samples[p]), 4),
                     "ratio": round(statistics.median(ratios), 4)})
    return rows


def projected(costs: List[Dict[str, float]], ks=(1, 2, 3)) -> List[Dict[str, float]]:
    ratio = {row["positions"]: row["ratio"] for row in costs}
    rows = []
    for a in ACCEPTANCE:
        for k in ks:
            tokens = (1 - a ** (k + 1)) / (1 - a)
            rows.append({"acceptance": a, "k": k, "speedup": round(tokens / ratio[k + 1], 4)})
    return rows


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench --spec", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="an mlx-lm checkpoint with an MTP head (default: a random one, --shape)")
    parser.add_argument("--shape", default="demo", help="make_checkpoint's shape for the random checkpoint")
    parser.add_argument("--context", default="4K", help="prompt length (e.g. 64, 4K)")
    parser.add_argument("--decode-steps", type=int, default=64, help="tokens generated per run")
    parser.add_argument("--k", default="1,2,3", help="drafts per round to run (1 to 3)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="passes over the rows, each run between two baseline runs (a row's speedup: the "
                             "median over passes of its ratio to the baselines around it; default 3)")
    parser.add_argument("--reps", type=int, default=10, help="calls timed per verify width (median)")
    parser.add_argument("--profile", action="store_true",
                        help="also record kernels and device ms per decode token, per oracle round and per "
                             "adversarial token (CUDA profiler; needs PyTorch with CUDA)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"), help="folder for spec-*.json")
    parser.add_argument("--set", action="append", default=[], metavar="MODULE.NAME=VALUE",
                        help="run with a module constant set (e.g. "
                             "mlx_lily.kernels.moe.decode.ROUTED_MAX_ROWS=4); repeatable, recorded in the JSON")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    return run_with_settings(parser, args.set, lambda settings: _run(args, argv, settings))


def _run(args, argv, settings) -> int:

    import mlx_lily
    from mlx_lily.random_checkpoints import make_checkpoint

    path = args.model or str(make_checkpoint(None, args.shape, mtp=True))
    model, _ = mlx_lily.load(path)
    vocab = model.language_model.args.vocab_size
    context = parse_length(args.context)
    ks = [int(k) for k in args.k.split(",")]
    steps = args.decode_steps
    prompt = mx.array(prompt_ids(context, vocab))

    want, _ = baseline(model, prompt, steps + max(ks))
    want_steps = want[:steps]
    # Untimed: each k's first round builds the head's and the verify pass's
    # kernels and traces, which the first timed run would otherwise carry;
    # an adversarial run then builds the head's calls of a long pause (each
    # width up to mtp_decode.PAUSE_WIDTH_MAX).
    for k in ks:
        speculative(model, prompt, min(steps, 2 * k + 2), k, "mtp", want, vocab)
        speculative(model, prompt, steps, k, "adversarial", want, vocab)
    # Each pass brackets every row between two baseline runs (timed at the
    # runs' length): a row's ratio is its tok/s over the baseline's around it
    # (their mean time per token), and its speedup the median over passes,
    # so a host whose speed drifts within seconds (the H200's does, by up
    # to 1.8x) moves both sides of each ratio.
    bases: List[float] = []
    runs: Dict[tuple, List[tuple]] = {(draft, k): [] for draft in DRAFTS for k in ks}
    for _ in range(args.rounds):
        before = baseline(model, prompt, steps)[1]
        bases.append(before)
        for draft, k in runs:
            tokens, tps, stats = speculative(model, prompt, steps, k, draft, want, vocab)
            after = baseline(model, prompt, steps)[1]
            bases.append(after)
            around = 2.0 / (1.0 / before + 1.0 / after) if before and after else 0.0
            runs[(draft, k)].append((tokens, tps, stats, around))
            before = after
    base_tps = statistics.median(bases)
    summary = []
    for (draft, k), passes in runs.items():
        tps = statistics.median(p[1] for p in passes)
        ratios = [p[1] / p[3] for p in passes if p[3]]
        rounds = sum(p[2]["rounds"] for p in passes)
        seconds: Dict[str, float] = {}
        for p in passes:
            for part, t in p[2]["seconds"].items():
                seconds[part] = seconds.get(part, 0.0) + t
        round_ms = {part: round(1e3 * t / max(1, rounds), 4) for part, t in seconds.items()}
        # Per pass too: the host's speed drifts between passes, and a row's
        # ratio is taken pass by pass.
        round_ms_by_pass = [{part: round(1e3 * t / max(1, p[2]["rounds"]), 4) for part, t in p[2]["seconds"].items()}
                            for p in passes]
        stats = {key: sum(p[2][key] for p in passes) for key in ("accepted", "rounds", "plain")}
        if not any(p[2]["plain"] for p in passes) and rounds and all(p[1] for p in passes):
            # The rest of a round's wall time (the tokens' yields, the
            # caches' trims); only where every token came from a round.
            wall = sum((len(p[0]) - 1) / p[1] for p in passes)
            round_ms["other"] = round(1e3 * wall / rounds - sum(round_ms.values()), 4)
        row = {"draft": draft, "k": k, "decode_tps": round(tps, 3), "baseline_decode_tps": round(base_tps, 3),
               "speedup": round(statistics.median(ratios), 4) if ratios else None,
               "speedups": [round(r, 4) for r in ratios],
               "decode_tps_by_pass": [round(p[1], 3) for p in passes],
               "tokens_identical": all(p[0] == want_steps for p in passes),
               "accepted": stats["accepted"], "rounds": stats["rounds"], "plain": stats["plain"],
               "round_ms": round_ms, "round_ms_by_pass": round_ms_by_pass,
               "baseline_around_by_pass": [round(p[3], 3) for p in passes],
               "plain_token_ms": _plain_token_ms(passes)}
        summary.append(row)
        parts = "  ".join(f"{part} {ms:.2f}" for part, ms in row["round_ms"].items())
        spread = f" (passes {', '.join(f'{r:.3f}' for r in ratios)})" if len(ratios) > 1 else ""
        print(f"{draft:12s} k={k}  {tps:9.2f} tok/s  (baseline {base_tps:.2f})  x{row['speedup']}{spread}  "
              f"accepted {stats['accepted']}/{stats['rounds'] * k}  plain {stats['plain']}"
              + (f" ({row['plain_token_ms']:.2f} ms each, baseline {1e3 / base_tps:.2f})  " if row["plain_token_ms"]
                 else "  ") +
              f"identical {row['tokens_identical']}  "
              f"round ms: {parts}")
    profile = None
    if args.profile:
        profile = gpu_profile(model, prompt, steps, ks, want, vocab)
        if "note" in profile:
            print(f"profile: not recorded ({profile['note']})")
        token = profile.get("rows", [{}])[0].get("by_kernel", {})
        for row in profile.get("rows", []):
            print(f"profile {row['draft']:8s} k={row['k']}  per {row['per']:5s}: {row['kernels']:7.1f} kernels, "
                  f"{row['gpu_ms']:.3f} device ms")
            if row["k"]:
                added = sorted(((n - token.get(name, 0.0), name) for name, n in row["by_kernel"].items()),
                               reverse=True)
                for more, name in added[:ADDED_SHOWN]:
                    if more >= 0.5:
                        print(f"    {more:+6.1f} {name}")
    costs = verify_costs(model, prompt, args.reps)
    for row in costs:
        print(f"verify {row['positions']} positions: {row['ms']:.3f} ms, x{row['ratio']} of one decode step")
    proj = projected(costs, ks=[k for k in (1, 2, 3) if k + 1 <= 4])
    print("projected speedup (acceptance per draft; head's own cost not counted):")
    for a in ACCEPTANCE:
        cells = "  ".join(f"k={r['k']}: x{r['speedup']:.2f}" for r in proj if r["acceptance"] == a)
        print(f"  a={a:.2f}  {cells}")
    at = next(r["speedup"] for r in proj if r["acceptance"] == 0.85 and r["k"] == 1)
    print(f"at acceptance 0.85, k = 1: x{at:.2f}")

    label = Path(args.model).name if args.model else args.shape
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    file = out / f"spec-{label}-{length_label(context)}.json"
    file.write_text(json.dumps({
        "command": "python -m bench --spec " + " ".join(sys.argv[1:] if argv is None else argv),
        "settings": {f"{m}.{n}": repr(v) for m, n, v in settings},
        "machine": {"platform": platform.platform(), "device": str(mx.default_device()),
                    "mlx": mx.__version__},
        "model": path, "context": context, "decode_steps": steps, "rounds": args.rounds,
        "baseline_decode_tps_runs": [round(b, 3) for b in bases],
        "summary": summary, "verify_cost": costs, "profile": profile, "projected": proj,
        "projected_at_0.85_k1": at,
    }, indent=2) + "\n")
    print(f"wrote {file}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
