"""Lily's kernel toolchain: one kernel body, built for whatever runs it.

Each lily kernel is written once, as a Metal Shading Language body in the
portable subset (``toolchain/lint.py``), in its own ``.metal`` file beside
its Python launcher. A :class:`Kernel` builds it for the active backend
(Metal, CUDA after ``prelude_cuda.h``, or the CPU emulator) and trusts it
only after a self-check against its op's reference; a failure turns it off
with one notice, and the op runs the reference.

The backends, the self-checks, and the launch rules applied on every backend:
docs/kernel-notes.md#kernel.
"""


from __future__ import annotations

import hashlib
import math
import re
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import mlx.core as mx

from .._notice import notice_once
from . import sources, tracing
from .contracts import all_finite, default_agree, one_line
from .registry import kernel_backend

# Apple GPUs and NVIDIA GPUs both run 32-lane SIMD groups (warps).
SIMD_WIDTH = 32
# The most threads a threadgroup may have on either backend.
MAX_THREADGROUP = 1024

BACKENDS = ("metal", "cuda", "emulator")

# Names whose presence in a body means it runs SIMD-group collectives.
_SIMD_USE = re.compile(r"\bsimd_\w+|\bsimdgroup_\w+|\bthread_index_in_simdgroup\b|\blily_tile_\w+")

Dim3 = tuple[int, int, int]


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


class Checked:
    """What every kernel object shares: ``ready()`` on the active backend,
    ``emulate``, and ``ready_on``: built and self-checked once per backend and
    process (``_self_check``), a failure turning it off with one notice.
    Subclasses set ``name``, ``_checked`` (a dict) and ``_lock``."""

    def ready(self) -> tuple[bool, str]:
        backend, why = kernel_backend()
        if backend is None:
            return False, why
        return self.ready_on(backend)

    def emulate(self, *args, **kwargs):
        """Run in the CPU emulator, whatever the active backend."""
        return self.run_on("emulator", *args, **kwargs)

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


class KernelGroup(Checked):
    """Several kernels behind one ``KernelLike`` (an op whose math takes more
    than one dispatch, or that routes calls between kernels by shape).
    Subclasses define ``ready_on(backend)`` and ``run_on(backend, ...)``."""


class SampleCheckedKernels(KernelGroup):
    """``parts`` that run in sequence for one op (``run(backend, ...)``),
    built and self-checked together once per backend on ``sample()``'s
    inputs (one call's ``(args, kwargs)``, or a list of them where the op
    takes different parts for different calls). ``summary`` is what the
    passed self-check says; ``agree(got,
    want, *args, **kwargs)`` judges the kernels against their own ground
    truth (``want`` supplies only the shape and dtype the result must have)."""

    def __init__(self, name: str, parts: Sequence["Kernel"], summary: str, sample: Callable[[], tuple],
                 run: Callable[..., Any], agree: Callable[..., Optional[str]]):
        self.name, self.parts, self.summary = name, tuple(parts), summary
        self.sample, self._run, self.agree = sample, run, agree
        self._checked: dict = {}
        self._lock = threading.Lock()

    def run_on(self, backend: str, *args, **kwargs):
        return self._run(backend, *args, **kwargs)

    def _self_check(self, backend: str) -> tuple[bool, str]:
        for part in self.parts:
            ok, why = part.ready_on(backend)
            if not ok:
                return False, why
        cases = self.sample()
        for args, kwargs in cases if isinstance(cases, list) else [cases]:
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
class Kernel(Checked):
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
    # The body: its file (``body``, beside the family's module), or the text (``source``).
    body: Optional[Path] = None
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

    def __call__(self, *args, **kwargs):
        backend, why = kernel_backend()
        if backend is None:
            raise RuntimeError(f"kernel {self.name}: no kernel backend is active ({why})")
        return self.run_on(backend, *args, **kwargs)

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
            return self._off(backend, None, f"launch failed: {one_line(exc)}", args, kwargs)
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
            if tracing.inside_transformation(exc):
                return self._unchecked_in_trace(args, kwargs, key)
            raise
        try:
            got = self._run_launch(backend, launch)
            mx.eval(got)
        except Exception as exc:  # a compile error of this instantiation surfaces here
            if tracing.inside_transformation(exc):
                return self._unchecked_in_trace(args, kwargs, key)
            return self._off(backend, key, f"failed to run: {one_line(exc)}", args, kwargs)
        kernel_done = time.perf_counter()
        want = self.reference(*args, **kwargs)
        mx.eval(want)
        tracing.FIRST_USE_TIME.add(kernel_done - started, time.perf_counter() - kernel_done)
        if not all_finite(want):
            # Nothing to judge against (NaN or inf in the reference's result):
            # answer with the reference and check again on a later call.
            return want, "first use: the reference's result is not finite; not checked yet"
        try:
            mismatch = self.agree(got, want, *args, **kwargs)
        except Exception as exc:  # e.g. outputs of the wrong shape or dtype
            mismatch = f"comparison failed: {one_line(exc)}"
        if mismatch is not None:
            return self._off(backend, key, f"disagrees with the reference: {mismatch}", args, kwargs, want)
        self._instances[key] = None
        return got, None

    def _unchecked_in_trace(self, args, kwargs, key) -> tuple[Any, str]:
        """Traced by mx.compile (say), where nothing can be evaluated: the
        reference answers, and a later call outside the trace checks the
        kernel (a failure here is no verdict on it). The count tells a
        compiled step to run eagerly and trace again."""
        tracing.count_first_use_in_trace(f"{self.name} ({describe_instance(key[1], key[2])})")
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
            if backend == "cuda" and not tracing.tracing():
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

    def cuda_function(self, instance: "cuda_cache.Instance", texts: Optional[tuple] = None) -> tuple[str, str]:
        """(function name, source) MLX generates on CUDA for ``instance``,
        from ``texts`` (header, body) or else as the build gave them to MLX."""
        from . import cuda_cache

        absent = instance.absent
        header, source = texts or self._cuda_texts.get(absent) or self.mlx_texts(
            "cuda", by_include=sources.cuda_includes_work(), absent=absent)
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
                                                          f"could not compile it ({one_line(exc)}); MLX compiles it")

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
            text = sources.tiles_source(backend) + text
        if backend == "cuda":
            text = sources.cuda_prelude(text + self.body_text()) + text
        return text

    def mlx_texts(self, backend: str, by_include: bool = False, absent: Tuple[str, ...] = ()) -> tuple[str, str]:
        """(header, source) as MLX's kernel builder gets them on ``backend``:
        compacted on Metal and CUDA (``gpu_source``), and on CUDA with
        ``by_include`` the two include lines (``cuda_by_include``)."""
        header, body = self.full_header(backend), self.body_text(absent)
        if backend in ("metal", "cuda"):
            header, body = sources.gpu_source(header), sources.gpu_source(body)
        if backend == "cuda" and by_include:
            header, body = sources.cuda_by_include(header, body, self.present(self.input_names, absent))
        return header, body

    def body_text(self, absent: Tuple[str, ...] = ()) -> str:
        """The body's source (read from its file once: launches ask on every
        call), after the stand-ins for the ``absent`` names."""
        if self._text is None:
            self._text = self.source if self.source is not None else Path(self.body).read_text()
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

        instance = cuda_cache.Instance.of(self, self.launch(*args, **kwargs))
        return self.cuda_function(instance, self.mlx_texts("cuda", by_include, instance.absent))[1]

    # -- internals -----------------------------------------------------------

    def _build(self, backend: str, absent: Tuple[str, ...] = ()) -> Callable:
        key = (backend, tracing.tracing(), absent)
        built = self._built.get(key)
        if built is not None:
            return built
        with self._lock:
            if key not in self._built:
                self._built[key] = self._make(backend, row_contiguous=self.row_contiguous and not key[1],
                                              absent=absent)
            return self._built[key]

    def _make(self, backend: str, row_contiguous: bool, absent: Tuple[str, ...] = ()) -> Callable:
        header, source = self.mlx_texts(backend, by_include=backend == "cuda" and sources.cuda_includes_work(),
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
            return False, f"{backend} build failed: {one_line(exc)}"
        if self.sample is None or self.reference is None:
            return True, f"{backend} kernel (no self-check: no sample or reference)"
        args, kwargs = self.sample()
        try:
            got = self.run_on(backend, *args, **kwargs)
            mx.eval(got)
        except Exception as exc:  # compile errors surface here, at the first eval
            return False, f"{backend} self-check failed to run: {one_line(exc)}"
        want = self.reference(*args, **kwargs)
        mx.eval(want)
        try:
            mismatch = self.agree(got, want, *args, **kwargs)
        except Exception as exc:  # e.g. outputs of the wrong shape or dtype
            mismatch = f"comparison failed: {one_line(exc)}"
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
