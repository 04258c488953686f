"""Lily's CUDA kernels compiled once per machine, not once per process.

MLX compiles each custom CUDA kernel with NVRTC in every process; it looks in
its PTX cache folder first, but writes custom kernels' modules there only for
its own kernels. So lily compiles each instantiation's module itself at its
first launch and writes it under the name MLX will look for; a second process
finds it there. ``precompile`` compiles many instantiations in parallel;
``MLX_LILY_CUDA_CACHE=0`` turns this off.

How the module's name is computed, the ABI header, and the probe:
docs/kernel-notes.md#cuda-cache.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import json
import os
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import mlx.core as mx

from .._notice import notice_once
from .type_names import CUDA_TYPES, MLX_TYPE_NAMES

CACHE_ENV = "MLX_LILY_CUDA_CACHE"

# What MLX 0.32's custom CUDA kernels put before the header they are given.
MLX_DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
# What lily's own compile puts there instead: the types MLX's generated
# signature names, laid out as MLX lays them out (MAX_NDIM = 10).
ABI_HEADER = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cooperative_groups.h>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 10>;
using Strides = cuda::std::array<int64_t, 10>;
}
"""
# MLX's module file names are cut into folders past this many characters.
_MAX_FILE_NAME = 245

_MASK = (1 << 64) - 1
_MUL = (0xC6A4A793 << 32) + 0x5BD1E995


def std_hash(data: bytes) -> int:
    """libstdc++'s ``std::hash<std::string>`` on a 64-bit machine
    (``_Hash_bytes`` with its seed): the hash MLX names modules by."""
    def shift_mix(v: int) -> int:
        return v ^ (v >> 47)

    n = len(data)
    h = (0xC70F6907 ^ (n * _MUL)) & _MASK
    whole = n & ~7
    for i in range(0, whole, 8):
        word = int.from_bytes(data[i:i + 8], "little")
        h ^= (shift_mix((word * _MUL) & _MASK) * _MUL) & _MASK
        h = (h * _MUL) & _MASK
    if n & 7:
        h ^= int.from_bytes(data[whole:], "little")
        h = (h * _MUL) & _MASK
    h = (shift_mix(h) * _MUL) & _MASK
    return shift_mix(h)


def template_suffix(template: Sequence[Tuple[str, object]]) -> str:
    """MLX's suffix of a kernel's name for its template arguments."""
    parts = []
    for _, value in template:
        if isinstance(value, bool):
            parts.append("_t" if value else "_f")
        elif isinstance(value, int):
            parts.append(f"_{value}")
        else:
            parts.append("_" + MLX_TYPE_NAMES[value])
    return "".join(parts)


def generated_source(function: str, header: str, source: str, input_names: Sequence[str],
                     input_ndims: Sequence[int], output_names: Sequence[str],
                     output_dtypes: Sequence[mx.Dtype], input_dtypes: Sequence[mx.Dtype],
                     template: Sequence[Tuple[str, object]]) -> str:
    """The source MLX 0.32's ``cuda_kernel`` generates for one launch."""
    out = [MLX_DEFAULT_HEADER, header, "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n",
           f"__global__ void {function}(\n"]
    for name, ndim, dtype in zip(input_names, input_ndims, input_dtypes):
        out.append(f"    const {CUDA_TYPES[dtype]}* {name},\n")
        if ndim > 0:
            if f"{name}_shape" in source:
                out.append(f"    const __grid_constant__ Shape {name}_shape,\n")
            if f"{name}_strides" in source:
                out.append(f"    const __grid_constant__ Strides {name}_strides,\n")
            if f"{name}_ndim" in source:
                out.append(f"    const __grid_constant__ int {name}_ndim,\n")
    out.append(",\n".join(f"    {CUDA_TYPES[d]}* {n}" for n, d in zip(output_names, output_dtypes)))
    out.append(") {\n")
    if template:
        for name, value in template:
            if isinstance(value, bool):
                out.append(f"  constexpr bool {name} = {'true' if value else 'false'};\n")
            elif isinstance(value, int):
                out.append(f"  constexpr int {name} = {value};\n")
            else:
                out.append(f"  using {name} = {CUDA_TYPES[value]};\n")
        out.append("\n")
    out.append(source)
    out.append("\n}\n\n} // namespace mlx::core::cu\n")
    return "".join(out)


@functools.lru_cache(maxsize=1)
def ptx_dir() -> Path:
    """MLX's PTX cache folder, as MLX 0.32 chooses it."""
    chosen = os.environ.get("MLX_PTX_CACHE_DIR")
    if chosen:
        return Path(chosen)
    return Path(os.environ.get("TMPDIR") or "/tmp") / "mlx" / mx.__version__ / "ptx"


def module_path(module: str) -> Path:
    """Where MLX looks for ``module``'s compiled code (long names become folders)."""
    folder = ptx_dir()
    if len(module) <= _MAX_FILE_NAME:
        return folder / f"{module}.ptx"
    offset = 0
    while len(module) - offset > _MAX_FILE_NAME:
        folder = folder / module[offset:offset + _MAX_FILE_NAME]
        offset += _MAX_FILE_NAME
    return folder / f"{module[offset:]}.ptx"


# ------------------------------------------------------------------ NVRTC


class _Nvrtc:
    """NVRTC through ctypes, compiling as MLX 0.32 compiles (same options)."""

    def __init__(self):
        self.lib = _load_nvrtc()
        self.lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
        self.version = (major.value, minor.value)
        self.options = _compile_options()

    def _check(self, result: int, what: str) -> None:
        if result != 0:
            raise RuntimeError(f"{what} failed: {self.lib.nvrtcGetErrorString(result).decode()}")

    def compile(self, source: str, name_expression: str, file_name: str) -> Tuple[bytes, str]:
        """(cubin, the function's lowered name)."""
        lib, prog = self.lib, ctypes.c_void_p()
        self._check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), file_name.encode(),
                                           0, None, None), "nvrtcCreateProgram")
        try:
            self._check(lib.nvrtcAddNameExpression(prog, name_expression.encode()), "nvrtcAddNameExpression")
            options = (ctypes.c_char_p * len(self.options))(*[o.encode() for o in self.options])
            result = lib.nvrtcCompileProgram(prog, len(self.options), options)
            if result != 0:
                size = ctypes.c_size_t()
                lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                log = ctypes.create_string_buffer(size.value + 1)
                lib.nvrtcGetProgramLog(prog, log)
                raise RuntimeError(f"NVRTC could not compile {file_name}: {log.value.decode(errors='replace')[:2000]}")
            lowered = ctypes.c_char_p()
            self._check(lib.nvrtcGetLoweredName(prog, name_expression.encode(), ctypes.byref(lowered)),
                        "nvrtcGetLoweredName")
            size = ctypes.c_size_t()
            self._check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            cubin = ctypes.create_string_buffer(size.value)
            self._check(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
            return cubin.raw, lowered.value.decode()
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def _site_roots() -> List[Path]:
    return [Path(p) for p in sys.path if p and Path(p).is_dir()]


def _mlx_root() -> Path:
    """The folder of MLX's package (its lib/ and include/ are inside)."""
    return Path(mx.__file__).resolve().parent


def _load_nvrtc():
    try:  # already loaded by MLX, or on the loader's path
        return ctypes.CDLL("libnvrtc.so.13")
    except OSError:
        pass
    for root in [_mlx_root().parent, *_site_roots()]:
        for path in sorted(glob.glob(str(root / "nvidia" / "*" / "lib" / "libnvrtc.so*"))):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    for path in sorted(glob.glob(os.path.join(home, "lib64", "libnvrtc.so*"))):
        return ctypes.CDLL(path)
    raise OSError("no NVRTC library (libnvrtc.so) found")


def _compile_options() -> List[str]:
    """MLX 0.32's NVRTC options: the device's architecture, MLX's bundled
    headers and CCCL, and the CUDA runtime's headers."""
    cc = _compute_capability()
    options = ["--device-as-default-execution-space", f"--gpu-architecture=sm_{cc[0]}{cc[1]}{'a' if cc[0] >= 9 else ''}"]
    include = _mlx_root() / "include"
    for path in (include, include / "cccl"):
        if path.is_dir():
            options.append(f"--include-path={path}")
    candidates = [_mlx_root().parent / "nvidia" / "cu13" / "include"]
    candidates += [root / "nvidia" / "cu13" / "include" for root in _site_roots()]
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidates.append(Path(home) / "include")
    for path in candidates:
        if (path / "cuda_bf16.h").exists():
            options.append(f"--include-path={path}")
            break
    return options


def _compute_capability() -> Tuple[int, int]:
    info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    arch = str(info.get("architecture", ""))
    digits = "".join(ch for ch in arch if ch.isdigit())
    if len(digits) >= 2:
        return int(digits[:-1]), int(digits[-1])
    raise RuntimeError(f"cannot tell the GPU's compute capability from {info!r}")


# --------------------------------------------------------- instances


@dataclass(frozen=True)
class Instance:
    """One instantiation of a kernel as MLX builds it on CUDA: what its
    generated source depends on besides the kernel's own texts."""

    kernel: str
    build: str  # the kernel's name for MLX: a digest of its source
    absent: Tuple[str, ...]
    template: Tuple[Tuple[str, object], ...]
    input_dtypes: Tuple[mx.Dtype, ...]
    input_ndims: Tuple[int, ...]
    output_dtypes: Tuple[mx.Dtype, ...]

    @classmethod
    def of(cls, kernel, launch) -> "Instance":
        absent = launch.absent_set
        return cls(kernel.name, kernel.backend_name("cuda", absent), absent, tuple(launch.template),
                   tuple(a.dtype for a in launch.inputs), tuple(a.ndim for a in launch.inputs),
                   tuple(launch.output_dtypes))

    def to_json(self) -> dict:
        return {"kernel": self.kernel, "build": self.build, "absent": list(self.absent),
                "template": [[n, _encode(v)] for n, v in self.template],
                "inputs": [[_dtype_name(d), n] for d, n in zip(self.input_dtypes, self.input_ndims)],
                "outputs": [_dtype_name(d) for d in self.output_dtypes]}

    @classmethod
    def from_json(cls, entry: dict) -> "Instance":
        return cls(entry["kernel"], entry["build"], tuple(entry["absent"]),
                   tuple((n, _decode(v)) for n, v in entry["template"]),
                   tuple(_dtype(d) for d, _ in entry["inputs"]), tuple(int(n) for _, n in entry["inputs"]),
                   tuple(_dtype(d) for d in entry["outputs"]))


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]


def _dtype(name: str) -> mx.Dtype:
    return mx.bool_ if name == "bool" else getattr(mx, name)


def _encode(value):
    if isinstance(value, mx.Dtype):
        return {"dtype": _dtype_name(value)}
    return value


def _decode(value):
    return _dtype(value["dtype"]) if isinstance(value, dict) else value


# Instances a first prompt and reply meet at the real model shapes, shipped so
# that a first run compiles them in parallel from its start. Recorded again
# after kernel changes by bench.diagnostics.tuning.first_instances (on any
# machine, checked against an NVIDIA machine's own record).
SHIPPED_INSTANCES = Path(__file__).with_name("cuda_instances.json")


def instances_file() -> Path:
    """This machine's record of the instances its processes met."""
    from .._cache import cache_dir

    return cache_dir() / "cuda-instances.json"


def read_instances(path: Path) -> List[dict]:
    try:
        entries = json.loads(path.read_text())
        return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []
    except (OSError, ValueError):
        return []


# ------------------------------------------------------------- the cache


class ModuleCache:
    """Compiles and writes modules MLX will load; one compile per module,
    however many threads ask."""

    def __init__(self, workers: Optional[int] = None):
        self._nvrtc: Optional[_Nvrtc] = None
        self._lock = threading.Lock()
        self._pending: Dict[str, Future] = {}
        self._pool = ThreadPoolExecutor(max_workers=workers or max(1, min(16, (os.cpu_count() or 2))),
                                        thread_name_prefix="lily-nvrtc")
        self.compiled = 0
        self.found = 0
        self.compile_s = 0.0  # summed over the compiling threads
        self.precompiled = 0  # compiles started ahead of their first launch
        self._recorded: Dict[str, dict] = {}
        self._precompile_started = False

    def nvrtc(self) -> _Nvrtc:
        if self._nvrtc is None:
            self._nvrtc = _Nvrtc()
        return self._nvrtc

    def submit(self, function: str, source: str) -> Future:
        """Make sure ``function``'s module (MLX's source ``source``) is in MLX's
        folder: a finished future where it is, else the compile's."""
        module = f"{function}_{std_hash(source.encode()):x}"
        with self._lock:
            known = self._pending.get(module)
            if known is not None:
                return known
            future: Future
            if module_path(module).exists():
                self.found += 1
                future = Future()
                future.set_result(None)
            else:
                future = self._pool.submit(self._compile, module, function, source)
            self._pending[module] = future
            return future

    def record(self, instance: Instance) -> None:
        """Add ``instance`` to this machine's record (``instances_file()``),
        which later processes compile ahead (``precompile``)."""
        entry = instance.to_json()
        key = json.dumps(entry, sort_keys=True)
        with self._lock:
            if key in self._recorded:
                return
            self._recorded[key] = entry
            path = instances_file()
            known = read_instances(path)
            if entry in known:
                return
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                _replace(path, json.dumps(known + [entry], indent=0).encode(),
                         f".{os.getpid()}.{threading.get_ident()}.part")
            except OSError:
                pass  # a record is an optimization only

    def precompile(self, kernels: Dict[str, object]) -> None:
        """Start compiling, in parallel, every recorded or shipped instance
        whose kernel is unchanged and whose module MLX's folder lacks; a
        launch that needs one of them waits for its compile only."""
        with self._lock:
            if self._precompile_started:
                return
            self._precompile_started = True
        seen = set()
        for entry in read_instances(instances_file()) + read_instances(SHIPPED_INSTANCES):
            key = json.dumps(entry, sort_keys=True)
            if key in seen:
                continue
            seen.add(key)
            try:
                instance = Instance.from_json(entry)
                kernel = kernels.get(instance.kernel)
                if kernel is None or kernel.backend_name("cuda", instance.absent) != instance.build:
                    continue  # another version of the kernel: not what this process runs
                future = self.submit(*kernel.cuda_function(instance))
            except Exception:  # noqa: BLE001 - a stale or damaged entry: its launch compiles it
                continue
            if not future.done():
                self.precompiled += 1

    def _compile(self, module: str, function: str, source: str) -> None:
        assert source.startswith(MLX_DEFAULT_HEADER)
        ours = ABI_HEADER + source[len(MLX_DEFAULT_HEADER):]
        expression = f"mlx::core::cu::{function}"
        started = time.perf_counter()
        cubin, lowered = self.nvrtc().compile(ours, expression, f"{module}.cu")
        write_module(module, cubin, [(expression, lowered)])
        with self._lock:
            self.compiled += 1
            self.compile_s += time.perf_counter() - started


def write_module(module: str, code: bytes, functions: Iterable[Tuple[str, str]]) -> None:
    """``module``'s files as MLX reads them: the code, and a line per function
    (its name, a tab, its lowered name); each whole or absent."""
    path = module_path(module)
    path.parent.mkdir(parents=True, exist_ok=True)
    tag = f".{os.getpid()}.{threading.get_ident()}.part"
    table = path.with_suffix(".txt")
    _replace(table, "".join(f"{n}\t{m}\n" for n, m in functions).encode(), tag)
    _replace(path, code, tag)  # last: MLX looks for this file first


def _replace(path: Path, data: bytes, tag: str) -> None:
    partial = path.with_name(path.name + tag)
    partial.write_bytes(data)
    os.replace(partial, path)


_CACHE: List[Optional[ModuleCache]] = []
_CACHE_LOCK = threading.Lock()


def module_cache() -> Optional[ModuleCache]:
    """The process's module cache, or None where lily cannot fill MLX's
    folder (said once)."""
    if _CACHE:
        return _CACHE[0]
    with _CACHE_LOCK:
        if not _CACHE:
            _CACHE.append(_make_cache())
        return _CACHE[0]


def _make_cache() -> Optional[ModuleCache]:
    if os.environ.get(CACHE_ENV, "1") == "0":
        return None
    if not mx.__version__.startswith("0.32."):
        notice_once("cuda-cache", f"lily's CUDA kernel cache is off: MLX {mx.__version__} is not 0.32.x, "
                                  "whose module names lily follows; each process compiles lily's kernels")
        return None
    try:
        cache = ModuleCache()
        _probe(cache)
        return cache
    except Exception as exc:  # noqa: BLE001 - MLX compiles as before
        text = " ".join(str(exc).split())[:300]
        notice_once("cuda-cache", f"lily's CUDA kernel cache is off ({type(exc).__name__}: {text}); "
                                  "each process compiles lily's kernels")
        return None


_PROBE_BODY = "uint i = threadIdx.x;\nif (i < uint(inp_shape[0])) out[i] = static_cast<T>(inp[i] + float(N));\n"
_PROBE_TEMPLATE = [("T", mx.float32), ("N", 2), ("B", True)]


def _probe(cache: ModuleCache) -> None:
    """Check that MLX loads what lily writes, for a kernel with a template
    (a type, an int, a bool) and a shape parameter: lily writes the module
    of a kernel whose source adds N from a source that adds N + 1 (the
    folder keeps it for later processes), and the result must show it."""
    tag = f"{std_hash(ABI_HEADER.encode()):x}"[:10]
    function = f"custom_kernel_lily_cache_probe_{tag}" + template_suffix(_PROBE_TEMPLATE)
    header = "typedef unsigned int uint;\n"
    source = generated_source(function, header, _PROBE_BODY, ["inp"], [1], ["out"], [mx.float32],
                              [mx.float32], _PROBE_TEMPLATE)
    module = f"{function}_{std_hash(source.encode()):x}"
    if not module_path(module).exists():
        planted = source.replace("float(N)", "float(N + 1)")
        expression = f"mlx::core::cu::{function}"
        cubin, lowered = cache.nvrtc().compile(ABI_HEADER + planted[len(MLX_DEFAULT_HEADER):], expression,
                                               f"{module}.cu")
        write_module(module, cubin, [(expression, lowered)])
    kernel = mx.fast.cuda_kernel(name="lily_cache_probe_" + tag, input_names=["inp"], output_names=["out"],
                                 source=_PROBE_BODY, header=header, ensure_row_contiguous=True)
    x = mx.arange(32, dtype=mx.float32)
    out = kernel(inputs=[x], template=_PROBE_TEMPLATE, grid=(32, 1, 1), threadgroup=(32, 1, 1),
                 output_shapes=[(32,)], output_dtypes=[mx.float32])[0]
    if mx.array_equal(out, x + 3.0).item():
        return
    if mx.array_equal(out, x + 2.0).item():
        raise RuntimeError(f"MLX did not load the module lily wrote in {ptx_dir()}")
    raise RuntimeError("the probe kernel computed neither sum")
