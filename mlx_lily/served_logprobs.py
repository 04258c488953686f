"""The server's read of each streamed token's log-probability, off the decode stream.

``mlx_lm.server`` answers every generated token with its log-probability,
``r.logprobs[r.token].item()``, on the stream its ``BatchGenerator`` decodes
on. By then the generator has already queued the next decode step on that
stream (so that the GPU runs it while the host handles this token), and the
read is a new op queued behind it: ``.item()`` waits for the whole next step,
and the host builds the step after it only once the GPU is idle. Host and
GPU then take turns instead of overlapping.

For a lily model the generator's responses (and those of the server's
one-request path) carry each row's log-probs as a ``RowLogprobs``: the same
array (no copy), whose integer and list indexing reads the row's memory on
the host (the buffer protocol; unified memory on Apple GPUs, managed memory
under MLX's CUDA backend) and answers with a new array holding those values,
the same bits. The row was evaluated with its own step, so nothing is queued
and nothing waits. (An index op on MLX's CPU stream, the first form of this,
still waited: on the H200 the server's loop between two steps took about the
next step's GPU time, 4.6 ms at one stream and 39.8 ms at 16, and on a CPU
each read took 1.4 ms.) Installed by the lily backend when ``mlx_lm.server``
loads a lily model (``install``)."""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx
import numpy as np

from ._notice import notice_once
from ._patches import Patches, program_module

_stock = Patches()


class RowLogprobs(mx.array):
    """A response row's log-probs; ``row[token]`` and ``row[[ids]]`` read the
    evaluated row on the host, queueing nothing. Where that read fails, it is
    made as stock makes it, after one notice."""

    def __init__(self, row: mx.array):
        super().__init__(row)
        # mx.array(row) is a new, unevaluated node over the row (evaluating it
        # would queue behind the next step); the host reads the row itself.
        self._row = row

    def __getitem__(self, index: Any) -> mx.array:
        if isinstance(index, (int, list)) and not isinstance(index, bool) and not _host_read_failed:
            try:
                return _host_read(self._row, index)
            except Exception as exc:  # noqa: BLE001 - the stock read below always works
                _host_read_fails(exc)
        return mx.array.__getitem__(self, index)


# The row's bytes as numpy reads them; bfloat16 has no numpy type, so its
# 16-bit words are read and widened to float32 (the same value).
_HOST_TYPES = {mx.float32: np.float32, mx.float16: np.float16, mx.bfloat16: np.uint16}


def _host_read(row: mx.array, index: Any) -> mx.array:
    """row[index] for a 1-D row already evaluated, read from its memory."""
    if row.ndim != 1 or row.dtype not in _HOST_TYPES:
        raise TypeError(f"a {row.ndim}-D {row.dtype} row")
    words = np.frombuffer(memoryview(row).cast("B"), dtype=_HOST_TYPES[row.dtype])
    picked = words[np.asarray(index, dtype=np.int64)]
    if row.dtype == mx.bfloat16:
        picked = (picked.astype(np.uint32) << 16).view(np.float32)
    # Exact: each value is representable in the row's dtype.
    return mx.array(picked.tolist(), dtype=row.dtype)


_host_read_failed = False


def _host_read_fails(exc: Exception) -> None:
    global _host_read_failed
    _host_read_failed = True
    notice_once("served-logprobs-host", f"reading log-probs on the host failed ({type(exc).__name__}: "
                                        f"{str(exc)[:160]}); the server reads them on its decode stream")


def _is_lily(model: Any) -> bool:
    return type(model).__module__.startswith("mlx_lily")


def _next(self: Any):
    """``GenerationBatch.next``; a lily model's rows as ``RowLogprobs``."""
    responses = _stock["next"](self)
    if responses and _is_lily(self.model):
        for r in responses:
            if type(r.logprobs) is mx.array:
                r.logprobs = RowLogprobs(r.logprobs)
    return responses


def _stream_generate(model: Any, *args: Any, **kwargs: Any):
    """The server's ``stream_generate`` (its one-request path: a request with
    a seed, a draft model, a quantized KV cache), which reads each token's
    log-prob the same way; a lily model's as ``RowLogprobs``."""
    lily = _is_lily(model)
    for response in _stock["stream_generate"](model, *args, **kwargs):
        if lily and type(response.logprobs) is mx.array:
            response.logprobs = RowLogprobs(response.logprobs)
        yield response


def install() -> None:
    """Wrap mlx-lm's ``GenerationBatch.next`` and the server's
    ``stream_generate`` (idempotent)."""
    if _stock:
        return
    gen = importlib.import_module("mlx_lm.generate")
    _stock.set("next", gen.GenerationBatch, "next", _next)
    try:
        server = program_module("mlx_lm.server")
        _stock.set("stream_generate", server, "stream_generate", _stream_generate)
    except (ImportError, AttributeError):
        pass


def uninstall() -> None:
    _stock.undo()


def installed() -> bool:
    return bool(_stock)
