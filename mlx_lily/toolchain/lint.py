"""Lint lily's kernel bodies against the portable subset of Metal.

Run ``python -m mlx_lily.toolchain.lint [files...]`` (default: every
``*.metal`` body and ``*.metal.h`` header under ``mlx_lily/kernels/`` and
``mlx_lily/toolchain/``). It prints ``file:line: [rule] message`` per
violation and exits 1 if there are any. Each kernel body is built three ways
(Metal, CUDA after ``prelude_cuda.h``, the CPU emulator); the lint keeps every
body inside the subset that all three accept with the same meaning.

The portable subset (what a body may use, the rules the lint checks, and those
it cannot): docs/kernel-notes.md#lint.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

TOOLCHAIN_DIR = Path(__file__).resolve().parent
KERNELS_DIR = TOOLCHAIN_DIR.parent / "kernels"

SIMD_FUNCTIONS = frozenset(
    """simd_sum simd_product simd_max simd_min simd_and simd_or simd_xor
    simd_shuffle simd_shuffle_xor simd_shuffle_up simd_shuffle_down
    simd_shuffle_rotate_up simd_shuffle_rotate_down simd_broadcast
    simd_broadcast_first simd_prefix_inclusive_sum simd_prefix_exclusive_sum
    simd_all simd_any simd_ballot simd_is_first""".split()
)
ATOMIC_NAMES = frozenset(
    """atomic_fetch_add_explicit atomic_fetch_sub_explicit
    atomic_fetch_max_explicit atomic_fetch_min_explicit
    atomic_fetch_and_explicit atomic_fetch_or_explicit atomic_fetch_xor_explicit
    atomic_exchange_explicit atomic_load_explicit atomic_store_explicit
    atomic_compare_exchange_weak_explicit atomic_int atomic_uint atomic_float""".split()
)
_METAL_PLAIN = """exp exp2 log log2 sqrt rsqrt tanh sin cos abs fabs floor ceil
    round trunc pow fma fmax fmin max min clamp select""".split()
_METAL_FLAVOURED = "exp exp2 log log2 sqrt rsqrt tanh sin cos pow".split()
METAL_MATH = frozenset(
    _METAL_PLAIN
    + [f"fast::{n}" for n in _METAL_FLAVOURED]
    + [f"precise::{n}" for n in _METAL_FLAVOURED]
)
VECTOR_TYPES = frozenset(
    "float2 float3 float4 int2 int3 int4 uint2 uint3 uint4 half2".split()
)
# Barriers and SIMD-group functions: every thread (lane) must reach each one.
COLLECTIVES = re.compile(
    r"\b(threadgroup_barrier|simdgroup_barrier|"
    + "|".join(sorted(SIMD_FUNCTIONS))
    + r")\s*\("
)


@dataclass(frozen=True)
class Violation:
    path: str
    line: int
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: [{self.rule}] {self.message}"


# (rule, pattern, message): a match anywhere in the code is a violation.
_FORBIDDEN = [
    (
        "cuda-only",
        r"\b__\w+|\b(?:threadIdx|blockIdx|blockDim|gridDim|warpSize|cooperative_groups)\b"
        r"|\batomic(?:Add|Sub|Exch|Min|Max|Inc|Dec|CAS|And|Or|Xor)\w*|\bcg::",
        "CUDA-only name {0!r}: use the Metal spelling, which prelude_cuda.h maps",
    ),
    ("printf", r"\b(?:printf|os_log)\b", "{0!r}: kernels cannot print"),
    (
        "dynamic-memory",
        r"\b(?:new|delete|malloc|calloc|realloc|free|alloca)\b",
        "{0!r}: no dynamic memory in kernels",
    ),
    ("goto", r"\bgoto\b", "goto is not portable (and not needed)"),
    ("std", r"\b(?:std|cuda|thrust|cub)::", "{0!r}: no host or CUDA library namespaces"),
    (
        "lambda",
        r"(?:^|[=(,{;?:]|\breturn)\s*\[[^\[\]]*\]\s*(?:\(|\{|mutable\b)",
        "lambda: not in the subset",
    ),
    ("attribute", r"\[\[", "[[attributes]] belong to the generated signature, not the body"),
    ("double", r"\bdouble\b", "double: Metal has no 64-bit floats"),
    (
        "exceptions",
        r"\b(?:throw|try|catch|asm|typeid|dynamic_cast|virtual)\b",
        "{0!r}: not available in GPU code",
    ),
    (
        "metal-only",
        r"\b(?:texture\w*|sampler|imageblock\w*|depth2d\w*|acceleration_structure\w*"
        r"|\w+_function_table|as_type|numeric_limits|quad_\w+|quadgroup\w*"
        r"|thread_index_in_quadgroup|quadgroups_per_threadgroup|grid_size|grid_origin"
        r"|dispatch_\w+|discard_fragment)\b",
        "{0!r}: Metal feature that prelude_cuda.h does not define",
    ),
    (
        "metal-builtin",
        r"\b(?:fract|mix|saturate|sign|step|smoothstep|dot|length|length_squared|distance"
        r"|normalize|cross|reflect|refract|faceforward|popcount|clz|ctz|mulhi|mad|madhi"
        r"|madsat|extract_bits|insert_bits|reverse_bits|rotate|absdiff|addsat|subsat|hadd"
        r"|rhadd|powr|divide|median3|min3|max3|fmin3|fmax3|fmedian3|sinpi|cospi|tanpi"
        r"|isordered|isunordered|all|any)\s*\(",
        "{0!r}: Metal function that prelude_cuda.h does not define",
    ),
    (
        "simdgroup-matrix",
        r"\bsimdgroup_(?!barrier\b|index_in_threadgroup\b)\w+",
        "{0!r}: simdgroup matrices need a per-backend inner tile, not the shared subset",
    ),
    (
        "swizzle",
        r"\.(?:[xyzw]{2,4}|[rgba]{2,4})\b",
        "swizzle {0!r}: CUDA vectors have components only; use .x .y .z .w",
    ),
    (
        "vector-constructor",
        r"\b(?:float|half|int|uint|short|ushort|char|uchar|bool|long|ulong)[234]\s*\(",
        "{0!r}: construct vectors with braces ({{a, b}}), not a constructor call",
    ),
]
_FORBIDDEN_RE = [(rule, re.compile(p), msg) for rule, p, msg in _FORBIDDEN]

_VECTOR_TYPE = re.compile(
    r"\b(?:float|half|int|uint|short|ushort|char|uchar|bool|long|ulong|bfloat)[234](?:x[234])?\b"
)
_NAMED = [
    ("simd", re.compile(r"\bsimd_\w+"), SIMD_FUNCTIONS, "{0!r} is not in the subset's SIMD-group functions"),
    ("atomic", re.compile(r"\batomic_\w+"), ATOMIC_NAMES, "{0!r} is not in the subset's atomics"),
]
_METAL_NS = re.compile(r"\bmetal::((?:fast::|precise::)?\w+)")
_BFLOAT = re.compile(r"\bbfloat\b")
_FLOAT_LITERAL = re.compile(
    r"(?<![\w.])((?:\d+\.\d*|\.\d+)(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)([fFhH]?)(?![\w.])"
)
_DIRECTIVE = re.compile(r"^\s*#\s*(\w*)")
_HEADER_DIRECTIVES = {"define", "undef", "if", "ifdef", "ifndef", "else", "elif", "endif"}
_THREADGROUP = re.compile(r"\bthreadgroup\b")
_THREADGROUP_DECL = re.compile(
    r"threadgroup\s+(?:const\s+)?[A-Za-z_][\w:]*(?:\s*<[\w\s,:]*>)?\s+[A-Za-z_]\w*"
    r"(?:\s*\[[^\]\[;=]+\])*\s*;"
)
_RETURN = re.compile(r"\breturn\b")
_FUNCTION_DEF = re.compile(r"\b([A-Za-z_]\w*)\s*\([^;{}()]*(?:\([^()]*\)[^;{}()]*)*\)\s*(?:const\s*)?\{")
_CONTROL = {"if", "for", "while", "switch", "return", "sizeof", "catch"}


def strip_comments_and_strings(text: str) -> str:
    """Blank out comments and string/char literals, keeping line numbers."""
    out = []
    i, n = 0, len(text)
    while i < n:
        two = text[i : i + 2]
        if two == "//":
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif two == "/*":
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append("".join(c if c == "\n" else " " for c in text[i:j]))
            i = j
        elif text[i] in "\"'":
            quote, j = text[i], i + 1
            while j < n and text[j] != quote and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(quote + " " * max(j - i - 2, 0) + quote)
            i = j
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def lint_source(text: str, path: str = "<body>", kind: str = "body") -> list[Violation]:
    """Violations of the portable subset in one body (kind='body') or header."""
    if kind not in ("body", "header"):
        raise ValueError(f"kind must be 'body' or 'header', not {kind!r}")
    code = strip_comments_and_strings(text)
    found: list[Violation] = []

    def add(offset: int, rule: str, message: str) -> None:
        found.append(Violation(path, code.count("\n", 0, offset) + 1, rule, message))

    _check_directives(code, kind, add)
    for rule, pattern, message in _FORBIDDEN_RE:
        for m in pattern.finditer(code):
            add(m.start(), rule, message.format(m.group(0).strip()))
    _check_names(code, add)
    _check_literals(code, add)
    _check_threadgroup(code, kind, add)
    if kind == "body":
        _check_early_return(code, add)
    else:
        _check_recursion(code, add)
    return sorted(set(found), key=lambda v: (v.line, v.rule, v.message))


def _check_directives(code: str, kind: str, add) -> None:
    offset = 0
    for line in code.splitlines(keepends=True):
        m = _DIRECTIVE.match(line)
        if m:
            name = m.group(1)
            if kind == "body":
                add(offset, "directive", f"#{name} in a body: the body is pasted inside a function")
            elif name not in _HEADER_DIRECTIVES:
                add(offset, "directive", f"#{name}: headers may only #define and #if")
        offset += len(line)


def _check_names(code: str, add) -> None:
    for rule, pattern, allowed, message in _NAMED:
        for m in pattern.finditer(code):
            if m.group(0) not in allowed:
                add(m.start(), rule, message.format(m.group(0)))
    for m in _METAL_NS.finditer(code):
        if m.group(1) not in METAL_MATH:
            add(m.start(), "metal-ns", f"metal::{m.group(1)} is not defined by prelude_cuda.h")
    for m in _VECTOR_TYPE.finditer(code):
        if m.group(0) not in VECTOR_TYPES:
            add(m.start(), "vector-type", f"{m.group(0)}: not one of the subset's vector types")
    for m in _BFLOAT.finditer(code):
        add(m.start(), "bfloat", "bfloat: spell it bfloat16_t (MLX's name on every backend)")


def _check_literals(code: str, add) -> None:
    for m in _FLOAT_LITERAL.finditer(code):
        if not m.group(2):
            add(
                m.start(),
                "double-literal",
                f"{m.group(1)} without an f suffix: a double on CUDA, a float on Metal",
            )


def _depths(code: str) -> list[int]:
    """Brace depth before each character."""
    depths, depth = [], 0
    for c in code:
        depths.append(depth)
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
    return depths


def _check_threadgroup(code: str, kind: str, add) -> None:
    depths = None
    for m in _THREADGROUP.finditer(code):
        if kind == "header":
            add(m.start(), "threadgroup", "threadgroup in a header: declare threadgroup memory in the body")
            continue
        depths = depths or _depths(code)
        if depths[m.start()] != 0:
            add(m.start(), "threadgroup", "threadgroup memory must be declared at the body's top level")
        elif not _THREADGROUP_DECL.match(code, m.start()):
            add(
                m.start(),
                "threadgroup",
                "threadgroup only declares arrays or scalars (no pointers, references or initialisers)",
            )


def _check_early_return(code: str, add) -> None:
    collectives = [m.start() for m in COLLECTIVES.finditer(code)]
    if not collectives:
        return
    last = collectives[-1]
    for m in _RETURN.finditer(code):
        if m.start() < last:
            add(
                m.start(),
                "early-return",
                "return before a barrier or SIMD-group function: the threads that stay "
                "wait for it forever (guard loads and stores instead)",
            )


def _check_recursion(code: str, add) -> None:
    depths = _depths(code)
    for m in _FUNCTION_DEF.finditer(code):
        name = m.group(1)
        if name in _CONTROL or depths[m.start()] != 0:
            continue
        start = m.end()
        depth, end = 1, start
        while end < len(code) and depth:
            depth += {"{": 1, "}": -1}.get(code[end], 0)
            end += 1
        if re.search(rf"\b{re.escape(name)}\s*\(", code[start:end]):
            add(m.start(), "recursion", f"{name} calls itself: no recursion in GPU code")


def kernel_sources(*directories: Path) -> list[Path]:
    """Every kernel body and header in ``directories`` (default: the kernel
    families' package and the toolchain's own bodies and headers)."""
    found = []
    for directory in directories or (KERNELS_DIR, TOOLCHAIN_DIR):
        found += sorted(directory.rglob("*.metal")) + sorted(directory.rglob("*.metal.h"))
    return found


def lint_file(path: Path) -> list[Violation]:
    kind = "header" if path.name.endswith(".metal.h") else "body"
    try:
        shown = str(path.relative_to(Path.cwd()))
    except ValueError:
        shown = str(path)
    return lint_source(path.read_text(), shown, kind)


def lint_paths(paths: Iterable[Path]) -> list[Violation]:
    return [v for p in paths for v in lint_file(Path(p))]


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m mlx_lily.toolchain.lint", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="kernel sources to check (default: every body and header)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv).paths
    paths = [Path(a).resolve() for a in args] if args else kernel_sources()
    violations = lint_paths(paths)
    for v in violations:
        print(v)
    if violations:
        print(f"{len(violations)} violation(s) of lily's portable kernel subset", file=sys.stderr)
        return 1
    print(f"ok: {len(paths)} kernel source(s) in lily's portable subset")
    return 0


if __name__ == "__main__":
    sys.exit(main())
