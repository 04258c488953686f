"""Decode speed by the CPUs the process runs on: is the host's speed a matter of placement?

    python3 -m bench.diagnostics.decode.host_placement [--shape qwen3.6-35b-a3b] [--context 256]
        [--steps 48] [--repeats 2] [--out DIR]

On the H200 lily's decode is bound by the host, and the same step's host
time differs between processes on one machine by up to about 1.5x (in
bench/results/2026-12-03-nvidia-h200-fd51da6: 5.14 ms a token in one
process, 6.76 in another; the server's one-stream step 11.6 ms against 7.0
for the same step in a third). This runs one process and moves all of its
threads (``sched_setaffinity`` on every thread of ``/proc/self/task``) over
placements of the machine's CPUs: as started; each NUMA node; one CPU per
physical core; one core's hardware threads; a single CPU. At each it times
mlx-lm's ``generate_step`` decode on lily's whole step, the server's batched
step for one stream (``decode_split.pipelined_ms``), and ``generate_step``
again from a worker thread (the server decodes on one), each ``--repeats``
times, interleaved. If the figures follow the placement, the spread between
processes is where their threads ran; if they do not, it is elsewhere.

Writes DIR/host_placement.txt: the machine's topology (CPUs, cores, NUMA
nodes, the GPU's node) and, per placement, the median ms per token of each
measurement and the CPUs the decoding thread was seen on.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Set

import mlx.core as mx

from bench.common import write_report

SYS_CPU = Path("/sys/devices/system/cpu")
SYS_NODE = Path("/sys/devices/system/node")


def parse_cpu_list(text: str) -> List[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the kernel's CPU list format)."""
    cpus: List[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-")
            cpus.extend(range(int(lo), int(hi) + 1))
        else:
            cpus.append(int(part))
    return cpus


def topology(allowed: Set[int], sys_cpu: Path = SYS_CPU, sys_node: Path = SYS_NODE) -> Dict[str, Any]:
    """The allowed CPUs' cores (each core's hardware threads, from
    ``thread_siblings_list``) and NUMA nodes; a CPU without topology files
    counts as its own core, a machine without node files as one node."""
    cores: Dict[tuple, List[int]] = {}
    for cpu in sorted(allowed):
        siblings = sys_cpu / f"cpu{cpu}" / "topology" / "thread_siblings_list"
        key = tuple(parse_cpu_list(siblings.read_text())) if siblings.exists() else (cpu,)
        cores.setdefault(key, []).append(cpu)
    nodes: Dict[int, List[int]] = {}
    if sys_node.exists():
        for entry in sorted(sys_node.glob("node[0-9]*")):
            cpus = [c for c in parse_cpu_list((entry / "cpulist").read_text()) if c in allowed]
            if cpus:
                nodes[int(entry.name[4:])] = cpus
    if not nodes:
        nodes = {0: sorted(allowed)}
    return {"cores": list(cores.values()), "nodes": nodes}


def gpu_node() -> Optional[int]:
    """The NUMA node of the first NVIDIA GPU (nvidia-smi's PCI bus id), or None."""
    try:
        bus = subprocess.run(["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20).stdout.split()[0]
    except (OSError, IndexError, subprocess.SubprocessError):
        return None
    # nvidia-smi prints an 8-digit domain; sysfs names the device with 4.
    path = Path("/sys/bus/pci/devices") / bus.lower()[-12:]
    try:
        node = int((path / "numa_node").read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def placements(allowed: Set[int], topo: Dict[str, Any]) -> Dict[str, List[int]]:
    """Named CPU sets to run on, each a subset of ``allowed``."""
    out = {"as started": sorted(allowed)}
    if len(topo["nodes"]) > 1:
        for node, cpus in topo["nodes"].items():
            out[f"node {node}"] = cpus
    firsts = sorted(core[0] for core in topo["cores"])
    if len(firsts) < len(allowed):
        out["one CPU per core"] = firsts
        pair = next(core for core in topo["cores"] if len(core) > 1)
        out["one core's hardware threads"] = pair
    out["one CPU"] = [firsts[0]]
    return out


def pin_process(cpus: List[int]) -> None:
    """Every thread of this process may run on ``cpus`` only (threads made
    later inherit the creating thread's set)."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, PermissionError):
            pass  # a thread that ended meanwhile, or one we may not move


def current_cpu() -> Optional[int]:
    """The CPU the calling thread last ran on (/proc/thread-self/stat, field 39)."""
    try:
        fields = Path("/proc/thread-self/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[36])
    except (OSError, IndexError, ValueError):
        return None


def in_worker(fn: Callable[[], Any]) -> Any:
    """``fn()`` run on a new thread, as the server runs its generation."""
    result: Dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = fn()
        except BaseException as e:  # re-raised on the caller's thread
            result["error"] = e

    worker = threading.Thread(target=run)
    worker.start()
    worker.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3.6-35b-a3b")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=48, help="decode tokens per measurement (default 48)")
    p.add_argument("--repeats", type=int, default=2, help="passes over the placements (default 2)")
    p.add_argument("--out", help="also write DIR/host_placement.txt")
    args = p.parse_args(argv)

    from bench.diagnostics.decode.decode_profile import batch_cache
    from bench.diagnostics.decode.decode_split import generate_token_ms, pipelined_ms
    from bench.engines import load_shared, switch
    from bench.measure import make_prompt_cache, prompt_array

    allowed = set(os.sched_getaffinity(0))
    topo = topology(allowed)
    where = placements(allowed, topo)
    model, vocab, _, _ = load_shared({"model": None, "shape": args.shape, "seed": 0, "conditioned": False})
    switch(model, "lily")
    prompt = prompt_array(args.context, vocab)

    def generate_ms(seen: Set[int]) -> float:
        times = generate_token_ms(model, prompt, make_prompt_cache(model), args.steps)
        cpu = current_cpu()
        if cpu is not None:
            seen.add(cpu)
        return statistics.median(times)

    batched = batch_cache(model, vocab, args.context, 1)
    pipelined_ms(model, batched, 4)  # traces the batched step
    generate_ms(set())  # and the whole step at this context
    kinds = ("generate_step", "batched step, B = 1", "generate_step on a worker thread")
    results: Dict[str, Dict[str, List[float]]] = {name: {k: [] for k in kinds} for name in where}
    seen: Dict[str, Set[int]] = {name: set() for name in where}
    for _ in range(args.repeats):
        for name, cpus in where.items():
            pin_process(cpus)
            results[name][kinds[0]].append(generate_ms(seen[name]))
            results[name][kinds[1]].append(pipelined_ms(model, batched, args.steps)["step"])
            results[name][kinds[2]].append(in_worker(lambda: generate_ms(seen[name])))
    pin_process(sorted(allowed))

    node = gpu_node()
    lines = [f"Decode ms per token by CPU placement ({args.shape}, lily, {args.context} tokens of context, "
             f"{args.steps} tokens per measurement, {args.repeats} passes over the placements, interleaved)", "",
             f"CPUs allowed: {len(allowed)}; cores: {len(topo['cores'])}; NUMA nodes: "
             + ", ".join(f"{n} (CPUs {_ranges(c)})" for n, c in topo["nodes"].items())
             + f"; the GPU's node: {'unknown' if node is None else node}", "",
             "| placement | CPUs | " + " | ".join(kinds) + " | decoding thread seen on |",
             "|---|---|" + "---:|" * len(kinds) + "---|"]
    for name, cpus in where.items():
        cells = " | ".join(" / ".join(f"{v:.2f}" for v in results[name][k]) for k in kinds)
        lines.append(f"| {name} | {_ranges(cpus)} | {cells} | {_ranges(sorted(seen[name])) or '?'} |")
    lines += ["", "Each cell: median ms per token of each pass, in order."]
    write_report(args.out, "host_placement.txt", "\n".join(lines) + "\n")
    return 0


def _ranges(cpus: List[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out, run = [], []
    for c in cpus:
        if run and c == run[-1] + 1:
            run.append(c)
        else:
            if run:
                out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = [c]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
