"""Which path each layer and op call took, recorded on request.

Off by default (one attribute test per call). ``MLX_LILY_TRACE_PATHS=FILE``
turns it on at import and appends one JSON line to FILE the first time each
distinct kind of call is seen, e.g.

    {"layer": "Gated DeltaNet", "path": "lily", "batch": 2, "step": "prefill",
     "mask": "array", "cache": "ArraysCache+lengths"}
    {"op": "gated_delta", "path": "kernel", "reason": "cuda"}

so that a server's paths can be read while it runs. In a process,
``start()`` / ``stop()`` and ``seen()`` do the same without a file (tests).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from typing import Any, Optional

ENV = "MLX_LILY_TRACE_PATHS"

_lock = threading.Lock()
_seen: Optional[dict] = None  # key -> record, while recording
_file: Optional[str] = None


def start(path: Optional[str] = None) -> None:
    """Record from now on (and append new records to ``path``, if given)."""
    global _seen, _file
    with _lock:
        _seen, _file = {}, path


def stop() -> None:
    global _seen, _file
    with _lock:
        _seen, _file = None, None


@contextlib.contextmanager
def paused():
    """Record nothing inside the block (priming's synthetic prompts are not
    requests); what was recorded before stays."""
    global _seen, _file
    with _lock:
        saved, (_seen, _file) = (_seen, _file), (None, None)
    try:
        yield
    finally:
        with _lock:
            _seen, _file = saved


def active() -> bool:
    return _seen is not None


def seen() -> list[dict]:
    """The distinct records so far, in first-seen order."""
    with _lock:
        return list(_seen.values()) if _seen is not None else []


def record(**fields: Any) -> None:
    if _seen is None:
        return
    key = tuple(fields.items())
    if key in _seen:
        return
    with _lock:
        if _seen is None or key in _seen:
            return
        _seen[key] = fields
        if _file is not None:
            with open(_file, "a") as f:
                f.write(json.dumps(fields) + "\n")


def describe_mask(mask: Any) -> str:
    if mask is None:
        return "none"
    if isinstance(mask, str):
        return mask
    return "array"


def describe_cache(cache: Any) -> str:
    if cache is None:
        return "none"
    name = type(cache).__name__
    for attr in ("left_padding", "lengths"):
        if getattr(cache, attr, None) is not None:
            name += f"+{attr}"
    return name


if os.environ.get(ENV):
    start(os.environ[ENV])
