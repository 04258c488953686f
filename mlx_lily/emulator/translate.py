"""Source rewriting: the few Metal constructs that C++ cannot express through
the prelude's types and macros alone (address-space pointers, threadgroup
declarations, loop guards, ``auto*``, half literals, Metal includes).

Every rewrite keeps the number of lines, so ``#line`` directives keep
compiler errors and runtime errors pointing at the lines of the body.

The rewrites one by one: docs/kernel-notes.md#emulator-translate.
"""

from __future__ import annotations

import itertools
import re
from typing import Iterator, List, Optional

_IDENT = r"[A-Za-z_]\w*"
# Template arguments, one level of nesting: vec<T, 4>, atomic<vec<...>>.
_TARGS = r"<(?:[^<>;{}]|<[^<>;{}]*>)*>"
_TYPE = (
    rf"(?:(?:unsigned|signed)\s+)?(?:::\s*)?{_IDENT}(?:\s*::\s*{_IDENT})*"
    rf"(?:\s*{_TARGS})?"
)

_POINTER = re.compile(
    rf"(?P<c1>\bconst\s+)?(?:\bvolatile\s+)?"
    rf"\b(?P<space>device|constant|threadgroup)\s+"
    rf"(?P<c2>const\s+)?(?:volatile\s+)?"
    rf"(?P<type>{_TYPE})\s*(?P<c3>\bconst\s*)?\*"
)

_TG_DECL = re.compile(
    rf"\bthreadgroup\s+(?P<type>{_TYPE})\s+(?P<decls>[\w\s\[\]()+\-*/%,<>.:]+?)\s*;"
)
_DECLARATOR = re.compile(r"^\s*(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\[\]]+\]\s*)*)$")

_HALF_LITERAL = re.compile(r"(?<![\w.])(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?[hH]\b")
_METAL_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*<metal_\w+>.*$", re.MULTILINE)


def _mask_comments(text: str) -> str:
    """`text` with comments and string/char literals blanked out (same
    length, newlines kept), so code patterns are not found inside them."""
    out = list(text)
    i, n = 0, len(text)

    def blank(a: int, b: int) -> None:
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            blank(i, j)
            i = j
        elif text[i] in "\"'":
            quote, j = text[i], i + 1
            while j < n and text[j] != quote and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            blank(i + 1, min(j, n))
            i = j + 1
        else:
            i += 1
    return "".join(out)


def _matching_paren(code: str, open_at: int) -> int:
    """Index of the ')' closing the '(' at `open_at`, or -1."""
    depth = 0
    for k in range(open_at, len(code)):
        if code[k] == "(":
            depth += 1
        elif code[k] == ")":
            depth -= 1
            if depth == 0:
                return k
        elif code[k] in "{}" and depth == 1:
            return -1  # not a loop header after all
    return -1


def _top_level(code: str, sep: str, opening: str = "([{", closing: str = ")]}") -> List[int]:
    """Indices of ``sep`` outside the ``opening``/``closing`` brackets."""
    depth, found = 0, []
    for k, ch in enumerate(code):
        if ch in opening:
            depth += 1
        elif ch in closing:
            depth -= 1
        elif ch == sep and depth == 0:
            found.append(k)
    return found


_LOOP = re.compile(r"\b(for|while)\s*\(")
_GUARD = "lily::rt::loop_guard()"


def _guard_loops(text: str) -> str:
    code = _mask_comments(text)
    out, pos = [], 0
    for m in _LOOP.finditer(code):
        open_at = m.end() - 1
        if open_at < pos:
            continue
        close = _matching_paren(code, open_at)
        if close < 0:
            continue
        inner_code = code[open_at + 1:close]
        inner = text[open_at + 1:close]
        if m.group(1) == "while":
            guarded = f"{_GUARD} && ({inner})"
        else:
            semis = _top_level(inner_code, ";")
            if len(semis) != 2:
                continue  # range-based for: bounded
            a, b = semis
            cond = inner[a + 1:b]
            cond = f"{_GUARD} && ({cond})" if cond.strip() else _GUARD
            guarded = inner[:a + 1] + " " + cond + inner[b:]
        out.append(text[pos:open_at + 1])
        out.append(guarded)
        pos = close
    out.append(text[pos:])
    return "".join(out)


def _same_lines(original: str, replacement: str) -> str:
    """Pads `replacement` with the newlines `original` spanned."""
    return replacement + "\n" * (original.count("\n") - replacement.count("\n"))


def _rewrite_pointer(m: "re.Match[str]") -> str:
    const = bool(m.group("c1") or m.group("c2") or m.group("c3"))
    # The constant address space is read-only.
    const = const or m.group("space") == "constant"
    t = re.sub(r"\s+", " ", m.group("type")).strip()
    kind = "lily::cptr" if const else "lily::ptr"
    closing = " >" if t.endswith(">") else ">"
    return _same_lines(m.group(0), f"{kind}<{t}{closing}")


def _split_top_level(text: str) -> List[str]:
    """Splits at commas outside brackets and parentheses."""
    cuts = [-1] + _top_level(text, ",", "[(", "])") + [len(text)]
    return [text[a + 1:b] for a, b in zip(cuts, cuts[1:])]


def _tg_declaration(t: str, declarator: str, slot: int) -> Optional[str]:
    m = _DECLARATOR.match(declarator)
    if not m:
        return None
    name = m.group("name")
    dims = re.findall(r"\[([^\[\]]+)\]", m.group("dims"))
    if not dims:
        return f'{t}& {name} = lily::tg_scalar<{t}>({slot}, "{name}");'
    sizes = ", ".join(f"({d.strip()})" for d in dims)
    return f'auto {name} = lily::tg_alloc<{t}, {sizes}>({slot}, "{name}");'


class Translator:
    """Rewrites header and body text; numbers threadgroup declarations."""

    def __init__(self) -> None:
        self._slots: Iterator[int] = itertools.count()

    def translate(self, text: str) -> str:
        text = _METAL_INCLUDE.sub(lambda m: "// " + m.group(0).strip(), text)
        text = _guard_loops(text)
        text = re.sub(r"(?:\bconst\s+)?\bauto\s*\*", "auto ", text)
        text = _HALF_LITERAL.sub(lambda m: f"half({m.group(1)}{m.group(2) or ''})", text)
        text = _POINTER.sub(_rewrite_pointer, text)
        text = re.sub(r"\breinterpret_cast\s*<\s*lily::", "static_cast<lily::", text)
        text = re.sub(r"\bconst_cast\s*<\s*lily::", "static_cast<lily::", text)
        text = _TG_DECL.sub(self._rewrite_tg_decl, text)
        return text

    def _rewrite_tg_decl(self, m: "re.Match[str]") -> str:
        t = re.sub(r"\s+", " ", m.group("type")).strip()
        out = []
        for declarator in _split_top_level(m.group("decls")):
            decl = _tg_declaration(t, declarator, next(self._slots))
            if decl is None:
                return m.group(0)  # not a declaration we understand: leave it
            out.append(decl)
        return _same_lines(m.group(0), " ".join(out))
