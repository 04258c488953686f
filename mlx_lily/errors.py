"""Errors lily raises for bad input (checkpoints, configs, flags), and how
command-line programs print them: one line, no traceback unless
``MLX_LILY_TRACEBACK=1``."""

from __future__ import annotations

import os
import sys
import threading

TRACEBACK_ENV = "MLX_LILY_TRACEBACK"


class LilyError(ValueError):
    """Base class: a ValueError so callers that catch mlx-lm's errors catch ours."""


class CheckpointError(LilyError):
    """A checkpoint lily cannot load: names the tensor or setting at fault."""


class ConfigError(CheckpointError):
    """A config.json field is missing or out of range: names the field."""


def one_line(error: BaseException) -> str:
    return f"mlx-lily: {error}"


def want_traceback() -> bool:
    return os.environ.get(TRACEBACK_ENV, "0") not in ("", "0")


def install_one_line_errors() -> None:
    """Make an uncaught LilyError print as one line (main thread and others,
    e.g. mlx_lm.server's generation thread). Other exceptions are untouched."""
    if want_traceback() or getattr(sys.excepthook, "_lily", False):
        return
    stock_hook, stock_thread_hook = sys.excepthook, threading.excepthook

    def excepthook(kind, value, tb):
        if isinstance(value, LilyError):
            print(one_line(value), file=sys.stderr, flush=True)
        else:
            stock_hook(kind, value, tb)

    def thread_excepthook(args):
        if isinstance(args.exc_value, LilyError):
            print(one_line(args.exc_value), file=sys.stderr, flush=True)
        else:
            stock_thread_hook(args)

    excepthook._lily = True  # type: ignore[attr-defined]
    sys.excepthook, threading.excepthook = excepthook, thread_excepthook
