"""The server's read of each streamed token's log-probability, off the decode stream.

``mlx_lm.server`` answers every generated token with its log-probability,
``r.logprobs[r.token].item()``, on the stream its ``BatchGenerator`` decodes
on. By then the generator has already queued the next decode step on that
stream (so that the GPU runs it while the host handles this token), and the
read is a new op queued behind it: ``.item()`` waits for the whole next step,
and the host builds the step after it only once the GPU is idle. Host and
GPU then take turns instead of overlapping; on the H200 the host's share of a
step (building and launching ~370 kernels, ~7 ms) is as large as the GPU's.

For a lily model the generator's responses (and those of the server's
one-request path) carry each row's log-probs as a ``RowLogprobs``: the same array (no copy), whose integer and list indexing
runs on the CPU stream. The row was evaluated with its own step, so the read
waits for nothing queued after it; the CPU reads it in place (unified memory
on Apple GPUs, managed memory under MLX's CUDA backend). The values are the
same bits as the GPU's read. Installed by the lily backend when
``mlx_lm.server`` loads a lily model (``install``)."""

from __future__ import annotations

import importlib
from typing import Any

import mlx.core as mx

from ._notice import notice_once
from ._patches import Patches

_stock = Patches()


class RowLogprobs(mx.array):
    """A response row's log-probs; ``row[token]`` and ``row[[ids]]`` read on
    the CPU stream (evaluated there at once: the server reads them next).
    Where that read fails, it is made as stock makes it, after one notice."""

    def __getitem__(self, index: Any) -> mx.array:
        if isinstance(index, (int, list)) and not isinstance(index, bool) and not _cpu_read_failed:
            try:
                with mx.stream(mx.cpu):
                    out = mx.array.__getitem__(self, index)
                    mx.eval(out)
                return out
            except Exception as exc:  # noqa: BLE001 - the stock read below always works
                _cpu_read_fails(exc)
        return mx.array.__getitem__(self, index)


_cpu_read_failed = False


def _cpu_read_fails(exc: Exception) -> None:
    global _cpu_read_failed
    _cpu_read_failed = True
    notice_once("served-logprobs-cpu", f"reading log-probs on the CPU stream failed ({type(exc).__name__}: "
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
        server = importlib.import_module("mlx_lm.server")
        _stock.set("stream_generate", server, "stream_generate", _stream_generate)
    except (ImportError, AttributeError):
        pass


def uninstall() -> None:
    _stock.undo()


def installed() -> bool:
    return bool(_stock)
