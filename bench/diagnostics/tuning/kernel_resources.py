"""Registers, spills and occupancy of the kernels MLX compiled on an NVIDIA GPU.

    python3 -m bench.diagnostics.tuning.kernel_resources [--match TEXT,...] [--threads N] [--out DIR]

MLX's CUDA backend keeps every kernel it compiles in ``MLX_PTX_CACHE_DIR``:
``<module>.ptx`` (a cubin where NVRTC can build for the device) beside
``<module>.txt``, one ``name<TAB>mangled name`` line per kernel. This loads
each module whose name contains one of ``--match`` through the CUDA driver
and reports, per kernel, the registers a thread holds, the bytes it spills to
local memory, its static shared memory, and how many threadgroups of
``--threads`` threads one SM holds at once. Why: a kernel whose grid needs
several waves of threadgroups pays each threadgroup's serial latency (a
top-k before the loads, say) once a wave, and the wave count follows from
these numbers, which no timing shows directly.

Run it after the kernels of interest have been compiled (a sweep or a bench
in the same cache folder). Needs the CUDA driver (``libcuda.so.1``); without
it, says so and exits 2.
"""

from __future__ import annotations

import argparse
import ctypes
import os
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

from bench.common import write_json, write_report

# cuFuncGetAttribute's attributes (CUfunction_attribute).
ATTRIBUTES = {
    "max_threads": 0,
    "shared_bytes": 1,
    "local_bytes": 3,
    "registers": 4,
}


def cached_kernels(cache_dir: Path, match: List[str]) -> Iterator[Tuple[Path, str, str]]:
    """(module file, kernel name, mangled name) of each kernel in ``cache_dir``
    whose module name contains one of ``match`` (all where ``match`` is empty)."""
    for listing in sorted(cache_dir.glob("*.txt")):
        module = listing.stem
        if match and not any(m in module for m in match):
            continue
        binary = listing.with_suffix(".ptx")
        if not binary.exists():
            continue
        for line in listing.read_text(errors="replace").splitlines():
            name, tab, mangled = line.partition("\t")
            if tab:
                yield binary, name, mangled


class Driver:
    """The few CUDA driver calls this needs, through ctypes."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self._check(self.lib.cuInit(0), "cuInit")
        device = ctypes.c_int()
        self._check(self.lib.cuDeviceGet(ctypes.byref(device), 0), "cuDeviceGet")
        context = ctypes.c_void_p()
        self._check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(context), device), "cuDevicePrimaryCtxRetain")
        self._check(self.lib.cuCtxSetCurrent(context), "cuCtxSetCurrent")
        self.device = device
        self.modules: Dict[Path, ctypes.c_void_p] = {}

    @staticmethod
    def _check(code: int, call: str) -> None:
        if code != 0:
            raise RuntimeError(f"{call} failed with CUDA driver error {code}")

    def sm_count(self) -> int:
        count = ctypes.c_int()
        self._check(self.lib.cuDeviceGetAttribute(ctypes.byref(count), 16, self.device), "cuDeviceGetAttribute")
        return count.value

    def function(self, binary: Path, mangled: str) -> ctypes.c_void_p:
        if binary not in self.modules:
            data = binary.read_bytes()
            if not data.endswith(b"\0"):
                data += b"\0"  # PTX text must end in a NUL; a cubin ignores it
            module = ctypes.c_void_p()
            self._check(self.lib.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(data)),
                        f"cuModuleLoadData({binary.name})")
            self.modules[binary] = module
        func = ctypes.c_void_p()
        self._check(self.lib.cuModuleGetFunction(ctypes.byref(func), self.modules[binary], mangled.encode()),
                    f"cuModuleGetFunction({mangled})")
        return func

    def attribute(self, func: ctypes.c_void_p, attribute: int) -> int:
        value = ctypes.c_int()
        self._check(self.lib.cuFuncGetAttribute(ctypes.byref(value), attribute, func), "cuFuncGetAttribute")
        return value.value

    def blocks_per_sm(self, func: ctypes.c_void_p, threads: int) -> int:
        blocks = ctypes.c_int()
        self._check(self.lib.cuOccupancyMaxActiveBlocksPerMultiprocessor(
            ctypes.byref(blocks), func, ctypes.c_int(threads), ctypes.c_size_t(0)),
            "cuOccupancyMaxActiveBlocksPerMultiprocessor")
        return blocks.value


def resources(cache_dir: Path, match: List[str], threads: int, driver: Driver) -> List[dict]:
    rows = []
    sms = driver.sm_count()
    for binary, name, mangled in cached_kernels(cache_dir, match):
        func = driver.function(binary, mangled)
        row = {"module": binary.stem, "kernel": name}
        row.update({key: driver.attribute(func, code) for key, code in ATTRIBUTES.items()})
        per_sm = driver.blocks_per_sm(func, min(threads, row["max_threads"]))
        row["threadgroups_per_sm"] = per_sm
        row["threadgroups_at_once"] = per_sm * sms
        rows.append(row)
    return rows


def render(rows: List[dict], threads: int, cache_dir: Path) -> str:
    lines = [f"# Kernel resources ({len(rows)} kernels in the PTX cache folder; occupancy at {threads} threads "
             "a threadgroup)", "",
             "| kernel | registers | local bytes | shared bytes | threadgroups / SM | at once |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| `{r['kernel']}` | {r['registers']} | {r['local_bytes']} | {r['shared_bytes']} | "
                     f"{r['threadgroups_per_sm']} | {r['threadgroups_at_once']} |")
    if not rows:
        lines.append(f"(no kernel in {cache_dir} matched)")
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--match", default="", help="comma-separated parts of module names (default: every module)")
    parser.add_argument("--threads", type=int, default=256, help="threads per threadgroup for the occupancy (default 256)")
    parser.add_argument("--cache-dir", default=None, help="the PTX cache folder (default: $MLX_PTX_CACHE_DIR)")
    parser.add_argument("--out", default=None, help="folder for kernel-resources.json/.md (default: print only)")
    args = parser.parse_args(argv)
    if args.threads < 1 or args.threads > 1024:
        parser.error(f"--threads {args.threads}: 1 to 1024")
    cache = args.cache_dir or os.environ.get("MLX_PTX_CACHE_DIR")
    if not cache or not Path(cache).is_dir():
        parser.error("no PTX cache folder: pass --cache-dir or set MLX_PTX_CACHE_DIR to the folder MLX compiled into")
    try:
        driver = Driver()
    except (OSError, RuntimeError) as exc:
        print(f"kernel_resources: needs the CUDA driver here ({exc})")
        return 2
    match = [m for m in args.match.split(",") if m]
    rows = resources(Path(cache), match, args.threads, driver)
    text = render(rows, args.threads, Path(cache))
    write_report(args.out, "kernel-resources.md", text)
    write_json(args.out, "kernel-resources.json", {"threads": args.threads, "match": match, "kernels": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
