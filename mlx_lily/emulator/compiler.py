"""Compiling kernels with the system C++ compiler, with an on-disk cache.

Layout of the cache directory (``$MLX_LILY_CACHE`` or
``~/.cache/mlx_lily/emulator``)::

    <toolchain key>/lily_runtime.o        the scheduler, compiled once
    <toolchain key>/pch/prelude_cpu.h.gch the prelude, precompiled once
    <toolchain key>/kernels/<name>-<hash>.so

The toolchain key hashes the compiler, its flags and the runtime/prelude
sources, so editing the prelude or switching compilers starts afresh. A
kernel library is keyed by the hash of its whole translation unit. Files are
written under a temporary name and renamed, so concurrent processes never
see half-written files.
"""

from __future__ import annotations

import ctypes
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Dict, List, Optional

from .errors import EmulatorError, KernelCompileError

PACKAGE_DIR = Path(__file__).resolve().parent

# Metal's semantics where C++ differs: signed overflow wraps; float literals
# are single precision (Metal has no double); no FMA contraction, so results
# do not depend on the host CPU; no errno, so sqrt etc. can be inlined;
# large stack frames probe every page, so a fiber's stack overflow always
# hits its guard page.
CXX_FLAGS = [
    "-std=c++17",
    "-O2",
    "-fPIC",
    "-fvisibility=hidden",
    "-fwrapv",
    "-fno-strict-aliasing",
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fsingle-precision-constant",
    "-fstack-clash-protection",
    "-w",
]

_RUNTIME_SOURCES = ("lily_runtime.cpp",)
_MAX_ERROR_LINES = 60

_lock = threading.Lock()
_libraries: Dict[str, ctypes.CDLL] = {}
_toolchain_dir: Optional[Path] = None


def cache_root() -> Path:
    env = os.environ.get("MLX_LILY_CACHE")
    if env:
        root = Path(env)
        root.mkdir(parents=True, exist_ok=True)
        return root
    try:
        root = Path.home() / ".cache" / "mlx_lily" / "emulator"
        root.mkdir(parents=True, exist_ok=True)
    except OSError:  # no writable home (CI sandboxes): fall back to /tmp
        root = Path(tempfile.gettempdir()) / "mlx_lily_emulator"
        root.mkdir(parents=True, exist_ok=True)
    return root


def find_compiler() -> str:
    for candidate in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if candidate and shutil.which(candidate):
            return candidate
    raise EmulatorError(
        "no C++ compiler found (set CXX, or install g++): the Metal kernel "
        "emulator compiles kernels with the system compiler"
    )


def _sources_digest() -> str:
    h = hashlib.sha256()
    for path in sorted(PACKAGE_DIR.glob("*.h")) + [PACKAGE_DIR / s for s in _RUNTIME_SOURCES]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _compiler_identity(cxx: str) -> str:
    out = subprocess.run([cxx, "--version"], capture_output=True, text=True)
    return out.stdout.splitlines()[0] if out.stdout else cxx


def _run(cmd: List[str], what: str) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise EmulatorError(f"{what} failed:\n{proc.stderr[-4000:]}")
    return proc


class _FileLock:
    """An exclusive lock on a file, across processes."""

    def __init__(self, path: Path):
        self._path = path

    def __enter__(self):
        self._fd = os.open(self._path, os.O_CREAT | os.O_RDWR, 0o644)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc):
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)


def _atomic_output(final: Path) -> Path:
    fd, tmp = tempfile.mkstemp(prefix=final.name + ".", suffix=".tmp", dir=final.parent)
    os.close(fd)
    return Path(tmp)


def toolchain_dir() -> Path:
    """Builds (once) the runtime object and the precompiled prelude."""
    global _toolchain_dir
    if _toolchain_dir is not None:
        return _toolchain_dir
    cxx = find_compiler()
    key = hashlib.sha256(
        "\0".join([_compiler_identity(cxx), *CXX_FLAGS, _sources_digest()]).encode()
    ).hexdigest()[:16]
    tdir = cache_root() / key
    (tdir / "pch").mkdir(parents=True, exist_ok=True)
    (tdir / "kernels").mkdir(exist_ok=True)
    runtime = tdir / "lily_runtime.o"
    pch = tdir / "pch" / "prelude_cpu.h.gch"
    with _FileLock(tdir / ".lock"):
        if not runtime.exists():
            tmp = _atomic_output(runtime)
            _run(
                [cxx, *CXX_FLAGS, "-c", str(PACKAGE_DIR / "lily_runtime.cpp"), "-o", str(tmp)],
                "compiling the emulator runtime",
            )
            os.chmod(tmp, 0o644)
            os.replace(tmp, runtime)
        if not pch.exists():
            tmp = _atomic_output(pch)
            _run(
                [cxx, *CXX_FLAGS, "-x", "c++-header", str(PACKAGE_DIR / "prelude_cpu.h"),
                 "-o", str(tmp)],
                "precompiling the emulator prelude",
            )
            os.chmod(tmp, 0o644)
            os.replace(tmp, pch)
    _toolchain_dir = tdir
    return tdir


def _trim_compiler_output(stderr: str, tu_path: str) -> str:
    """Keeps the compiler's messages readable: drops the temporary path of
    the translation unit and stops after a screenful."""
    lines = [ln.replace(tu_path + ":", "") for ln in stderr.splitlines()]
    if len(lines) > _MAX_ERROR_LINES:
        lines = lines[:_MAX_ERROR_LINES] + [f"... ({len(lines) - _MAX_ERROR_LINES} more lines)"]
    return "\n".join(lines)


def load_kernel(kernel_label: str, cpp: str) -> ctypes.CDLL:
    """The loaded library for a translation unit, compiling it if needed."""
    digest = hashlib.sha256(cpp.encode()).hexdigest()[:24]
    with _lock:
        lib = _libraries.get(digest)
        if lib is not None:
            return lib
        tdir = toolchain_dir()
        safe = "".join(c if c.isalnum() or c == "_" else "_" for c in kernel_label)[:60]
        so = tdir / "kernels" / f"{safe}-{digest}.so"
        if not so.exists():
            _compile(kernel_label, cpp, so, tdir)
        lib = ctypes.CDLL(str(so))
        lib.lily_launch.restype = ctypes.c_int
        _libraries[digest] = lib
        return lib


def _compile(kernel_label: str, cpp: str, so: Path, tdir: Path) -> None:
    cxx = find_compiler()
    with tempfile.TemporaryDirectory(prefix="lily_kernel_") as work:
        tu = os.path.join(work, "kernel.cpp")
        with open(tu, "w") as f:
            f.write(cpp)
        tmp = _atomic_output(so)
        cmd = [
            cxx, *CXX_FLAGS, "-shared",
            "-I", str(tdir / "pch"), "-I", str(PACKAGE_DIR),
            tu, str(tdir / "lily_runtime.o"), "-o", str(tmp), "-lm",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=work)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            raise KernelCompileError(
                f"[metal_kernel emulator] kernel '{kernel_label}' failed to compile "
                f"(lines refer to the kernel's source/header):\n"
                + _trim_compiler_output(proc.stderr, tu),
                kernel=kernel_label,
                compiler_output=proc.stderr,
            )
        os.chmod(tmp, 0o644)
        os.replace(tmp, so)
