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
loads a lily model (``install``).

On CUDA that host read still costs: the row (half a megabyte of bf16 at a 248K
vocabulary) lives in managed memory, and the read, with the array it answers,
took about 0.09 ms a token on an H100 (py-spy in
bench/results/2026-12-05-nvidia-h100-0d4712e), once per row: 16 times a step
at 16 streams. ``MLX_LILY_STEP_PICKS=1`` tries the alternative: right
behind each decode step the generator queues, lily also queues the log-probs
of the tokens that step sampled, one small array for all its rows
(``StepPicks``), and the rows' reads of their own token come from that array,
read once a step. Any other index, a row that joined the batch since (its
first token comes from the prompt batch's step) or a picks read that fails
takes the host read above; the values are the same bits either way. It is off
until a GPU has timed both (``bench.diagnostics.serving.logprob_reads``; on a
2-core CPU the picks saved nothing)."""

from __future__ import annotations

import importlib
import os
from typing import Any, Optional

import mlx.core as mx
import numpy as np

from ._notice import notice_once
from ._patches import Patches, program_module

_stock = Patches()


class RowLogprobs(mx.array):
    """A response row's log-probs; ``row[token]`` and ``row[[ids]]`` read the
    evaluated row on the host, queueing nothing. Where that read fails, it is
    made as stock makes it, after one notice."""

    def __init__(self, row: mx.array, picks: Optional["StepPicks"] = None):
        super().__init__(row)
        # mx.array(row) is a new, unevaluated node over the row (evaluating it
        # would queue behind the next step); the host reads the row itself.
        self._row = row
        self._picks = picks

    def __getitem__(self, index: Any) -> mx.array:
        if self._picks is not None and isinstance(index, int) and not isinstance(index, bool):
            value = self._picks.value(self._row, index)
            if value is not None:
                return mx.array(value, dtype=self._row.dtype)
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


# "1": the generator's steps also queue their sampled tokens' log-probs
# (StepPicks), which the rows' reads of their tokens then take.
STEP_PICKS_ENV = "MLX_LILY_STEP_PICKS"
_picks_failed = False


def _picks_wanted() -> bool:
    return not _picks_failed and os.environ.get(STEP_PICKS_ENV, "0") == "1"


class StepPicks:
    """The log-probs of the tokens one decode step sampled, one per row,
    queued right behind that step: ``value(row, token)`` answers a row's read
    of its own token from them (None where it cannot: a row not of this
    step, another index). The array is read on the host once, at the first
    such read, when the step and this small launch behind it are done."""

    def __init__(self, rows: list, tokens: mx.array):
        self._rows = list(rows)  # held, so that each id below stays its row's
        self._where = {id(r): i for i, r in enumerate(self._rows)}
        self._tokens = tokens
        picked = mx.take_along_axis(mx.stack(self._rows), tokens.reshape(-1, 1), axis=-1)
        self._values = picked.reshape(-1)
        self._read: Optional[tuple] = None
        mx.async_eval(self._values)

    @classmethod
    def of_step(cls, rows: Any, tokens: Any) -> Optional["StepPicks"]:
        """Picks for a step's rows and sampled tokens, or None where they do
        not fit (no step queued, rows of several shapes or dtypes)."""
        if not rows or not isinstance(tokens, mx.array) or tokens.ndim != 1 or tokens.shape[0] != len(rows):
            return None
        first = rows[0]
        if not all(isinstance(r, mx.array) and r.ndim == 1 and r.shape == first.shape and r.dtype == first.dtype
                   for r in rows):
            return None
        return cls(rows, tokens)

    def value(self, row: mx.array, token: int) -> Optional[float]:
        i = self._where.get(id(row))
        if i is None or self._rows[i] is not row:
            return None
        try:
            if self._read is None:
                self._read = (self._tokens.tolist(), self._values.tolist())
        except Exception as exc:  # noqa: BLE001 - the row's own read below always works
            _picks_fail(exc)
            return None
        tokens, values = self._read
        return values[i] if tokens[i] == token else None


def _picks_fail(exc: Exception) -> None:
    global _picks_failed
    _picks_failed = True
    notice_once("served-logprobs-picks", f"reading a step's sampled log-probs failed ({type(exc).__name__}: "
                                         f"{str(exc)[:160]}); each row's value is read from the row instead")


def _host_read_fails(exc: Exception) -> None:
    global _host_read_failed
    _host_read_failed = True
    notice_once("served-logprobs-host", f"reading log-probs on the host failed ({type(exc).__name__}: "
                                        f"{str(exc)[:160]}); the server reads them on its decode stream")


def _is_lily(model: Any) -> bool:
    return type(model).__module__.startswith("mlx_lily")


def _next(self: Any):
    """``GenerationBatch.next``; a lily model's rows as ``RowLogprobs``, and
    (``_picks_wanted``) the sampled tokens' log-probs of the step it queued."""
    picks = self.__dict__.pop("_lily_picks", None)  # the step whose rows this call answers
    responses = _stock["next"](self)
    if not _is_lily(self.model):
        return responses
    for r in responses:
        if type(r.logprobs) is mx.array:
            r.logprobs = RowLogprobs(r.logprobs, picks)
    if _picks_wanted() and self.uids:
        try:
            made = StepPicks.of_step(self._next_logprobs, self._next_tokens)
        except Exception as exc:  # noqa: BLE001 - the rows' own reads always work
            _picks_fail(exc)
            made = None
        if made is not None:
            self.__dict__["_lily_picks"] = made
    return responses


def _filter(self: Any, keep: Any):
    """``GenerationBatch.filter`` (rows leaving between steps: a request
    removed, the batch emptied): the step's picks are dropped with it, so
    that they hold no rows the batch no longer has; the rows left read
    their next token from the row itself, once."""
    self.__dict__.pop("_lily_picks", None)
    return _stock["filter"](self, keep)


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
    """Wrap mlx-lm's ``GenerationBatch.next`` and ``filter`` and the
    server's ``stream_generate`` (idempotent)."""
    if _stock:
        return
    gen = importlib.import_module("mlx_lm.generate")
    _stock.set("next", gen.GenerationBatch, "next", _next)
    _stock.set("filter", gen.GenerationBatch, "filter", _filter)
    try:
        server = program_module("mlx_lm.server")
        _stock.set("stream_generate", server, "stream_generate", _stream_generate)
    except (ImportError, AttributeError):
        pass


def uninstall() -> None:
    _stock.undo()


def installed() -> bool:
    return bool(_stock)
