"""Lily and stock under mlx-lm's tensor and pipeline parallelism: launch N
ranks on this machine, and (``--bench``) measure them.

Two parts:

* ``launch_local(command, n)``: run ``command`` as N ranks of one
  ``mx.distributed`` group on this host, as ``mlx.launch`` does (each rank
  gets ``MLX_RANK``; the ring backend reads ``MLX_HOSTFILE``, a JSON list of
  each rank's ``ip:port`` on 127.0.0.1; the NCCL backend reads
  ``MLX_WORLD_SIZE``, ``NCCL_HOST_IP``/``NCCL_PORT`` and one GPU per rank).
  A rank that exits with an error stops the others at once, and the whole
  launch has a deadline: either raises ``RankFailed`` naming the rank, its
  exit status and the end of its output, never a hang.
* ``python -m bench.dist``: the A/B. Every rank loads the checkpoint with
  ``sharded_load`` (tensor or pipeline) on each engine in turn, prefills a
  prompt of each length and decodes, and rank 0 writes
  ``bench/results/dist-<shape>-<parallel>-<n>.json`` whose ``summary`` rows
  are ``{shape, parallel, length, lily, stock, lily_one_gpu}``, each engine's
  entry holding ``decode_tps`` and ``prefill_tps`` (``lily_one_gpu``: lily
  unsharded in one process, run first, where ``--one-gpu`` asks for it).

  On CPU, tiny:  python -m bench.dist --shape demo --lengths 64 --tokens 8
  H200 x 2:      python -m bench.dist --backend nccl --shape qwen3.6-35b-a3b \\
                     --lengths 4096 --tokens 128 --one-gpu
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"


class RankFailed(RuntimeError):
    """A rank exited with an error, or the launch passed its deadline."""


def free_ports(n: int) -> List[int]:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _tail(path: Path, chars: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def launch_local(command: Sequence[str], n: int = 2, timeout: float = 120.0, backend: str = "ring",
                 env: Optional[Dict[str, str]] = None, workdir: Optional[Path] = None) -> List[str]:
    """Run ``command`` as ``n`` ranks on this host; return each rank's
    stdout. Raises ``RankFailed`` when a rank exits non-zero (the others are
    stopped) or when ``timeout`` seconds pass (all are stopped)."""
    workdir = Path(workdir or tempfile.mkdtemp(prefix="lily-dist-"))
    base = dict(os.environ, **(env or {}))
    base["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), base.get("PYTHONPATH", "")) if p)
    if backend == "ring":
        hostfile = workdir / "hosts.json"
        hostfile.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(n)]))
        base.update(MLX_HOSTFILE=str(hostfile))
    elif backend == "nccl":
        base.update(MLX_WORLD_SIZE=str(n), NCCL_HOST_IP="127.0.0.1", NCCL_PORT=str(free_ports(1)[0]))
    else:
        raise ValueError(f"backend must be ring or nccl, got {backend!r}")
    procs, outs, errs = [], [], []
    for rank in range(n):
        rank_env = dict(base, MLX_RANK=str(rank))
        if backend == "nccl":
            rank_env["CUDA_VISIBLE_DEVICES"] = str(rank)
        out, err = workdir / f"rank{rank}.out", workdir / f"rank{rank}.err"
        outs.append(out)
        errs.append(err)
        with open(out, "wb") as o, open(err, "wb") as e:
            procs.append(subprocess.Popen(list(command), env=rank_env, stdout=o, stderr=e, cwd=str(ROOT)))
    deadline = time.monotonic() + timeout
    failure = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failure = _failed_ranks(procs, errs, n, bad)
                break
            if all(c == 0 for c in codes):
                break
            if time.monotonic() > deadline:
                waiting = [r for r, c in enumerate(codes) if c is None]
                failure = (f"ranks {waiting} of {n} still running after {timeout:.0f} s (a rank that "
                           f"never joined the group, or a collective that never completed); "
                           f"rank {waiting[0]}'s output:\n{_tail(errs[waiting[0]])}")
                break
            time.sleep(0.05)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    if failure is not None:
        raise RankFailed(failure)
    return [o.read_text() for o in outs]


# A rank that fails takes its peers down with it (their collectives lose the
# connection); seconds given them to exit, so every failed rank is named with
# its own output, not only the first one polled.
PEER_EXIT_S = 2.0


def _failed_ranks(procs: list, errs: List[Path], n: int, bad: list) -> str:
    """Every rank that exited non-zero, each with its output's tail: those
    seen first (``bad``) first, then peers that exited within PEER_EXIT_S."""
    seen = [r for r, _ in bad]
    until = time.monotonic() + PEER_EXIT_S
    while time.monotonic() < until and any(p.poll() is None for p in procs):
        time.sleep(0.05)
    seen += [r for r, p in enumerate(procs) if r not in seen and p.poll() not in (None, 0)]
    return "\n".join(f"rank {r} of {n} exited with status {procs[r].poll()}:\n{_tail(errs[r])}" for r in seen)


# -- the A/B (one rank's part) -------------------------------------------------------


def _load(path: str, engine: str, parallel: str):
    import mlx.core as mx
    from mlx_lm.utils import load, sharded_load

    from mlx_lily.backend import using

    with using("lily" if engine != "stock" else "mlx"):
        if parallel == "none":
            return load(path)
        group = mx.distributed.init()
        if parallel == "tensor":
            return sharded_load(path, tensor_group=group)
        return sharded_load(path, pipeline_group=group)


def _measure(model, length: int, tokens: int, vocab: int) -> dict:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    prompt = mx.random.randint(0, vocab, (1, length), key=mx.random.key(length))
    cache = make_prompt_cache(model)
    start = time.perf_counter()
    logits = model(prompt, cache=cache)
    token = mx.argmax(logits[:, -1:], axis=-1)
    mx.eval(token)
    prefill = time.perf_counter() - start
    # Decode: the first steps build the compiled steps; time the rest.
    warm = min(4, tokens // 2)
    for i in range(tokens):
        if i == warm:
            mx.eval(token)
            start = time.perf_counter()
        token = mx.argmax(model(token, cache=cache)[:, -1:], axis=-1)
        mx.async_eval(token)
    mx.eval(token)
    decode = time.perf_counter() - start
    return {"prefill_tps": length / prefill, "decode_tps": (tokens - warm) / decode}


def rank_main(args) -> None:
    import gc

    import mlx.core as mx

    group = mx.distributed.init(backend=args.backend) if args.parallel != "none" else None
    rank = group.rank() if group is not None else 0
    figures = {}
    for engine in args.engines:
        model, tokenizer = _load(args.model, engine, args.parallel)
        vocab = getattr(model, "language_model", model).args.vocab_size
        figures[engine] = {}
        for length in args.lengths:
            _measure(model, min(length, 32), 4, vocab)  # warm up the shapes' kernels
            figures[engine][length] = _measure(model, length, args.tokens, vocab)
        del model
        gc.collect()
        mx.clear_cache()
    if rank == 0:
        print(json.dumps(figures))


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.dist", description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="demo", help="a make_checkpoint shape (random weights)")
    parser.add_argument("--model", help="a checkpoint folder instead of a random one")
    parser.add_argument("--parallel", nargs="+", default=["tensor", "pipeline"],
                        choices=["tensor", "pipeline", "none"])
    parser.add_argument("-n", type=int, default=2, help="ranks")
    parser.add_argument("--backend", default="ring", choices=["ring", "nccl"])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096])
    parser.add_argument("--tokens", type=int, default=128, help="decode tokens per length")
    parser.add_argument("--one-gpu", action="store_true", help="also lily unsharded in one process")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engines", nargs="+", default=["lily", "stock"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank:
        args.parallel = args.parallel[0] if isinstance(args.parallel, list) else args.parallel
        rank_main(args)
        return 0

    from mlx_lily.random_checkpoints import make_checkpoint

    model = args.model or str(make_checkpoint(shape=args.shape, quiet=False))
    lengths = [str(n) for n in args.lengths]
    common = ["--model", model, "--lengths", *lengths, "--tokens", str(args.tokens), "--backend", args.backend]
    one_gpu = {}
    if args.one_gpu:
        # One process, no group: the model whole.
        cmd = [sys.executable, "-m", "bench.dist", "--rank", "--parallel", "none", *common, "--engines", "lily"]
        out = subprocess.run(cmd, cwd=str(ROOT), capture_output=True, text=True, timeout=args.timeout,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)))
        if out.returncode != 0:
            raise SystemExit(f"lily on one device failed:\n{out.stderr[-2000:]}")
        one_gpu = json.loads(out.stdout.strip().splitlines()[-1])["lily"]
    summary = []
    runs = {}
    for parallel in args.parallel:
        cmd = [sys.executable, "-m", "bench.dist", "--rank", "--parallel", parallel, *common]
        outs = launch_local(cmd, n=args.n, timeout=args.timeout, backend=args.backend)
        figures = json.loads(outs[0].strip().splitlines()[-1])
        runs[parallel] = figures
        for length in lengths:
            summary.append({
                "shape": args.shape if not args.model else args.model, "parallel": f"{parallel} x{args.n}",
                "length": int(length), "lily": figures["lily"][length], "stock": figures["stock"][length],
                "lily_one_gpu": one_gpu.get(length),
            })
    result = {
        "command": "python -m bench.dist " + " ".join(argv if argv is not None else sys.argv[1:]),
        "ranks": args.n, "backend": args.backend, "summary": summary,
    }
    out = args.out or RESULTS / f"dist-{args.shape}-{'-'.join(args.parallel)}-{args.n}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    for row in summary:
        print(json.dumps(row))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
