"""One-line notices, each printed once per process (to stderr)."""

from __future__ import annotations

import sys

_seen: set[str] = set()


def notice_once(key: str, message: str) -> None:
    if key in _seen:
        return
    _seen.add(key)
    print(f"[mlx-lily] {message}", file=sys.stderr, flush=True)


def reset_notices() -> None:
    """Forget which notices were shown (tests)."""
    _seen.clear()
