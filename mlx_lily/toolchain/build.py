"""Lily's kernel toolchain: one kernel body, built for whatever runs it.

Each lily kernel is written once, as a Metal Shading Language *body* (what
``mx.fast.metal_kernel`` takes: the inside of the kernel function, whose
signature MLX generates) in the portable subset that ``toolchain/lint.py``
documents and checks. The body lives in its own file, ``mlx_lily/kernels/<family>.metal``,
beside the Python launcher that computes each call's grid, threadgroup,
template constants and output shapes. A :class:`Kernel` builds that body for
the active backend (``registry.kernel_backend()``):

* ``metal``: ``mx.fast.metal_kernel`` with the body as written;
* ``cuda``: ``mx.fast.cuda_kernel`` with the same body, after the CUDA prelude
  (``toolchain/prelude_cuda.h``, passed as MLX's ``header``) that defines the
  subset's Metal names for CUDA;
* ``emulator``: ``mlx_lily.emulator.metal_kernel``, a CPU SIMT emulator with
  ``mx.fast.metal_kernel``'s interface and Metal's semantics, which reports
  deadlocks and out-of-bounds accesses (tests, CI, ``doctor``).

A kernel is trusted only after a one-time self-check per backend and process:
it runs on its op's ``sample()`` inputs and must agree with the op's reference.
A build failure or a disagreement turns the kernel off with one notice, and its
op keeps running the reference; nothing crashes. Each other instantiation (the
launch's template arguments and the inputs' dtypes) is checked the same way at
its first use, on that call's own inputs (``run_checked``): a failure there
turns off that instantiation only, with one notice, and the call returns the
reference's result.

Launch rules the toolchain applies on every backend, so that Metal, CUDA and
the emulator run the same threads:

* every grid dimension is rounded up to a whole number of threadgroups (MLX's
  CUDA backend runs whole blocks, Metal clips the last threadgroup; rounding
  makes both run whole ones), so bodies guard the tail themselves;
* a body that uses SIMD-group functions must be launched with threadgroups of
  a whole number of 32-lane SIMD groups.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import math
import os
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from .._notice import notice_once
from .registry import kernel_backend

# Kernel bodies named by a relative path live in the kernel families' package.
KERNELS_DIR = Path(__file__).resolve().parent.parent / "kernels"
TOOLCHAIN_DIR = Path(__file__).resolve().parent
CUDA_PRELUDE = TOOLCHAIN_DIR / "prelude_cuda.h"
# The matrix-tile API (lily_tile_*): one implementation per backend.
TILES_METAL = TOOLCHAIN_DIR / "tiles_metal.h"
TILES_CUDA = TOOLCHAIN_DIR / "tiles_cuda.h"

# Apple GPUs and NVIDIA GPUs both run 32-lane SIMD groups (warps).
SIMD_WIDTH = 32
# The most threads a threadgroup may have on either backend.
MAX_THREADGROUP = 1024

BACKENDS = ("metal", "cuda", "emulator")

# Names whose presence in a body means it runs SIMD-group collectives.
_SIMD_USE = re.compile(r"\bsimd_\w+|\bsimdgroup_\w+|\bthread_index_in_simdgroup\b|\blily_tile_\w+")

Dim3 = tuple[int, int, int]


class _Tracing(threading.local):
    active = False


_TRACING = _Tracing()


@contextlib.contextmanager
def traced_not_run():
    """Build kernels for a graph that is traced (``mx.export_function``), not
    evaluated: without the row-contiguous copy MLX puts before each input,
    whose primitive export cannot serialize. The graph then shows each kernel
    as one node; a copy MLX would make of a non-contiguous input at run time
    is not in it (bench/counts.py says so)."""
    before, _TRACING.active = _TRACING.active, True
    try:
        yield
    finally:
        _TRACING.active = before


def tracing() -> bool:
    """Inside ``traced_not_run()``."""
    return _TRACING.active


def on_cpu(fn: Callable, *args, **kwargs):
    """``fn(*args, **kwargs)`` evaluated on the CPU stream: a reference whose
    MLX ops round bf16 where the kernels (and Metal) round, for contracts that
    must not depend on another backend's element-wise rounding (MLX's CUDA
    ops round some bf16 steps differently)."""
    with mx.stream(mx.cpu):
        result = fn(*args, **kwargs)
        mx.eval(result)
    return result


def contiguous(a: mx.array) -> mx.array:
    """``mx.contiguous(a)``; in a traced graph, where export cannot serialize
    that primitive, an element-wise copy (``a * 1``, the same values) stands
    for it: one node that reads and writes ``a``, as the copy does at run
    time."""
    if _TRACING.active:
        return a * mx.array(1, dtype=a.dtype)
    return mx.contiguous(a)


@dataclass
class Launch:
    """One call's arguments for a built kernel, as a launcher computes them."""

    inputs: Sequence[mx.array]
    grid: Dim3
    threadgroup: Dim3
    output_shapes: Sequence[Sequence[int]]
    output_dtypes: Sequence[mx.Dtype]
    # (name, int | bool | Dtype): template parameters on Metal, constexpr on CUDA.
    template: Sequence[tuple[str, Any]] = ()
    init_value: Optional[float] = None
    # outputs -> the op's result (reshapes, tuples); None returns the list.
    finish: Optional[Callable[[list], Any]] = None
    # Inputs and outputs this call does not have (names in the kernel's
    # ``stand_ins``): left out of ``inputs`` and ``output_shapes``, so MLX
    # neither passes nor allocates them.
    absent: Tuple[str, ...] = ()

    @property
    def absent_set(self) -> Tuple[str, ...]:
        """``absent`` in one order: one build and one first-use check per set."""
        return tuple(sorted(self.absent))

    def instance(self, backend: str) -> tuple:
        """(backend, template, input dtypes, absent names): the kernel
        instantiation this launch runs, checked once at its first use."""
        return (backend, tuple(self.template), tuple(a.dtype for a in self.inputs), self.absent_set)


def whole_threadgroups(grid: Dim3, threadgroup: Dim3) -> tuple[Dim3, Dim3]:
    """(grid, threadgroup) as every backend will run them.

    MLX clips a threadgroup dimension to the grid's when the grid is smaller,
    and CUDA runs whole blocks; rounding the grid up to whole threadgroups makes
    Metal and the emulator run the same threads as CUDA.
    """
    group = tuple(min(t, g) if g > 0 else t for g, t in zip(grid, threadgroup))
    rounded = tuple(math.ceil(g / t) * t for g, t in zip(grid, group))
    return rounded, group  # type: ignore[return-value]


def default_agree(got, want, *args, **kwargs) -> Optional[str]:
    """Outputs within loose bf16-level tolerance, else a one-line mismatch."""
    got = got if isinstance(got, (list, tuple)) else [got]
    want = want if isinstance(want, (list, tuple)) else [want]
    for i, (g, w) in enumerate(zip(got, want)):
        if g.shape != w.shape:
            return f"output {i}: shape {g.shape} != reference {w.shape}"
        if not mx.allclose(g.astype(mx.float32), w.astype(mx.float32), rtol=2e-2, atol=2e-2).item():
            diff = mx.abs(g.astype(mx.float32) - w.astype(mx.float32)).max().item()
            return f"output {i}: max |kernel - reference| = {diff:.3g}"
    return None


def elementwise_mismatch(got, want, rel: float, of_max: float, most_differ: float = 0.01) -> Optional[str]:
    """None when every element is within ``rel |want| + of_max max|want|`` of
    the reference and at most a ``most_differ`` share of them differ at all,
    else a one-line mismatch: the judge of kernels that round where MLX's ops
    round, up to a rare one-step flip."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{tuple(got.shape)} {got.dtype} (reference: {tuple(want.shape)} {want.dtype})"
    g = np.array(got.astype(mx.float32), dtype=np.float64)
    w = np.array(want.astype(mx.float32), dtype=np.float64)
    err = np.abs(g - w)
    bound = rel * np.abs(w) + of_max * np.abs(w).max(initial=0.0)
    if not (err <= bound).all():
        at = int(np.argmax(err - bound))
        return f"{int((err > bound).sum())} of {err.size} off, e.g. {g.reshape(-1)[at]:.6g} against {w.reshape(-1)[at]:.6g}"
    differ = int((err > 0).sum())
    if differ > most_differ * err.size:
        return f"{differ} of {err.size} elements differ (at most {most_differ:.0%})"
    return None


def body_path(body: str) -> Path:
    """A body file: absolute, or relative to ``mlx_lily/kernels/``."""
    path = Path(body)
    return path if path.is_absolute() else KERNELS_DIR / path


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
                                     f"({_one_line(exc)}); each launch costs a few microseconds more")
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


class KernelGroup:
    """Several kernels behind one ``KernelLike`` (an op whose math takes more
    than one dispatch, or that routes calls between kernels by shape).
    Subclasses define ``ready_on(backend)`` and ``run_on(backend, ...)``."""

    def ready(self) -> tuple[bool, str]:
        backend, why = kernel_backend()
        if backend is None:
            return False, why
        return self.ready_on(backend)

    def emulate(self, *args, **kwargs):
        """Run in the CPU emulator, whatever the active backend."""
        return self.run_on("emulator", *args, **kwargs)


class SampleCheckedKernels(KernelGroup):
    """A KernelGroup of ``parts`` that run in sequence for one op, built and
    self-checked together once per backend on ``sample()``'s inputs.

    Subclasses set ``name``, ``parts``, ``sample`` and ``summary`` (what the
    passed self-check says) and define ``run_on`` and ``agree(got, want, *args,
    **kwargs)``, which judges the kernels against their own ground truth
    (``want`` supplies only the shape and dtype the result must have)."""

    name: str = ""
    parts: tuple = ()
    summary: str = ""

    def __init__(self):
        self._checked: dict = {}
        self._lock = threading.Lock()

    def sample(self) -> tuple:
        raise NotImplementedError

    def agree(self, got, want, *args, **kwargs) -> Optional[str]:
        raise NotImplementedError

    def ready_on(self, backend: str) -> tuple[bool, str]:
        known = self._checked.get(backend)
        if known is not None:
            return known
        with self._lock:
            if backend not in self._checked:
                result = self._self_check(backend)
                self._checked[backend] = result
                if not result[0]:
                    notice_once(f"kernel-off:{self.name}:{backend}",
                                f"kernel {self.name} is off on {backend} ({result[1]}); "
                                "its op runs the pure-MLX reference")
            return self._checked[backend]

    def _self_check(self, backend: str) -> tuple[bool, str]:
        for part in self.parts:
            ok, why = part.ready_on(backend)
            if not ok:
                return False, why
        args, kwargs = self.sample()
        try:
            got = self.run_on(backend, *args, **kwargs)
            mx.eval(got)
        except Exception as exc:  # compile errors surface at the first eval
            return False, f"{backend} self-check failed to run: {type(exc).__name__}: {exc}"[:300]
        mismatch = self.agree(got, got, *args, **kwargs)
        if mismatch is not None:
            return False, f"{backend} self-check disagrees with the reference: {mismatch}"
        return True, f"{backend} kernels ({self.summary}), self-check passed"

    def forget(self) -> None:
        with self._lock:
            self._checked.clear()
            for part in self.parts:
                part.forget()


@dataclass(eq=False)
class Kernel:
    """A lily kernel: a portable Metal-subset body plus its launcher.

    ``launch(*args, **kwargs) -> Launch`` maps the op's arguments to the
    kernel's inputs, grid and outputs. ``reference`` and ``sample`` are the
    op's (the self-check runs ``sample()``'s inputs through both);
    ``agree(got, want, *args, **kwargs)`` returns None when the kernel's result
    is acceptable, else why not.
    """

    name: str
    input_names: Sequence[str]
    output_names: Sequence[str]
    launch: Callable[..., Launch]
    # The body: a file name in kernels/ (``body``), or the text (``source``).
    body: Optional[str] = None
    source: Optional[str] = None
    # Extra Metal-subset code placed before the kernel on every backend.
    header: str = ""
    reference: Optional[Callable] = None
    sample: Optional[Callable[[], tuple]] = None
    agree: Callable[..., Optional[str]] = default_agree
    atomic_outputs: bool = False
    # Dynamic shared memory (bytes) to request on CUDA.
    shared_memory: int = 0
    # The body multiplies matrix tiles (lily_tile_*): the toolchain puts the
    # backend's implementation of the tile API before the header.
    tiles: bool = False
    # False: inputs reach the body as they are, strided views included (the
    # body indexes them through ``<name>_strides``); True: MLX copies any input
    # that is not row-contiguous first.
    row_contiguous: bool = True
    # name -> the declaration that stands in for that input or output where a
    # call leaves it out (``Launch.absent``), e.g. a pointer to another one
    # that the body then never reads or writes: each set of absent names is
    # its own build, with fewer arrays per launch for MLX to pass.
    stand_ins: Dict[str, str] = field(default_factory=dict)
    _text: Optional[str] = field(default=None, init=False, repr=False)
    _built: Dict[tuple, Callable] = field(default_factory=dict, init=False, repr=False)
    _checked: Dict[str, tuple[bool, str]] = field(default_factory=dict, init=False, repr=False)
    # (backend, template, input dtypes, absent names) -> None (passed) or why it is off.
    _instances: Dict[tuple, Optional[str]] = field(default_factory=dict, init=False, repr=False)
    # (backend, template, input dtypes, absent names) of every launch so far:
    # each is one build of the kernel (MLX caches builds by name and template
    # arguments; each set of absent names has its own name).
    launched: set = field(default_factory=set, init=False, repr=False)
    # absent names -> (header, source) as the CUDA build gave them to MLX.
    _cuda_texts: Dict[tuple, tuple] = field(default_factory=dict, init=False, repr=False)
    _lock: threading.RLock = field(default_factory=threading.RLock, init=False, repr=False)

    def __post_init__(self):
        if (self.body is None) == (self.source is None):
            raise ValueError(f"kernel {self.name!r}: give exactly one of body= or source=")
        KERNELS.setdefault(self.name, self)  # the first of a name: the package's

    # -- the KernelLike protocol ------------------------------------------

    def ready(self) -> tuple[bool, str]:
        backend, why = kernel_backend()
        if backend is None:
            return False, why
        return self.ready_on(backend)

    def __call__(self, *args, **kwargs):
        backend, why = kernel_backend()
        if backend is None:
            raise RuntimeError(f"kernel {self.name}: no kernel backend is active ({why})")
        return self.run_on(backend, *args, **kwargs)

    # -- explicit backends ---------------------------------------------------

    def emulate(self, *args, **kwargs):
        """Run the kernel in the CPU emulator, whatever the active backend."""
        return self.run_on("emulator", *args, **kwargs)

    def run_on(self, backend: str, *args, **kwargs):
        """Run on ``backend`` ('metal', 'cuda' or 'emulator'), no self-check."""
        return self._run_launch(backend, self.launch(*args, **kwargs))

    def run_checked(self, backend: str, *args, **kwargs) -> tuple[Any, Optional[str]]:
        """(result, None) from the kernel, or (the reference's result, why not).

        The first call of each instantiation (template arguments and input
        dtypes) runs the kernel and the reference on its inputs and compares
        them; later calls cost one dict look-up. A failing instantiation is
        off for the process, with one notice.
        """
        try:
            launch = self.launch(*args, **kwargs)
            key = launch.instance(backend)
        except Exception as exc:  # a launcher refusing a shape supports() let through
            return self._off(backend, None, f"launch failed: {_one_line(exc)}", args, kwargs)
        why_not = self._instances.get(key, _UNCHECKED)
        if why_not is None:
            return self._run_launch(backend, launch), None
        if why_not is not _UNCHECKED:
            return self.reference(*args, **kwargs), why_not
        with self._lock:
            return self._first_use(backend, key, launch, args, kwargs)

    def _first_use(self, backend, key, launch, args, kwargs) -> tuple[Any, Optional[str]]:
        if key in self._instances:  # another thread checked it meanwhile
            why_not = self._instances[key]
            if why_not is None:
                return self._run_launch(backend, launch), None
            return self.reference(*args, **kwargs), why_not
        if self.reference is None:
            self._instances[key] = None
            return self._run_launch(backend, launch), None
        started = time.perf_counter()
        try:
            # The inputs first: a failure upstream (an op the device cannot
            # run) is the caller's, raised as the reference path would raise
            # it, and no verdict on this kernel.
            mx.eval(list(launch.inputs))
        except Exception as exc:
            if _inside_transformation(exc):
                return self._unchecked_in_trace(args, kwargs)
            raise
        try:
            got = self._run_launch(backend, launch)
            mx.eval(got)
        except Exception as exc:  # a compile error of this instantiation surfaces here
            if _inside_transformation(exc):
                return self._unchecked_in_trace(args, kwargs)
            return self._off(backend, key, f"failed to run: {_one_line(exc)}", args, kwargs)
        kernel_done = time.perf_counter()
        want = self.reference(*args, **kwargs)
        mx.eval(want)
        FIRST_USE_TIME.add(kernel_done - started, time.perf_counter() - kernel_done)
        if not _all_finite(want):
            # Nothing to judge against (NaN or inf in the reference's result):
            # answer with the reference and check again on a later call.
            return want, "first use: the reference's result is not finite; not checked yet"
        try:
            mismatch = self.agree(got, want, *args, **kwargs)
        except Exception as exc:  # e.g. outputs of the wrong shape or dtype
            mismatch = f"comparison failed: {_one_line(exc)}"
        if mismatch is not None:
            return self._off(backend, key, f"disagrees with the reference: {mismatch}", args, kwargs, want)
        self._instances[key] = None
        return got, None

    def _unchecked_in_trace(self, args, kwargs) -> tuple[Any, str]:
        """Traced by mx.compile (say), where nothing can be evaluated: the
        reference answers, and a later call outside the trace checks the
        kernel (a failure here is no verdict on it). The count tells a
        compiled step to run eagerly and trace again."""
        _FIRST_USES_IN_TRACES[0] += 1
        return self.reference(*args, **kwargs), "first use inside a graph transformation; not checked yet"

    def _off(self, backend, key, why, args, kwargs, want=None) -> tuple[Any, str]:
        """Turn one instantiation off (key None: this call only), warn once, run the reference."""
        where = "this call" if key is None else describe_instance(key[1], key[2])
        why = f"{backend} kernel off for {where}: {why}"
        if key is not None:
            self._instances[key] = why
        notice_once(
            f"kernel-instance-off:{self.name}:{key}",
            f"kernel {self.name} {why}; those calls run the pure-MLX reference",
        )
        if self.reference is None:
            raise RuntimeError(f"kernel {self.name} {why} (and it has no reference)")
        if want is None:
            want = self.reference(*args, **kwargs)
        return want, why

    def _run_launch(self, backend: str, launch: Launch):
        grid, group = whole_threadgroups(tuple(launch.grid), tuple(launch.threadgroup))
        self._check_group(group)
        built = self._build(backend, launch.absent_set)
        instance = launch.instance(backend)
        if instance not in self.launched:
            if backend == "cuda" and not _TRACING.active:
                self._cached_module(launch)
            self.launched.add(instance)
        outputs = built(
            inputs=list(launch.inputs),
            template=list(launch.template) or None,
            grid=grid,
            threadgroup=group,
            output_shapes=[tuple(s) for s in launch.output_shapes],
            output_dtypes=list(launch.output_dtypes),
            init_value=launch.init_value,
        )
        return launch.finish(outputs) if launch.finish is not None else outputs

    def cuda_function(self, instance: "cuda_cache.Instance") -> tuple[str, str]:
        """(function name, source) MLX generates on CUDA for ``instance``."""
        from . import cuda_cache

        absent = instance.absent
        texts = self._cuda_texts.get(absent)  # as the build gave them to MLX
        if texts is None:
            texts = self.mlx_texts("cuda", by_include=cuda_includes_work(), absent=absent)
        header, source = texts
        function = "custom_kernel_" + self.backend_name("cuda", absent) + cuda_cache.template_suffix(instance.template)
        return function, cuda_cache.generated_source(
            function, header, source, self.present(self.input_names, absent), instance.input_ndims,
            self.present(self.output_names, absent), instance.output_dtypes, instance.input_dtypes,
            instance.template)

    def _cached_module(self, launch: Launch) -> None:
        """This instantiation's compiled module in MLX's folder before MLX
        looks for it (``toolchain/cuda_cache.py``); where that fails, MLX
        compiles it itself, as without the cache."""
        from . import cuda_cache

        cache = cuda_cache.module_cache()
        if cache is None:
            return
        try:
            cache.precompile(KERNELS)
            instance = cuda_cache.Instance.of(self, launch)
            cache.submit(*self.cuda_function(instance)).result()
            cache.record(instance)
        except Exception as exc:  # noqa: BLE001 - MLX's own compile still works
            notice_once(f"cuda-cache-failed:{self.name}", f"kernel {self.name}: lily's CUDA kernel cache "
                                                          f"could not compile it ({_one_line(exc)}); MLX compiles it")

    def ready_on(self, backend: str) -> tuple[bool, str]:
        """Build and self-check once per backend and process; warn once on failure."""
        known = self._checked.get(backend)
        if known is not None:  # every op call asks: answer without the lock
            return known
        with self._lock:
            if backend not in self._checked:
                ok, why = self._self_check(backend)
                self._checked[backend] = (ok, why)
                if not ok:
                    notice_once(
                        f"kernel-off:{self.name}:{backend}",
                        f"kernel {self.name} is off on {backend} ({why}); "
                        "its op runs the pure-MLX reference",
                    )
            return self._checked[backend]

    def forget(self) -> None:
        """Drop built kernels, self-check results and the cached body (tests)."""
        with self._lock:
            self._text = None
            self._built.clear()
            self._cuda_texts.clear()
            self._checked.clear()
            self._instances.clear()
            self.launched.clear()

    # -- sources -------------------------------------------------------------

    def backend_name(self, backend: str, absent: Tuple[str, ...] = ()) -> str:
        """The name MLX gets: ours plus a digest of everything compiled.

        MLX caches built kernels by name, in the process and (on CUDA) on disk
        across processes, not by source. A changed body, header or prelude
        under the same name would load a stale binary; the digest makes every
        distinct source a distinct name.
        """
        text = self.full_header(backend) + self.body_text(absent)
        digest = hashlib.sha256(text.encode()).hexdigest()[:12]
        return f"{self.name}_{digest}"

    def full_header(self, backend: str) -> str:
        """Everything compiled before the kernel on ``backend``."""
        text = self.header
        if self.tiles:
            text = tiles_source(backend) + text
        if backend == "cuda":
            text = cuda_prelude(text + self.body_text()) + text
        return text

    def mlx_texts(self, backend: str, by_include: bool = False, absent: Tuple[str, ...] = ()) -> tuple[str, str]:
        """(header, source) as MLX's kernel builder gets them on ``backend``:
        compacted on Metal and CUDA (``gpu_source``), and on CUDA with
        ``by_include`` the two include lines (``cuda_by_include``)."""
        header, body = self.full_header(backend), self.body_text(absent)
        if backend in ("metal", "cuda"):
            header, body = gpu_source(header), gpu_source(body)
        if backend == "cuda" and by_include:
            header, body = cuda_by_include(header, body, self.present(self.input_names, absent))
        return header, body

    def body_text(self, absent: Tuple[str, ...] = ()) -> str:
        """The body's source (read from its file once: launches ask on every
        call), after the stand-ins for the ``absent`` names."""
        if self._text is None:
            self._text = self.source if self.source is not None else body_path(self.body).read_text()
        if not absent:
            return self._text
        unknown = [n for n in absent if n not in self.stand_ins]
        if unknown:
            raise ValueError(f"kernel {self.name}: no stand-in for absent {', '.join(unknown)}")
        # On the body's first line, so that its line numbers stay the file's.
        return "".join(self.stand_ins[n] + " " for n in absent) + self._text

    @staticmethod
    def present(names: Sequence[str], absent: Tuple[str, ...]) -> list:
        """``names`` less the ``absent`` ones, in order."""
        return [n for n in names if n not in absent]

    def cuda_translation_unit(self, *args, by_include: bool = False, **kwargs) -> str:
        """The CUDA source MLX's cuda_kernel generates for this call
        (``cuda_cache.generated_source``, MLX 0.32's layout), so that the
        prelude and body can be compile-checked with nvcc without a GPU;
        ``by_include``: with the header and body as the CUDA build passes them
        when ``cuda_includes_work()`` (include lines).
        """
        from . import cuda_cache

        launch = self.launch(*args, **kwargs)
        absent = launch.absent_set
        header, text = self.mlx_texts("cuda", by_include, absent)
        function = "custom_kernel_" + self.backend_name("cuda", absent) + cuda_cache.template_suffix(launch.template)
        return cuda_cache.generated_source(
            function, header, text, self.present(self.input_names, absent), [a.ndim for a in launch.inputs],
            self.present(self.output_names, absent), launch.output_dtypes, [a.dtype for a in launch.inputs],
            launch.template)

    # -- internals -----------------------------------------------------------

    def _build(self, backend: str, absent: Tuple[str, ...] = ()) -> Callable:
        key = (backend, _TRACING.active, absent)
        built = self._built.get(key)
        if built is not None:
            return built
        with self._lock:
            if key not in self._built:
                self._built[key] = self._make(backend, row_contiguous=self.row_contiguous and not key[1],
                                              absent=absent)
            return self._built[key]

    def _make(self, backend: str, row_contiguous: bool, absent: Tuple[str, ...] = ()) -> Callable:
        header, source = self.mlx_texts(backend, by_include=backend == "cuda" and cuda_includes_work(),
                                        absent=absent)
        common = dict(
            name=self.backend_name(backend, absent),
            input_names=self.present(self.input_names, absent),
            output_names=self.present(self.output_names, absent),
            source=source,
            ensure_row_contiguous=row_contiguous,
        )
        if backend == "metal":
            return mx.fast.metal_kernel(
                header=header, atomic_outputs=self.atomic_outputs, **common
            )
        if backend == "cuda":
            self._cuda_texts[absent] = (header, source)
            return mx.fast.cuda_kernel(
                header=header, shared_memory=self.shared_memory, **common
            )
        if backend == "emulator":
            from ..emulator import metal_kernel as emulated_metal_kernel

            return emulated_metal_kernel(
                header=header, atomic_outputs=self.atomic_outputs, **common
            )
        raise ValueError(f"unknown kernel backend {backend!r} (one of {', '.join(BACKENDS)})")

    def _check_group(self, group: Dim3) -> None:
        threads = group[0] * group[1] * group[2]
        if threads > MAX_THREADGROUP:
            raise ValueError(
                f"kernel {self.name}: threadgroup of {threads} threads (at most {MAX_THREADGROUP})"
            )
        if threads % SIMD_WIDTH and _SIMD_USE.search(self.body_text()):
            raise ValueError(
                f"kernel {self.name}: threadgroup {group} is not a whole number of "
                f"{SIMD_WIDTH}-lane SIMD groups, which its SIMD-group functions need"
            )

    def _self_check(self, backend: str) -> tuple[bool, str]:
        try:
            self._build(backend)
        except Exception as exc:  # a missing emulator, an MLX without this backend
            return False, f"{backend} build failed: {_one_line(exc)}"
        if self.sample is None or self.reference is None:
            return True, f"{backend} kernel (no self-check: no sample or reference)"
        args, kwargs = self.sample()
        try:
            got = self.run_on(backend, *args, **kwargs)
            mx.eval(got)
        except Exception as exc:  # compile errors surface here, at the first eval
            return False, f"{backend} self-check failed to run: {_one_line(exc)}"
        want = self.reference(*args, **kwargs)
        mx.eval(want)
        try:
            mismatch = self.agree(got, want, *args, **kwargs)
        except Exception as exc:  # e.g. outputs of the wrong shape or dtype
            mismatch = f"comparison failed: {_one_line(exc)}"
        if mismatch is not None:
            return False, f"{backend} self-check disagrees with the reference: {mismatch}"
        return True, f"{backend} kernel, self-check passed"


# Marks an instantiation not yet checked (None means checked and passed).
_UNCHECKED = object()


def describe_instance(template, dtypes) -> str:
    """'T=bfloat16, E=256, ...; inputs bfloat16, ...' for notices."""
    def text(value):
        return str(value).rsplit(".", 1)[-1] if isinstance(value, mx.Dtype) else str(value)

    args = ", ".join(f"{name}={text(value)}" for name, value in template)
    return f"{args or 'no template'}; inputs {', '.join(text(d) for d in dtypes)}"


# Every kernel by name (the CUDA kernel cache finds recorded instances' kernels here).
KERNELS: Dict[str, "Kernel"] = {}

# First uses that met a graph transformation, so ran the reference unchecked.
_FIRST_USES_IN_TRACES = [0]


class _FirstUseTime:
    """Seconds spent in first-use checks so far in this process: building
    and running each instantiation (on CUDA mostly NVRTC's compile) and its
    reference; what a cold start costs beyond stock's (bench --cold-start)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.checks, self.kernel_s, self.reference_s = 0, 0.0, 0.0

    def add(self, kernel_s: float, reference_s: float) -> None:
        self.checks += 1
        self.kernel_s += kernel_s
        self.reference_s += reference_s

    def as_dict(self) -> dict:
        return {"checks": self.checks, "kernel_s": round(self.kernel_s, 3),
                "reference_s": round(self.reference_s, 3)}


FIRST_USE_TIME = _FirstUseTime()


def first_uses_in_traces() -> int:
    """How many first uses so far came inside a graph transformation: a
    compiled step whose trace raised this count holds references where a
    kernel would run once checked."""
    return _FIRST_USES_IN_TRACES[0]


def _inside_transformation(exc: Exception) -> bool:
    """Whether ``exc`` is MLX refusing to evaluate inside a graph
    transformation (compile, vmap, grad)."""
    return isinstance(exc, ValueError) and "during function transformations" in str(exc)


def _all_finite(result) -> bool:
    arrays = result if isinstance(result, (list, tuple)) else [result]
    for a in arrays:
        if isinstance(a, mx.array) and mx.issubdtype(a.dtype, mx.inexact):
            if not mx.isfinite(a).all().item():
                return False
    return True


def _one_line(exc: Exception) -> str:
    text = " ".join(str(exc).split())
    limit = 300
    return f"{type(exc).__name__}: {text[:limit]}{'...' if len(text) > limit else ''}"
