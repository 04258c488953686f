"""``python -m bench --cold-start``: how long a fresh process takes to its
first token, for lily and for stock mlx-lm.

Each engine runs in two successive fresh processes that share a new, empty
MLX PTX cache folder (``MLX_PTX_CACHE_DIR``) and lily cache folder
(``MLX_LILY_CACHE``): the first process is a first-ever run on the machine,
the second finds what the first left. Each process imports, loads the model
(a checkpoint with ``--model``, else random weights at ``--shape``), prefills
one prompt and decodes a few tokens through mlx-lm's ``generate_step``, and
reports seconds from its start (the parent's spawn) to its first token and
to the end of the reply. Output: ``cold-<date>-<host>-<chip>-<rev>.json``
with ``engines.{lily,mlx}.{first_process_s, second_process_s}`` (to the first
token) beside each process's phases.
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
from typing import Any, Dict, List, Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import REPO_ROOT, file_stem, git_revision, log, machine_info, now_iso, software_info  # noqa: E402

# The JSON's engine names: mlx-lm's --backend values.
ENGINES = {"lily": "lily", "mlx": "stock"}
SPAWN_ENV = "LILY_COLD_START_SPAWNED_AT"


def worker(spec: Dict[str, Any]) -> Dict[str, Any]:
    """One fresh process's run; times are seconds since the parent spawned it."""
    spawned = float(os.environ[SPAWN_ENV])
    import mlx.core as mx

    from bench.engines import load_engine
    from bench.measure import generate, prompt_array

    imported = time.time()
    profiler = None
    if spec.get("profile"):
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    model, vocab, _ = load_engine(spec["source"], spec["engine"])
    loaded = time.time()
    reply = generate(model, prompt_array(spec["prompt"], vocab), spec["decode"])
    done = time.time()
    if profiler is not None:
        import io
        import pstats

        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(60)
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
        Path(spec["profile"]).write_text(text.getvalue())
    result = {
        "import_s": imported - spawned,
        "load_s": loaded - imported,
        "first_token_s": loaded - spawned + reply["prefill_s"],
        "reply_s": done - spawned,
        "prefill_s": reply["prefill_s"],
        "decode_s": reply["decode_s"],
        "tokens": reply["tokens"],
        "peak_memory_gb": mx.get_peak_memory() / 2**30,
    }
    if spec["engine"] == "lily":
        result["lily"] = lily_counters()
    return result


def lily_counters() -> Dict[str, Any]:
    """What lily's kernels cost this process: first-use checks, instances
    launched, and the CUDA module cache's compiles."""
    from mlx_lily.toolchain import cuda_cache, tracing
    from mlx_lily.toolchain.kernel import KERNELS

    instances = {(kernel.name,) + key for kernel in KERNELS.values() for key in kernel.launched}
    counters: Dict[str, Any] = {"first_use": tracing.FIRST_USE_TIME.as_dict(), "instances": len(instances)}
    cache = cuda_cache._CACHE[0] if cuda_cache._CACHE else None
    if cache is not None:
        counters["cuda_cache"] = {"compiled": cache.compiled, "found": cache.found,
                                  "compile_s": round(cache.compile_s, 3), "folder": str(cuda_cache.ptx_dir())}
    return counters


def run_process(spec: Dict[str, Any], env: Dict[str, str], workdir: Path, name: str,
                timeout: float) -> Dict[str, Any]:
    spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO_ROOT), env.get("PYTHONPATH", "")] if p)
    env[SPAWN_ENV] = repr(time.time())
    cmd = [sys.executable, "-m", "bench.cold_start", "--worker", str(spec_path), "--worker-out", str(out_path)]
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"no reply within {timeout:.0f} s"}
    if proc.returncode != 0 or not out_path.exists():
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-12:]
        log(f"{name} failed (exit {proc.returncode}):\n    " + "\n    ".join(tail))
        return {"error": f"exit {proc.returncode}: {tail[-1] if tail else 'no output'}", "stderr_tail": tail}
    result = json.loads(out_path.read_text())
    result["notices"] = [line for line in proc.stderr.splitlines() if line.startswith("[mlx-lily]")][:20]
    return result


def _modules(folder: Path) -> set:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*.ptx")} if folder.is_dir() else set()


def build_parser() -> argparse.ArgumentParser:
    from mlx_lily.random_checkpoints import SHAPES

    p = argparse.ArgumentParser(prog="python -m bench --cold-start", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a local checkpoint folder or hub repo id")
    p.add_argument("--shape", choices=sorted(SHAPES), default="demo",
                   help="random weights at this shape when no --model (default: demo)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt", type=int, default=128, help="prompt tokens (default: 128)")
    p.add_argument("--decode", type=int, default=16, help="tokens decoded after the first (default: 16)")
    p.add_argument("--engines", default="lily,mlx", help="comma-separated: lily, mlx (default: both)")
    p.add_argument("--processes", type=int, choices=(1, 2), default=2,
                   help="fresh processes per engine (default: 2; 1: the first-ever run only)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a process may take (default: 900)")
    p.add_argument("--profile", action="store_true",
                   help="profile each process's load and reply (cProfile, by cumulative time) into "
                        "--out as cold-profile-<engine>-<first|second>.txt")
    p.add_argument("--out", default=str(REPO_ROOT / "bench" / "out"), help="folder for the JSON")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    return p


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        spec = json.loads(Path(args.worker).read_text())
        Path(args.worker_out).write_text(json.dumps(worker(spec)))
        return 0
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = [e for e in engines if e not in ENGINES]
    if unknown:
        raise SystemExit(f"--engines: unknown {', '.join(unknown)} (lily, mlx)")
    source = {"model": args.model, "shape": None if args.model else args.shape, "seed": args.seed}
    report: Dict[str, Any] = {
        "kind": "cold-start", "started": now_iso(), "machine": machine_info(), "software": software_info(),
        "revision": git_revision(),
        "settings": {"source": source, "prompt": args.prompt, "decode": args.decode,
                     "measure": "seconds from spawning a fresh process to its first token; two "
                                "successive processes per engine sharing new, empty MLX PTX and lily caches"},
        "engines": {},
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / (file_stem("cold", report["machine"], report["revision"]) + ".json")
    with tempfile.TemporaryDirectory(prefix="lily-cold-") as scratch:
        for engine in engines:
            folder = Path(scratch) / engine
            env = dict(os.environ, MLX_PTX_CACHE_DIR=str(folder / "ptx"), MLX_LILY_CACHE=str(folder / "lily"))
            spec = {"source": source, "engine": ENGINES[engine], "prompt": args.prompt, "decode": args.decode}
            runs = []
            for which in ("first", "second")[:args.processes]:
                log(f"{engine}: {which} process ...")
                if args.profile:
                    spec["profile"] = str(Path(args.out) / f"cold-profile-{engine}-{which}.txt")
                before = _modules(folder / "ptx")
                result = run_process(spec, env, Path(scratch), f"{engine}-{which}", args.timeout)
                # Modules that appeared in MLX's folder: what this process compiled.
                result["modules_written"] = sorted(_modules(folder / "ptx") - before)
                log(f"{engine}: {which} process: " + (result.get("error") or
                    f"first token at {result['first_token_s']:.1f} s, reply done at {result['reply_s']:.1f} s"))
                runs.append(result)
            runs += [{}] * (2 - len(runs))
            report["engines"][engine] = {
                "first_process_s": runs[0].get("first_token_s"),
                "second_process_s": runs[1].get("first_token_s"),
                "first_process_reply_s": runs[0].get("reply_s"),
                "second_process_reply_s": runs[1].get("reply_s"),
                "processes": runs,
            }
            record = folder / "lily" / "cuda-instances.json"
            if record.exists():  # the kernel instances these processes met (toolchain/cuda_cache.py)
                (Path(args.out) / f"cuda-instances-{engine}.json").write_text(record.read_text())
            path.write_text(json.dumps(report, indent=1))  # each engine's as it finishes
    report["finished"] = now_iso()
    path.write_text(json.dumps(report, indent=1))
    print(summary(report))
    log(f"wrote {path}")
    return 0


def summary(report: Dict[str, Any]) -> str:
    lines = ["| engine | first process: first token | second process: first token | reply done (1st, 2nd) |",
             "|---|---:|---:|---:|"]
    for engine, r in report["engines"].items():
        def s(v):
            return "-" if v is None else f"{v:.1f} s"
        lines.append(f"| {engine} | {s(r['first_process_s'])} | {s(r['second_process_s'])} | "
                     f"{s(r['first_process_reply_s'])}, {s(r['second_process_reply_s'])} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
