"""The source text each backend compiles for a kernel.

The CUDA prelude (the subset's Metal names for CUDA, its atomics only where a
kernel uses them), the matrix-tile API's implementation per backend, the
compaction of the Metal and CUDA text (MLX hashes a kernel's whole source at
every launch), and, on CUDA, the two ``#include`` lines MLX gets instead of
the text once a probe kernel shows NVRTC reads them.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import threading
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx

from .._notice import notice_once
from .contracts import one_line

TOOLCHAIN_DIR = Path(__file__).resolve().parent
CUDA_PRELUDE = TOOLCHAIN_DIR / "prelude_cuda.h"
# The matrix-tile API (lily_tile_*): one implementation per backend.
TILES_METAL = TOOLCHAIN_DIR / "tiles_metal.h"
TILES_CUDA = TOOLCHAIN_DIR / "tiles_cuda.h"


_BANNER = "// " + "-" * 75 + "\n"
_USES_ATOMICS = re.compile(r"\batomic|\bmemory_order")


def cuda_prelude(for_text: Optional[str] = None) -> str:
    """The CUDA prelude; for a kernel whose code (``for_text``) uses no
    atomics, without its atomics section (less source for MLX to hash at
    every launch, below)."""
    text = _prelude_text()
    if for_text is None or _USES_ATOMICS.search(for_text):
        return text
    start = text.index(_BANNER + "// Atomics")
    end = text.index(_BANNER, text.index(_BANNER, start + len(_BANNER)) + len(_BANNER))
    return text[:start] + text[end:]


@functools.lru_cache(maxsize=None)
def _prelude_text() -> str:
    return CUDA_PRELUDE.read_text()


# MLX hashes a custom kernel's whole source (header included) every time the
# kernel runs, on Metal and on CUDA, to find its compiled library or module:
# with lily's CUDA prelude that was ~30 KB per launch, ~5 us on a server CPU,
# ~290 times per decode token. The GPU builds therefore get their source
# without comments, blank lines or indentation (``compact_source``);
# MLX_LILY_FULL_KERNEL_SOURCE=1 keeps them (readable compiler errors). The
# emulator keeps the full source (its reports name source lines).
FULL_SOURCE_ENV = "MLX_LILY_FULL_KERNEL_SOURCE"


def compact_source(text: str) -> str:
    """C/C++/MSL source without comments, blank lines or indentation; string
    and character literals, preprocessor lines and backslash continuations
    are kept as they are, so it compiles to the same program."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            out.append(text[i:j + 1])
            i = j + 1
        elif text.startswith("//", i):
            end = text.find("\n", i)
            i = n if end < 0 else end
        elif text.startswith("/*", i):
            end = text.find("*/", i + 2)
            out.append(" ")
            i = n if end < 0 else end + 2
        else:
            out.append(c)
            i += 1
    lines = (line.strip() for line in "".join(out).split("\n"))
    return "\n".join(line for line in lines if line) + "\n"


def gpu_source(text: str) -> str:
    """What the Metal and CUDA builds compile: ``text`` compacted, unless asked not to."""
    if os.environ.get(FULL_SOURCE_ENV, "0") == "1":
        return text
    return _compact_cached(text)


@functools.lru_cache(maxsize=256)
def _compact_cached(text: str) -> str:
    return compact_source(text)


# MLX's cuda_kernel also rebuilds a kernel's source (header, signature, body)
# at every call; each KB of it costs a launch about 0.3 us on the H200, a
# 20 KB kernel ~6 us of the ~11 it costs in all (bench.diagnostics.launch_cost).
# So the CUDA build hands MLX two #include lines instead of the text: the
# compacted header and body are written once to lily's cache (``MLX_LILY_CACHE``
# or ``~/.cache/mlx_lily``, under ``cuda-sources/``), each named by its digest,
# and NVRTC reads them from there. MLX decides which shapes and strides to pass
# by looking for ``<input>_shape`` (``_strides``, ``_ndim``) in the body, so
# the names the body uses follow its include line, as a comment. A probe kernel
# checks once per process that NVRTC reads such files; where it does not, or
# the folder cannot be written, or MLX_LILY_CUDA_INCLUDES=0, the text goes
# inline as before (one notice).
CUDA_INCLUDES_ENV = "MLX_LILY_CUDA_INCLUDES"
_SHAPE_SUFFIXES = ("_shape", "_strides", "_ndim")


def cuda_sources_dir() -> Path:
    from .._cache import cache_dir

    return cache_dir() / "cuda-sources"


def include_line(text: str, kind: str) -> str:
    """``#include "<file>"`` for ``text``, written to ``cuda_sources_dir()``
    under a name of its digest (kept where a file of that name already holds
    exactly ``text``; read back once per kernel build, so a damaged file is
    replaced rather than compiled)."""
    folder = cuda_sources_dir()
    path = folder / f"{kind}-{hashlib.sha256(text.encode()).hexdigest()[:24]}.cuh"
    if '"' in str(path) or "\n" in str(path):
        raise OSError(f"{path}: not a path an #include line can name")
    if not (path.exists() and path.read_text() == text):
        folder.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.part")
        partial.write_text(text)
        os.replace(partial, path)  # whole or absent, with other processes writing too
    return f'#include "{path}"\n'


def shape_names(body: str, input_names: Sequence[str]) -> list:
    """The ``<input>_shape/_strides/_ndim`` names ``body`` uses: what MLX's
    cuda_kernel looks for in a body to pass them."""
    return [f"{n}{s}" for n in input_names for s in _SHAPE_SUFFIXES if f"{n}{s}" in body]


def cuda_by_include(header: str, body: str, input_names: Sequence[str]) -> tuple:
    """(header, source) for MLX's cuda_kernel: include lines for the given
    texts, and a comment naming what the body uses of its inputs' shapes."""
    names = shape_names(body, input_names)
    uses = f"// uses {' '.join(names)}\n" if names else ""
    return include_line(header, "header"), include_line(body, "body") + uses


@functools.lru_cache(maxsize=1)
def cuda_includes_work() -> bool:
    """Whether CUDA kernels get their text by #include (above): asked for, the
    folder writable, and a probe kernel built that way computes its sum."""
    if os.environ.get(CUDA_INCLUDES_ENV, "1") == "0" or os.environ.get(FULL_SOURCE_ENV, "0") == "1":
        return False
    try:
        header, source = cuda_by_include(
            "#define LILY_INCLUDE_PROBE_ADD 2.0f\n",
            "unsigned int i = threadIdx.x;\nout[i] = inp[i * inp_strides[0]] + LILY_INCLUDE_PROBE_ADD;\n",
            ["inp"],
        )
        probe = mx.fast.cuda_kernel(name="lily_include_probe", input_names=["inp"], output_names=["out"],
                                    source=source, header=header, ensure_row_contiguous=False)
        x = mx.arange(64, dtype=mx.float32)[::2]
        _probe_module("custom_kernel_lily_include_probe", header, source, x)
        out = probe(inputs=[x], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                    output_shapes=[(32,)], output_dtypes=[mx.float32])[0]
        if not mx.array_equal(out, x + 2.0).item():
            raise RuntimeError("the probe kernel computed a wrong sum")
        return True
    except Exception as exc:  # noqa: BLE001 - the inline text always works
        notice_once("cuda-includes", f"CUDA kernels get their source inline, not by #include "
                                     f"({one_line(exc)}); each launch costs a few microseconds more")
        return False


def _probe_module(function: str, header: str, source: str, x: mx.array) -> None:
    """A probe kernel's module through lily's CUDA kernel cache, so that
    later processes do not compile it again."""
    from . import cuda_cache

    cache = cuda_cache.module_cache()
    if cache is not None:
        cache.submit(function, cuda_cache.generated_source(function, header, source, ["inp"], [x.ndim], ["out"],
                                                           [mx.float32], [x.dtype], [])).result()


@functools.lru_cache(maxsize=None)
def tiles_source(backend: str) -> str:
    """The matrix-tile API's implementation for ``backend``."""
    return (TILES_CUDA if backend == "cuda" else TILES_METAL).read_text()
