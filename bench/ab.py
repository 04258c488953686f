"""The A/B benchmark: lily vs stock mlx-lm, prefill and decode across context
lengths, plus teacher-forced numerics. ``python -m bench --help``.

Layout of a run (see README.md for the why):

* fresh-process mode (default): every arm (engine x length x round) is a
  subprocess running this tool with ``--worker``; it loads the model, warms up
  at the arm's exact shape, measures, and writes JSON back;
* ``--same-process``: one process builds the model once, switches it between
  the engines with ``specialize()``, warms each engine up once and measures
  every length.

Rounds alternate the engine order (ABBA); the report takes the median.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

if __package__ in (None, ""):  # `python bench/ab.py` as well as `python -m bench`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    DECODE_STEPS,
    PREFILL_STEP,
    REPO_ROOT,
    Progress,
    length_label,
    log,
    machine_info,
    now_iso,
    op_paths,
    parse_lengths,
    software_info,
)
from bench.engines import ENGINES  # noqa: E402

DEFAULT_LENGTHS = "256,512,1K,2K,4K,8K,16K,32K,64K,128K"
MIN_NUMERICS_TOKENS = 192
# Progress weights: a fixed cost per arm (process start, load, warmup)
# expressed in prompt tokens, plus the prompt itself.
ARM_FIXED_WEIGHT = 2048


EXAMPLES = """\
examples:
  python -m bench --lengths 256,1K --rounds 2              # demo shape, CPU-sized
  python -m bench --shape qwen3.6-35b-a3b --same-process --lengths 256,1K,4K --rounds 1
  python -m bench --model mlx-community/SOME-QWEN3.6-CHECKPOINT --lengths 1K,8K,32K
  python -m bench --ops                                     # per-op timings, real shapes
  python -m bench --oracle --shape qwen3.6-35b-a3b          # both engines against an fp32 oracle
  python -m bench --ops --shape demo --ops-chunk 64 --lengths 32,64   # tiny, for tests

outputs go to --out as ab-<date>-<host>-<chip>-<git rev>.{json,md,png}
(ops-... for --ops); progress goes to stderr, the table to stdout.
"""


# -------------------------------------------------------------- planning


def engine_order(round_index: int) -> Tuple[str, str]:
    """ABBA: lily first in even rounds, stock first in odd ones."""
    return ENGINES if round_index % 2 == 0 else ENGINES[::-1]


def fresh_plan(lengths: List[int], rounds: int) -> List[Tuple[int, str, int]]:
    """(round, engine, length) for every arm, in run order."""
    return [(r, e, n) for r in range(rounds) for n in lengths for e in engine_order(r)]


def _source(args: argparse.Namespace) -> Dict[str, Any]:
    if args.model:
        return {"model": args.model, "shape": None, "seed": args.seed}
    return {"model": None, "shape": args.shape or "demo", "seed": args.seed,
            "conditioned": args.conditioned}


# ----------------------------------------------------------- worker side


def worker_main(spec_path: str, out_path: str) -> int:
    """One task in this (fresh) process; the result goes to ``out_path``."""
    spec = json.loads(Path(spec_path).read_text())
    if spec["task"] == "arm":
        result = run_arm_here(spec)
    elif spec["task"] == "numerics":
        result = run_numerics_here(spec["source"], spec["tokens"])
    else:
        raise ValueError(f"unknown worker task {spec['task']!r}")
    Path(out_path).write_text(json.dumps(result))
    return 0


def run_arm_here(spec: Dict[str, Any]) -> Dict[str, Any]:
    from bench.engines import load_engine
    from bench.measure import measure_arm, warmup

    model, vocab, load_s = load_engine(spec["source"], spec["engine"])
    warmup_s = warmup(model, spec["length"], vocab)
    result = measure_arm(model, spec["length"], vocab, spec["decode_steps"], gpu_clocks=spec.get("gpu_clocks", False),
                         gpu_time=spec.get("gpu_time", True))
    result.update(load_s=load_s, warmup_s=warmup_s, op_paths=op_paths())
    return result


def run_numerics_here(source: Dict[str, Any], n_tokens: int, model=None, vocab=None) -> Dict[str, Any]:
    """Both engines score the same sequence on one set of weights."""
    import mlx.core as mx

    from bench.common import prompt_ids
    from bench.engines import lily_layer_count, load_shared, switch
    from bench.measure import compare, score, supports_input_embeddings

    note = None
    if model is None:
        model, vocab, _, note = load_shared(source)
    ids = prompt_ids(n_tokens, vocab)
    tokens = mx.array(ids)
    logprobs, layers = {}, {}
    for engine in ENGINES:
        switch(model, engine)
        layers[engine] = lily_layer_count(model)
        logprobs[engine] = score(model, tokens)
    result = compare(logprobs["lily"], logprobs["stock"], ids)
    # The noise floor: stock against itself with its first input nudged by one
    # bf16 step. A random model can be chaotic (it was at the real shapes):
    # then rounding-sized differences alone move every later position, and
    # lily's figures are to be read against this floor.
    if supports_input_embeddings(model):
        nudged = score(model, tokens, nudge_first=True)
        floor = compare(nudged, logprobs["stock"], ids)
        result["noise_floor"] = {k: floor[k] for k in ("top1_agreement", "kl_mean", "kl_max", "ppl_rel_diff")}
    # Shows that the two scorings really ran different layer classes.
    result["lily_layers"] = layers
    if note:
        result["note"] = note
    return result


# ----------------------------------------------------------- parent side


def _run_worker(spec: Dict[str, Any], workdir: Path, name: str) -> Dict[str, Any]:
    """Run one worker subprocess; its result, or {'error': ...}."""
    spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ)
    # The project is used from its checkout (not pip-installed on the GPU box).
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in [str(REPO_ROOT), env.get("PYTHONPATH", "")] if p
    )
    cmd = [sys.executable, "-m", "bench", "--worker", str(spec_path), "--worker-out", str(out_path)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0 or not out_path.exists():
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-15:]
        log(f"worker {name} failed (exit {proc.returncode}):\n    " + "\n    ".join(tail))
        last = tail[-1] if tail else "no output"
        return {"error": f"worker exited with {proc.returncode}: {last}", "stderr_tail": tail,
                "wall_s": wall}
    result = json.loads(out_path.read_text())
    result["wall_s"] = wall
    return result


def _arm_line(result: Dict[str, Any]) -> str:
    if "error" in result:
        return "FAILED"
    return (
        f"prefill {result['prefill_tps']:.1f} tok/s, decode {result['decode_tps']:.2f} tok/s, "
        f"peak memory {result['peak_memory_bytes'] / 2**30:.2f} GiB, tokens {result['digest']}"
        + _clocks_note(result.get("decode_gpu_clocks"))
    )


def _clocks_note(clocks: Optional[Dict[str, Any]]) -> str:
    """The decode's GPU clocks for the arm's log line, where they were asked for."""
    from bench.gpu_clocks import NOT_ASKED, describe

    if not clocks or clocks.get("unavailable") == NOT_ASKED:
        return ""

    return f"; decode: {describe(clocks)}"


def run_fresh(args: argparse.Namespace, lengths: List[int]) -> Dict[str, Any]:
    source = _source(args)
    plan = fresh_plan(lengths, args.rounds)
    weights = [n + ARM_FIXED_WEIGHT for _, _, n in plan]
    if args.numerics:
        weights.append(args.numerics_tokens + ARM_FIXED_WEIGHT)
    progress = Progress(weights)
    arms, numerics = [], None
    with tempfile.TemporaryDirectory(prefix="lily-bench-") as tmp:
        for i, (r, engine, n) in enumerate(plan):
            log(f"arm {i + 1}/{len(plan)}: round {r + 1} {engine} length {length_label(n)} "
                f"(fresh process; {progress.status()})")
            spec = {"task": "arm", "source": source, "engine": engine, "length": n,
                    "decode_steps": args.decode_steps, "gpu_clocks": args.gpu_clocks,
                    "gpu_time": not args.no_gpu_time}
            result = _run_worker(spec, Path(tmp), f"arm{i}")
            result.update(round=r, engine=engine, length=n, order=i)
            arms.append(result)
            progress.finish(n + ARM_FIXED_WEIGHT)
            log(f"  {engine} {length_label(n)}: {_arm_line(result)}")
        if args.numerics:
            log(f"numerics: both engines score {args.numerics_tokens} tokens ({progress.status()})")
            spec = {"task": "numerics", "source": source, "tokens": args.numerics_tokens}
            numerics = _run_worker(spec, Path(tmp), "numerics")
    return {"arms": arms, "warmups": [], "numerics": numerics, "load": None}


def run_same_process(args: argparse.Namespace, lengths: List[int]) -> Dict[str, Any]:
    from bench.engines import load_shared, switch
    from bench.measure import warmup

    source = _source(args)
    warm_len = args.warmup_length or min(max(lengths), 4096)
    per_arm = 2 if args.warmup_each else 1  # prompt passes per arm
    weights = [per_arm * n + 256 for _ in range(args.rounds) for _ in ENGINES for n in lengths]
    weights += [warm_len + ARM_FIXED_WEIGHT] * len(ENGINES)
    if args.numerics:
        weights.append(args.numerics_tokens + 256)
    progress = Progress(weights)

    log(f"building/loading the model once ({source['model'] or source['shape']})")
    model, vocab, load_s, note = load_shared(source)
    if note:
        log(note)
    log(f"model ready in {load_s:.1f}s")
    # Both engines warm up before anything is measured, so neither engine's
    # first arms run in a process the other engine has not warmed yet.
    warmups = []
    for engine in engine_order(0):
        switch(model, engine)
        log(f"warmup {engine} at length {length_label(warm_len)} ({progress.status()})")
        seconds = warmup(model, warm_len, vocab)
        warmups.append({"engine": engine, "length": warm_len, "seconds": seconds})
        progress.finish(warm_len + ARM_FIXED_WEIGHT)
        log(f"  warmup {engine}: {seconds:.1f}s")
    unwarmed = [n for n in lengths if n != warm_len]
    if unwarmed and not args.warmup_each:
        log("note: lengths " + ", ".join(map(length_label, unwarmed)) + " run prompt shapes the "
            "warmup did not; where a backend compiles per shape, round 1 pays for it there "
            "(compare rounds, or add --warmup-each)")
    arms = []
    order = 0
    for r in range(args.rounds):
        for engine in engine_order(r):
            switch(model, engine)
            for n in lengths:
                log(f"arm {order + 1}/{args.rounds * len(ENGINES) * len(lengths)}: round {r + 1} "
                    f"{engine} length {length_label(n)} (same process; {progress.status()})")
                start = time.perf_counter()
                result = _guarded(lambda: _same_process_arm(model, n, vocab, args))
                result.update(round=r, engine=engine, length=n, order=order,
                              wall_s=time.perf_counter() - start)
                arms.append(result)
                order += 1
                progress.finish(per_arm * n + 256)
                log(f"  {engine} {length_label(n)}: {_arm_line(result)}")
    numerics = None
    if args.numerics:
        log(f"numerics: both engines score {args.numerics_tokens} tokens ({progress.status()})")
        numerics = _guarded(lambda: run_numerics_here(source, args.numerics_tokens, model, vocab))
        if note and "error" not in numerics:
            numerics["note"] = note
    return {"arms": arms, "warmups": warmups, "numerics": numerics,
            "load": {"seconds": load_s, "note": note}}


def _same_process_arm(model, n: int, vocab: int, args: argparse.Namespace) -> Dict[str, Any]:
    from bench.measure import measure_arm, warmup

    depth = args.depth_from is not None and n > args.depth_from
    tail = min(args.depth_tail, n)
    warmup_s = warmup(model, tail if depth else n, vocab) if args.warmup_each else None
    if not depth:
        result = measure_arm(model, n, vocab, args.decode_steps, gpu_clocks=args.gpu_clocks,
                             gpu_time=not args.no_gpu_time)
    else:
        from bench.measure import lily_prefilled_cache

        cache = lily_prefilled_cache(model, vocab, n - tail)
        result = measure_arm(model, n, vocab, args.decode_steps, cache=cache, timed_from=n - tail,
                             gpu_clocks=args.gpu_clocks, gpu_time=not args.no_gpu_time)
        result["prefill_method"] = f"last {tail} tokens at depth {n - tail} (lily prefilled the rest, untimed)"
    result["warmup_s"] = warmup_s
    return result


def _guarded(fn) -> Dict[str, Any]:
    """Run a measurement; a failure (e.g. out of memory at 128K) is recorded
    for that arm and the run goes on."""
    try:
        return fn()
    except Exception as exc:  # noqa: BLE001 - any failure becomes a flagged arm
        import gc

        import mlx.core as mx

        log(f"  failed: {type(exc).__name__}: {exc}")
        gc.collect()  # drop the failed arm's cache before the next one
        mx.clear_cache()
        return {"error": f"{type(exc).__name__}: {exc}"}


# ------------------------------------------------------------ command line


def build_parser() -> argparse.ArgumentParser:
    from mlx_lily.random_checkpoints import SHAPES

    p = argparse.ArgumentParser(
        prog="python -m bench",
        description=(
            "A/B benchmark of mlx-lily's 'lily' backend against stock mlx-lm: prefill and "
            "decode throughput across context lengths (batch 1, greedy), plus teacher-forced "
            "numerics. With --ops, times each lily op against its stock counterpart instead. "
            "Run from the repository root. Method and output: bench/README.md."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=EXAMPLES,
    )
    what = p.add_argument_group("model (random weights with a fixed seed unless --model)")
    what.add_argument("--model", help="a local checkpoint folder or hub repo id, loaded through mlx-lm "
                           "(each engine loads it the way mlx_lily.load does)")
    what.add_argument("--shape", choices=sorted(SHAPES), default=None,
                      help="generate a random qwen3_5_moe model in memory "
                           "(default: demo; with --ops: qwen3.6-35b-a3b)")
    what.add_argument("--seed", type=int, default=0, help="seed for generated weights (default: 0)")
    what.add_argument("--conditioned", action="store_true",
                      help="generated shapes: a well-conditioned random model (residual branches "
                           "and routers scaled, as in trained models) whose outputs are not chaotic "
                           "in rounding; see bench/README.md")

    how = p.add_argument_group("method")
    how.add_argument("--lengths", default=None,
                     help=f"comma-separated lengths, K = 1024 (default: {DEFAULT_LENGTHS}; "
                          "with --ops: attention contexts, default 256,4K,32K)")
    how.add_argument("--rounds", type=int, default=2,
                     help="rounds (default: 2); engine order alternates each round (ABBA); "
                          "the median is reported")
    how.add_argument("--same-process", action="store_true",
                     help="run everything in one process: build once, switch engines with "
                          "specialize(), one warmup per engine (for backends whose first "
                          "forward JIT-compiles for minutes)")
    how.add_argument("--warmup-length", type=str, default=None,
                     help="--same-process: the warmup's prompt length (default: the largest "
                          "length, capped at 4K)")
    how.add_argument("--warmup-each", action="store_true",
                     help="--same-process: also warm up at each arm's exact length")
    how.add_argument("--depth-from", type=str, default=None,
                     help="--same-process: lengths above this (K = 1024) time the prefill of "
                          "their last --depth-tail tokens only, after the rest is prefilled by "
                          "lily (untimed) for both engines; decode as usual. For long contexts, "
                          "where stock's whole prefill would take minutes (bench/README.md)")
    how.add_argument("--depth-tail", type=int, default=PREFILL_STEP,
                     help=f"--depth-from: tokens timed at depth (default: {PREFILL_STEP}, one chunk)")
    how.add_argument("--decode-steps", type=int, default=DECODE_STEPS,
                     help=f"measured decode steps per arm (default: {DECODE_STEPS}, the "
                          "method's; change only for tests and quick checks)")
    how.add_argument("--no-gpu-time", action="store_true",
                     help="skip the kernels' device time per decode token (bench/gpu_time.py: CUPTI through "
                          "PyTorch on NVIDIA, a few more decode steps per arm)")
    how.add_argument("--gpu-clocks", action="store_true",
                     help="sample the GPU's clocks, power and load with nvidia-smi during each arm's "
                          "decode (bench/gpu_clocks.py), into the arm's JSON and log line")
    how.add_argument("--numerics", action=argparse.BooleanOptionalAction, default=True,
                     help="teacher-forced numerics: top-1 agreement, perplexities, KL (default: on)")
    how.add_argument("--numerics-tokens", type=int, default=256,
                     help=f"positions scored for numerics (default: 256, at least {MIN_NUMERICS_TOKENS})")

    ops = p.add_argument_group("per-op timings")
    ops.add_argument("--ops", action="store_true",
                     help="time each lily op against its stock reference instead of the A/B run")
    ops.add_argument("--ops-chunk", type=int, default=PREFILL_STEP,
                     help=f"--ops: tokens per prefill chunk (default: {PREFILL_STEP})")

    oracle = p.add_argument_group("numerics against an fp32 oracle")
    oracle.add_argument("--oracle", action="store_true",
                        help="compare both engines, end to end and layer by layer, with the same "
                             "model in fp32 activations on the CPU instead of the A/B run")
    oracle.add_argument("--oracle-tokens", type=int, default=128,
                        help="--oracle: positions (default: 128)")
    oracle.add_argument("--oracle-device", choices=("cpu", "gpu"), default="cpu",
                        help="--oracle: where the fp32 oracle runs (default: cpu, deterministic)")

    out = p.add_argument_group("output")
    out.add_argument("--out", default=str(REPO_ROOT / "bench" / "out"),
                     help="folder for the JSON, Markdown table and PNG plot (default: bench/out)")
    out.add_argument("--no-plot", action="store_true", help="skip the PNG plot")

    # Internal: how the parent runs one arm in a fresh process.
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    return p


def _settings(args: argparse.Namespace, lengths: List[int]) -> Dict[str, Any]:
    return {
        "mode": "same-process" if args.same_process else "fresh-process",
        "model": args.model,
        "shape": None if args.model else (args.shape or "demo"),
        "seed": args.seed,
        "conditioned": bool(args.conditioned),
        "lengths": lengths,
        "rounds": args.rounds,
        "engine_order": [list(engine_order(r)) for r in range(args.rounds)],
        "decode_steps": args.decode_steps,
        "gpu_clocks": bool(args.gpu_clocks),
        "decode_steps_is_method_default": args.decode_steps == DECODE_STEPS,
        "prefill_step_size": PREFILL_STEP,
        "batch_size": 1,
        "sampler": "greedy",
        "prompt": "token i = ((i * 2654435761) mod 2**32) mod vocab_size",
        "warmup": (
            f"one per engine at length {args.warmup_length or min(max(lengths), 4096)}"
            + (", plus each arm's exact length" if args.warmup_each else "")
            if args.same_process
            else "each arm: its exact prompt length, 8 decode steps"
        ),
        "numerics": args.numerics,
        "numerics_tokens": args.numerics_tokens,
        "depth_from": args.depth_from,
        "depth_tail": args.depth_tail if args.depth_from is not None else None,
    }


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        return worker_main(args.worker, args.worker_out)
    if args.model and args.shape:
        raise SystemExit("give --model or --shape, not both")
    if args.model and args.conditioned:
        raise SystemExit("--conditioned applies to generated shapes (--shape), not --model")
    if args.ops:
        from bench.ops import run_ops

        return run_ops(args)
    if args.oracle:
        from bench.oracle import run_oracle

        if args.oracle_tokens < 2:
            raise SystemExit("--oracle-tokens must be at least 2")
        return run_oracle(args)

    lengths = parse_lengths(args.lengths or DEFAULT_LENGTHS)
    if args.warmup_length is not None:
        args.warmup_length = parse_lengths(args.warmup_length)[0]
    if args.rounds < 1 or args.decode_steps < 1:
        raise SystemExit("--rounds and --decode-steps must be at least 1")
    if args.depth_from is not None:
        if not args.same_process:
            raise SystemExit("--depth-from needs --same-process (lily prefills for both engines)")
        args.depth_from = parse_lengths(args.depth_from)[0]
        if args.depth_tail < 1:
            raise SystemExit("--depth-tail must be at least 1")
    if args.numerics and args.numerics_tokens < MIN_NUMERICS_TOKENS:
        raise SystemExit(f"--numerics-tokens must be at least {MIN_NUMERICS_TOKENS}")
    if args.decode_steps != DECODE_STEPS:
        log(f"note: {args.decode_steps} decode steps (the method's is {DECODE_STEPS})")

    from bench import report

    started = now_iso()
    machine, software = machine_info(), software_info()
    runner = run_same_process if args.same_process else run_fresh
    results = runner(args, lengths)
    doc = {
        "tool": "mlx-lily bench (A/B)",
        "schema": 1,
        "started": started,
        "finished": now_iso(),
        "machine": machine,
        "software": software,
        "settings": _settings(args, lengths),
        "op_paths": op_paths(),
        **results,
    }
    report.finish_ab(doc, Path(args.out), plot=not args.no_plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
