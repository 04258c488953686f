"""Code generation: from a kernel body to a C++ translation unit.

Two outputs are built from the same description of the kernel:

* the Metal source MLX itself would generate (``metal_source``), following
  the rules of MLX's ``metal_kernel`` (mlx/backend/common/metal_kernel.cpp):
  builtin attributes detected by name in the source, inputs as
  ``const device T*`` (``const constant T&`` for 0-d arrays, ``constant``
  for arrays of fewer than 8 elements), ``<name>_shape/_strides/_ndim`` when
  the source mentions them, outputs as ``device T*`` (or ``device
  atomic<T>*``), template arguments spelled as MLX spells them;
* the C++ translation unit the emulator compiles (``cpp_source``): the same
  signature with checked pointer types, the header and body rewritten by
  ``translate`` and an entry point that runs the grid.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple, Union

import mlx.core as mx

from ..toolchain.type_names import MLX_TYPE_NAMES

# Arrays with fewer elements go to the constant address space (as MLX does).
MAX_CONSTANT_ARRAY_SIZE = 8

# Every attribute MLX recognises, with its type, in MLX's order. An attribute
# becomes a kernel parameter when its name occurs anywhere in the source.
METAL_ATTRIBUTES: Tuple[Tuple[str, str], ...] = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

# C++ expression (over `I`, a lily::rt::ThreadIds) giving each attribute.
_ATTRIBUTE_VALUES = {
    "dispatch_quadgroups_per_threadgroup": "I.dispatch_quadgroups_per_threadgroup",
    "dispatch_simdgroups_per_threadgroup": "I.dispatch_simdgroups_per_threadgroup",
    "dispatch_threads_per_threadgroup": "lily::to_uint3(I.dispatch_threads_per_threadgroup)",
    "grid_origin": "uint3(0u)",
    "grid_size": "lily::to_uint3(I.threads_per_grid)",
    "quadgroup_index_in_threadgroup": "I.quadgroup_index_in_threadgroup",
    "quadgroups_per_threadgroup": "I.quadgroups_per_threadgroup",
    "simdgroup_index_in_threadgroup": "I.simdgroup_index_in_threadgroup",
    "simdgroups_per_threadgroup": "I.simdgroups_per_threadgroup",
    "thread_execution_width": "32u",
    "thread_index_in_quadgroup": "I.thread_index_in_quadgroup",
    "thread_index_in_simdgroup": "I.thread_index_in_simdgroup",
    "thread_index_in_threadgroup": "I.thread_index_in_threadgroup",
    "thread_position_in_grid": "lily::to_uint3(I.thread_position_in_grid)",
    "thread_position_in_threadgroup": "lily::to_uint3(I.thread_position_in_threadgroup)",
    "threadgroup_position_in_grid": "lily::to_uint3(I.threadgroup_position_in_grid)",
    "threadgroups_per_grid": "lily::to_uint3(I.threadgroups_per_grid)",
    "threads_per_grid": "lily::to_uint3(I.threads_per_grid)",
    "threads_per_simdgroup": "32u",
    "threads_per_threadgroup": "lily::to_uint3(I.threads_per_threadgroup)",
}


TemplateValue = Union[bool, int, "mx.Dtype"]


def type_name(dtype: "mx.Dtype") -> str:
    """The C++/Metal spelling MLX uses for a dtype."""
    try:
        return MLX_TYPE_NAMES[dtype]
    except KeyError:
        raise ValueError(f"Unsupported compilation type {dtype}") from None


@dataclass(frozen=True)
class InputSpec:
    """What the generated signature depends on for one input."""

    name: str
    dtype: "mx.Dtype"
    ndim: int
    size: int

    @property
    def is_scalar(self) -> bool:
        return self.ndim == 0

    @property
    def address_space(self) -> str:
        return "constant" if self.size < MAX_CONSTANT_ARRAY_SIZE else "device"


@dataclass(frozen=True)
class Buffer:
    """One bound buffer, in MLX's binding order."""

    name: str
    role: str  # "input", "shape", "strides", "ndim", "output"
    index: int  # input or output index it belongs to


@dataclass(frozen=True)
class KernelSpec:
    """Everything the generated code of one kernel instance depends on."""

    name: str
    source: str
    header: str
    inputs: Tuple[InputSpec, ...]
    output_names: Tuple[str, ...]
    output_dtypes: Tuple["mx.Dtype", ...]
    template: Tuple[Tuple[str, TemplateValue], ...]
    atomic_outputs: bool

    # -- what MLX derives from the source text --

    def shape_info(self, name: str) -> Tuple[bool, bool, bool]:
        src = self.source
        return (
            f"{name}_shape" in src,
            f"{name}_strides" in src,
            f"{name}_ndim" in src,
        )

    def attributes(self) -> List[Tuple[str, str]]:
        return [(a, t) for a, t in METAL_ATTRIBUTES if a in self.source]

    def buffers(self) -> List[Buffer]:
        out: List[Buffer] = []
        for i, inp in enumerate(self.inputs):
            out.append(Buffer(inp.name, "input", i))
            if inp.ndim > 0:
                has_shape, has_strides, has_ndim = self.shape_info(inp.name)
                if has_shape:
                    out.append(Buffer(f"{inp.name}_shape", "shape", i))
                if has_strides:
                    out.append(Buffer(f"{inp.name}_strides", "strides", i))
                if has_ndim:
                    out.append(Buffer(f"{inp.name}_ndim", "ndim", i))
        for i, name in enumerate(self.output_names):
            out.append(Buffer(name, "output", i))
        return out

    # -- naming, as MLX does it --

    def template_def(self) -> str:
        parts = []
        for _, value in self.template:
            if isinstance(value, bool):
                parts.append("1" if value else "0")
            elif isinstance(value, int):
                parts.append(str(value))
            else:
                parts.append(type_name(value))
        return "<" + ", ".join(parts) + ">"

    def kernel_name(self) -> str:
        name = "custom_kernel_" + self.name
        if self.template:
            tdef = self.template_def()
            name += "_" + tdef.replace(", ", "_").replace("<", "_").replace(">", "_")[:-1]
        for inp in self.inputs:
            name += "_" + type_name(inp.dtype)
            if inp.ndim == 0:
                name += "s"
            elif inp.size < MAX_CONSTANT_ARRAY_SIZE:
                name += "c"
        for dtype in self.output_dtypes:
            name += "_" + type_name(dtype)
        return name

    def template_params(self) -> str:
        kinds = []
        for name, value in self.template:
            if isinstance(value, bool):
                kinds.append(f"bool {name}")
            elif isinstance(value, int):
                kinds.append(f"int {name}")
            else:
                kinds.append(f"typename {name}")
        return "template <" + ", ".join(kinds) + ">\n"


# ---------------------------------------------------------------------------
# The Metal source MLX would compile (shown by verbose=True)
# ---------------------------------------------------------------------------


def metal_source(spec: KernelSpec) -> str:
    params = []
    index = 0
    for inp in spec.inputs:
        ref = "&" if inp.is_scalar else "*"
        params.append(
            f"  const {inp.address_space} {type_name(inp.dtype)}{ref} {inp.name} "
            f"[[buffer({index})]]"
        )
        index += 1
        if inp.ndim > 0:
            has_shape, has_strides, has_ndim = spec.shape_info(inp.name)
            if has_shape:
                params.append(f"  const constant int* {inp.name}_shape [[buffer({index})]]")
                index += 1
            if has_strides:
                params.append(
                    f"  const constant int64_t* {inp.name}_strides [[buffer({index})]]"
                )
                index += 1
            if has_ndim:
                params.append(f"  const constant int& {inp.name}_ndim [[buffer({index})]]")
                index += 1
    for name, dtype in zip(spec.output_names, spec.output_dtypes):
        t = type_name(dtype)
        t = f"atomic<{t}>" if spec.atomic_outputs else t
        params.append(f"  device {t}* {name} [[buffer({index})]]")
        index += 1
    for attr, t in spec.attributes():
        params.append(f"  {t} {attr} [[{attr}]]")

    kname = spec.kernel_name()
    text = spec.header
    if spec.template:
        text += spec.template_params()
    text += f"[[kernel]] void {kname}(\n" + ",\n".join(params) + ") {\n"
    text += spec.source + "\n}\n"
    if spec.template:
        tdef = kname + spec.template_def()
        text += (
            f'\ntemplate [[host_name("{kname}")]] [[kernel]] decltype({tdef}) {tdef};\n'
        )
    return text


# ---------------------------------------------------------------------------
# The C++ translation unit
# ---------------------------------------------------------------------------


def _cpp_param(spec: KernelSpec, buf: Buffer) -> Tuple[str, str]:
    """(declaration in the kernel signature, argument expression) of a buffer.

    `B` is the lily::rt::Buffer array of the launch; `k` the buffer's index.
    """
    if buf.role == "input":
        inp = spec.inputs[buf.index]
        t = type_name(inp.dtype)
        if inp.is_scalar:
            return f"const {t}& {buf.name}", f"*reinterpret_cast<const {t}*>(B[{{k}}].data)"
        return f"lily::cptr<{t}> {buf.name}", _checked("lily::cptr", t)
    if buf.role == "shape":
        return f"lily::cptr<int> {buf.name}", _checked("lily::cptr", "int")
    if buf.role == "strides":
        return f"lily::cptr<int64_t> {buf.name}", _checked("lily::cptr", "int64_t")
    if buf.role == "ndim":
        return f"const int& {buf.name}", "*reinterpret_cast<const int*>(B[{k}].data)"
    t = type_name(spec.output_dtypes[buf.index])
    if spec.atomic_outputs:
        t = f"metal::atomic<{t}>"
    return f"lily::ptr<{t}> {buf.name}", _checked("lily::ptr", t)


def _checked(kind: str, t: str) -> str:
    return f"{kind}<{t}>(reinterpret_cast<{t}*>(B[{{k}}].data), B[{{k}}].lo, B[{{k}}].hi)"


def cpp_source(spec: KernelSpec, header: str, body: str) -> str:
    """The translation unit; `header` and `body` are already translated."""
    decls: List[str] = []
    args: List[str] = []
    for k, buf in enumerate(spec.buffers()):
        decl, arg = _cpp_param(spec, buf)
        decls.append("    " + decl)
        args.append("      " + arg.replace("{k}", str(k)))
    for attr, t in spec.attributes():
        decls.append(f"    {t} {attr}")
        args.append("      " + _ATTRIBUTE_VALUES[attr])

    instance = "lily_kernel"
    if spec.template:
        instance += spec.template_def()
    lines = [
        f"// Emulator translation of Metal kernel {spec.kernel_name()} (generated).",
        '#include "prelude_cpu.h"',
        '#line 1 "header"',
        header,
        '#line 1 "signature"',
        (spec.template_params() if spec.template else "") + "static void lily_kernel(",
        ",\n".join(decls) + ") {",
        '#line 1 "source"',
        body,
        "}",
        '#line 1 "entry"',
        "static void lily_thread_main(const lily::rt::Launch& L, "
        "const lily::rt::ThreadIds& I) {",
        "  const lily::rt::Buffer* B = L.buffers;",
        "  (void)B;",
        "  (void)I;",
        f"  {instance}(",
        ",\n".join(args) + ");",
        "}",
        "",
        'extern "C" __attribute__((visibility("default"))) int lily_launch(',
        "    lily::rt::Launch* L, char* err, int errlen) {",
        "  L->thread_main = &lily_thread_main;",
        "  return lily::rt::run(*L, err, errlen);",
        "}",
        "",
    ]
    return "\n".join(lines)


def make_spec(
    name: str,
    source: str,
    header: str,
    input_names: Sequence[str],
    inputs: Sequence["mx.array"],
    output_names: Sequence[str],
    output_dtypes: Sequence["mx.Dtype"],
    template: Optional[Sequence[Tuple[str, TemplateValue]]],
    atomic_outputs: bool,
) -> KernelSpec:
    specs = tuple(
        InputSpec(n, a.dtype, a.ndim, a.size) for n, a in zip(input_names, inputs)
    )
    return KernelSpec(
        name=name,
        source=source,
        header=header,
        inputs=specs,
        output_names=tuple(output_names),
        output_dtypes=tuple(output_dtypes),
        template=tuple(template or ()),
        atomic_outputs=atomic_outputs,
    )
