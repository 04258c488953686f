"""``metal_kernel``: the drop-in for ``mx.fast.metal_kernel``.

Marshals inputs and outputs between MLX arrays and host buffers, gets the
compiled kernel library from ``compiler`` and runs the grid through its
``lily_launch`` entry point.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from . import codegen
from .compiler import load_kernel
from .errors import (
    EmulatorError,
    KernelDeadlock,
    KernelOutOfBounds,
    KernelRuntimeError,
    KernelTimeout,
)
from .translate import Translator

MAX_THREADS_PER_THREADGROUP = 1024
DEFAULT_TIMEOUT_S = 60.0
_ERROR_BUFFER_BYTES = 16384

# numpy dtypes holding the bits of each MLX dtype (bfloat16 as uint16).
_NUMPY_BITS = {
    mx.float32: np.float32,
    mx.float16: np.float16,
    mx.bfloat16: np.uint16,
    mx.float64: np.float64,
    mx.bool_: np.bool_,
    mx.int8: np.int8,
    mx.int16: np.int16,
    mx.int32: np.int32,
    mx.int64: np.int64,
    mx.uint8: np.uint8,
    mx.uint16: np.uint16,
    mx.uint32: np.uint32,
    mx.uint64: np.uint64,
}

_STATUS_ERRORS = {
    1: KernelDeadlock,
    2: KernelOutOfBounds,
    3: KernelRuntimeError,
    4: KernelTimeout,
}


class _CBuffer(ctypes.Structure):
    """Mirrors lily::rt::Buffer."""

    _fields_ = [
        ("name", ctypes.c_char_p),
        ("type_name", ctypes.c_char_p),
        ("data", ctypes.c_void_p),
        ("lo", ctypes.c_void_p),
        ("hi", ctypes.c_void_p),
        ("elem_size", ctypes.c_int64),
    ]


class _CLaunch(ctypes.Structure):
    """Mirrors lily::rt::Launch."""

    _fields_ = [
        ("kernel_name", ctypes.c_char_p),
        ("grid", ctypes.c_uint32 * 3),
        ("threadgroup", ctypes.c_uint32 * 3),
        ("nbuffers", ctypes.c_int32),
        ("buffers", ctypes.POINTER(_CBuffer)),
        ("timeout_s", ctypes.c_double),
        ("thread_main", ctypes.c_void_p),
    ]


@dataclass
class _HostBuffer:
    """Host memory handed to the kernel: `data` is what the kernel sees,
    [lo, hi) what it may touch. `owner` keeps the memory alive."""

    owner: np.ndarray
    data: int
    lo: int
    hi: int
    elem_size: int
    type_name: str


def _check_dtype(dtype: "mx.Dtype", what: str) -> None:
    if dtype not in _NUMPY_BITS:
        raise ValueError(f"[metal_kernel emulator] unsupported {what} dtype {dtype}")


def _numpy_bits(a: mx.array) -> np.ndarray:
    """A numpy view of `a`'s memory with `a`'s strides (bfloat16 as uint16)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.asarray(a)


def _host_buffer(arr: np.ndarray, type_name: str) -> _HostBuffer:
    data = arr.ctypes.data
    return _HostBuffer(arr, data, data, data + arr.nbytes, arr.itemsize, type_name)


def _input_buffer(a: mx.array, row_contiguous: bool) -> Tuple[_HostBuffer, List[int]]:
    """Host copy of an input and the strides (in elements) the kernel sees."""
    view = _numpy_bits(a)
    tname = codegen.type_name(a.dtype)
    item = view.itemsize
    if row_contiguous or view.ndim == 0:
        # A row-contiguous array is passed as it is (with its own strides,
        # which may differ on size-1 axes); any other is copied.
        source = view if view.flags.c_contiguous else np.ascontiguousarray(view)
        host = np.array(source, order="C", copy=True)
        strides = [s // item for s in source.strides]
        return _host_buffer(host, tname), strides
    # As MLX passes it: the original layout, with its strides (possibly
    # zero or negative). Copy exactly the bytes those strides can reach.
    lo_off = sum(min(0, (n - 1) * s) for n, s in zip(view.shape, view.strides))
    hi_off = sum(max(0, (n - 1) * s) for n, s in zip(view.shape, view.strides)) + item
    span = hi_off - lo_off if view.size else 0
    host = np.empty(span, dtype=np.uint8)
    if span:
        base = view.__array_interface__["data"][0]
        ctypes.memmove(host.ctypes.data, base + lo_off, span)
    start = host.ctypes.data
    buf = _HostBuffer(host, start - lo_off, start, start + span, item, tname)
    return buf, [s // item for s in view.strides]


def _as_array(x: Any) -> mx.array:
    """Inputs as MLX converts them: bool -> bool_, int -> int32 (int64 when
    out of range), float -> float32, array-likes via mx.array."""
    if isinstance(x, mx.array):
        return x
    return mx.array(x)


def _output_buffer(shape: Tuple[int, ...], dtype: "mx.Dtype",
                   init_value: Optional[float], type_name: str) -> _HostBuffer:
    if init_value is not None:
        bits = _numpy_bits(mx.full(shape, init_value, dtype=dtype))
        host = np.array(bits, order="C", copy=True)
    else:
        # Uninitialised outputs are poisoned: all bits set, i.e. NaN for
        # float types and -1 for signed integers, so reads of unwritten
        # elements show.
        host = np.empty(shape, dtype=_NUMPY_BITS[dtype])
        host.view(np.uint8).fill(0xFF)
    return _host_buffer(host, type_name)


def _to_mlx(buf: _HostBuffer, shape: Tuple[int, ...], dtype: "mx.Dtype") -> mx.array:
    arr = buf.owner.reshape(shape)
    if dtype == mx.bfloat16:
        return mx.array(arr).view(mx.bfloat16)
    return mx.array(arr, dtype=dtype)


def _check_size(actual: int, expected: int, what: str) -> None:
    if actual != expected:
        raise ValueError(
            f"[metal_kernel] Expected `{what}` to have size {expected} but got size {actual}."
        )


def _dims3(value: Sequence[int], what: str) -> Tuple[int, int, int]:
    dims = tuple(int(v) for v in value)
    if len(dims) != 3:
        raise ValueError(f"[metal_kernel] `{what}` must have 3 dimensions, got {value!r}.")
    if any(d < 0 for d in dims):
        raise ValueError(f"[metal_kernel] `{what}` must not be negative, got {value!r}.")
    return dims  # type: ignore[return-value]


def _template_args(template) -> Tuple[Tuple[str, Any], ...]:
    out = []
    for name, value in template or ():
        if not isinstance(value, (bool, int, mx.Dtype)):
            raise ValueError(
                "[metal_kernel] Invalid template argument. Must be `mlx.core.Dtype`, "
                "`int` or `bool`."
            )
        out.append((str(name), value))
    return tuple(out)


def _timeout() -> float:
    return float(os.environ.get("MLX_LILY_EMULATOR_TIMEOUT", DEFAULT_TIMEOUT_S))


class EmulatedKernel:
    """The callable `metal_kernel` returns; call it as MLX's kernels."""

    def __init__(self, name, input_names, output_names, source, header,
                 ensure_row_contiguous, atomic_outputs, compile_options):
        if not output_names:
            raise ValueError("[metal_kernel] Must specify at least one output.")
        if compile_options is not None and not isinstance(compile_options, dict):
            raise ValueError("[metal_kernel] Expected `compile_options` to be a dict.")
        for key, value in (compile_options or {}).items():
            if key != "math_mode":
                raise ValueError(f"[metal_kernel] Unknown compile option `{key}`.")
            if value not in ("safe", "relaxed", "fast"):
                raise ValueError(
                    "[metal_kernel] Expected math_mode to be 'safe', 'relaxed', or 'fast'."
                )
        # compile_options only tune Metal's math library; the emulator always
        # uses the host's (see the package docstring).
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.ensure_row_contiguous = ensure_row_contiguous
        self.atomic_outputs = atomic_outputs
        # Translation depends only on the text, so do it once.
        translator = Translator()
        self._header_cpp = translator.translate(header)
        self._source_cpp = translator.translate(source)

    def __repr__(self) -> str:
        return f"<emulated metal_kernel {self.name!r}>"

    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup,
                 template=None, init_value=None, verbose=False, stream=None):
        del stream  # the emulator runs on the host and returns evaluated arrays
        _check_size(len(inputs), len(self.input_names), "inputs")
        _check_size(len(output_shapes), len(self.output_names), "output_shapes")
        _check_size(len(output_dtypes), len(self.output_names), "output_dtypes")
        grid = _dims3(grid, "grid")
        threadgroup = _dims3(threadgroup, "threadgroup")
        tg_size = threadgroup[0] * threadgroup[1] * threadgroup[2]
        if tg_size > MAX_THREADS_PER_THREADGROUP:
            raise ValueError(
                f"Thread group size ({tg_size}) is greater than  the maximum allowed "
                f"threads per threadgroup ({MAX_THREADS_PER_THREADGROUP})."
            )
        arrays = [_as_array(x) for x in inputs]
        for a in arrays:
            _check_dtype(a.dtype, "input")
        for dtype in output_dtypes:
            _check_dtype(dtype, "output")
        shapes = [tuple(int(d) for d in s) for s in output_shapes]
        spec = codegen.make_spec(
            self.name, self.source, self.header, self.input_names, arrays,
            self.output_names, list(output_dtypes), _template_args(template),
            self.atomic_outputs,
        )
        if verbose:
            print(f"Generated source code for `{self.name}`:\n```\n"
                  f"{codegen.metal_source(spec)}\n```")
        cpp = codegen.cpp_source(spec, self._header_cpp, self._source_cpp)
        lib = load_kernel(self.name, cpp)

        buffers, outputs = self._buffers(spec, arrays, shapes, init_value)
        # Metal clamps the threadgroup to the grid (as MLX's dispatch does).
        dispatch = tuple(min(t, g) for t, g in zip(threadgroup, grid))
        if all(grid) and not all(dispatch):
            raise ValueError(f"[metal_kernel] `threadgroup` must be positive, got {threadgroup}.")
        self._launch(lib, spec, buffers, grid, dispatch)
        return [_to_mlx(buffers[i], shape, dtype)
                for i, shape, dtype in zip(outputs, shapes, output_dtypes)]

    def _buffers(self, spec, arrays, shapes, init_value):
        """Host buffers in MLX's binding order; indices of the outputs."""
        inputs: List[Tuple[_HostBuffer, List[int]]] = [
            _input_buffer(a, self.ensure_row_contiguous) for a in arrays
        ]
        out: List[_HostBuffer] = []
        outputs: List[int] = []
        for buf in spec.buffers():
            if buf.role == "input":
                out.append(inputs[buf.index][0])
            elif buf.role == "shape":
                dims = np.array(arrays[buf.index].shape, dtype=np.int32)
                out.append(_host_buffer(dims, "int"))
            elif buf.role == "strides":
                strides = np.array(inputs[buf.index][1], dtype=np.int64)
                out.append(_host_buffer(strides, "int64_t"))
            elif buf.role == "ndim":
                out.append(_host_buffer(np.array([arrays[buf.index].ndim], np.int32), "int"))
            else:
                dtype = spec.output_dtypes[buf.index]
                outputs.append(len(out))
                out.append(_output_buffer(shapes[buf.index], dtype, init_value,
                                          codegen.type_name(dtype)))
        return out, outputs

    def _launch(self, lib, spec, buffers, grid, dispatch) -> None:
        names = [b.name.encode() for b in spec.buffers()]
        cbufs = (_CBuffer * len(buffers))()
        for c, b, n in zip(cbufs, buffers, names):
            c.name = n
            c.type_name = b.type_name.encode()
            c.data, c.lo, c.hi, c.elem_size = b.data, b.lo, b.hi, b.elem_size
        launch = _CLaunch()
        launch.kernel_name = self.name.encode()
        launch.grid[:] = list(grid)
        launch.threadgroup[:] = list(dispatch)
        launch.nbuffers = len(buffers)
        launch.buffers = cbufs
        launch.timeout_s = _timeout()
        err = ctypes.create_string_buffer(_ERROR_BUFFER_BYTES)
        # The library serialises launches itself (one runtime per library).
        status = lib.lily_launch(ctypes.byref(launch), err, len(err))
        if status != 0:
            cls = _STATUS_ERRORS.get(status, EmulatorError)
            raise cls(
                f"[metal_kernel emulator] kernel '{self.name}': "
                f"{err.value.decode(errors='replace')}",
                kernel=self.name,
            )


def metal_kernel(name: str, input_names: Sequence[str], output_names: Sequence[str],
                 source: str, header: str = "", ensure_row_contiguous: bool = True,
                 atomic_outputs: bool = False,
                 compile_options: Optional[Dict[str, str]] = None) -> EmulatedKernel:
    """Same signature and behaviour as ``mx.fast.metal_kernel``, but the
    kernel runs on the CPU under the emulator (see the package docstring)."""
    return EmulatedKernel(name, input_names, output_names, source, header,
                          ensure_row_contiguous, atomic_outputs, compile_options)
