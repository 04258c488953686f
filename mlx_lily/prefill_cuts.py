"""Where a prompt's prefill is cut into calls, and which cuts change its bits.

A prefill runs as calls of consecutive tokens (mlx-lm's chunks). Prefix
reuse gives a cold prefill's bits only when the resumed prefill (a checkpoint
of an earlier prompt, then the rest of the new prompt in the generator's
chunks) cuts the prompt where the cold prefill does, or differs from it only
by cuts that change no bit. On lily's path a cut between two calls of at
least ``INVARIANT_FROM`` tokens, a whole number of ``PIECE``-token chunks
after the start of the run of calls it continues, changes no bit:

* the chunked Gated DeltaNet splits a call into 64-token chunks from its
  first token and carries the state between them as it carries it between
  calls (every call of a chunk or more takes the chunked form:
  ``gated_delta.CHUNKED_FROM``);
* the quantized linears and the MoE give a token the same bits in any call of
  8 rows or more (measured on CUDA: ``bench.diagnostics.prefill.packed_rows``;
  the CPU's matmuls are row-exact);
* attention gives a query the same bits in any causal call whose keys are a
  multiple of 8 (lily's prefill kernel by construction; MLX's sdpa on CUDA
  measured, ``bench.diagnostics.prefill.sdpa_rows``, and lily pads its keys
  to one: ``kernels/attention/sdpa.py``).

``visible_cuts`` drops such cuts; two prefills with the same visible cuts
give the same bits (``bench.diagnostics.prefill.cut_invariance`` on the
H200). Where that was not measured (Metal: MLX's own quantized matmuls
switch forms by row count), every cut counts. Design: docs/prefix-reuse.md.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from .kernels.gated_delta.chunked import CHUNK
from .kernels.gated_delta.recurrence import CHUNKED_FROM
from .toolchain.registry import gpu_backend

PIECE = CHUNK
INVARIANT_FROM = CHUNKED_FROM
# Devices whose prefill keeps those bits (measured), None standing for the CPU.
INVARIANT_DEVICES = ("cuda", None)


def cuts_merge() -> bool:
    """Whether chunk-aligned cuts change no bit on this device (module docstring)."""
    return gpu_backend() in INVARIANT_DEVICES


def _segments(length: int, segments: Optional[Sequence[int]]) -> List[int]:
    segs = [n for n in (segments or [length]) if n > 0]
    return segs if sum(segs) == length else [length]


def cold_cuts(length: int, segments: Optional[Sequence[int]], step: int) -> List[int]:
    """Where mlx-lm's batch generator ends each prefill chunk of a prompt of
    ``length`` tokens split into ``segments`` (lengths; None: one segment):
    every ``step`` tokens within a segment and at its end; the prompt's last
    token is split off as the first decode step (no chunk ends after it).
    ``generate_step`` (``mlx_lm.generate``, the server's single requests)
    cuts a one-segment prompt the same way."""
    segs = _segments(length, segments)
    if not segs:
        return []
    if segs[-1] != 1:
        segs[-1] -= 1
        segs.append(1)
    cuts, pos = [], 0
    for n in segs[:-1]:
        end = pos + n
        while pos < end:
            pos = min(pos + step, end)
            cuts.append(pos)
    return cuts


def resumed_cuts(length: int, segments: Optional[Sequence[int]], step: int, start: int) -> List[int]:
    """The chunk ends of a prompt resumed at token ``start``: mlx-lm's server
    drops the reused tokens from the front of the segments and the generator
    chunks the rest as a prompt of its own."""
    segs = _segments(length, segments)
    left = start
    while left > 0 and segs:
        if left >= segs[0]:
            left -= segs.pop(0)
        else:
            segs[0] -= left
            left = 0
    return [start + c for c in cold_cuts(length - start, segs, step)]


def visible_cuts(ends: Sequence[int], merge: bool = True) -> Tuple[int, ...]:
    """The call ends (from token 0) that decide a prefill's bits: with
    ``merge``, a call of at least INVARIANT_FROM tokens that starts a whole
    number of PIECEs into the run before it joins that run."""
    out: List[int] = []
    run_start = call_start = 0
    for end in ends:
        if merge and out and end - call_start >= INVARIANT_FROM and (call_start - run_start) % PIECE == 0:
            out[-1] = end
        else:
            out.append(end)
            run_start = call_start
        call_start = end
    return tuple(out)


def on_piece_grid(cuts: Sequence[int], merge: bool = True) -> bool:
    """Whether the last of ``cuts`` ends a whole number of PIECEs into its
    run, so that a later prefill may continue the run from there."""
    seen = visible_cuts(cuts, merge)
    if not seen:
        return False
    start = seen[-2] if len(seen) > 1 else 0
    return merge and (seen[-1] - start) % PIECE == 0


def exact_from(cuts: Optional[Sequence[int]], position: int, length: int, segments: Optional[Sequence[int]],
               step: int, merge: bool) -> bool:
    """Whether resuming a prompt of ``length`` tokens (``segments``, chunks of
    ``step``) at ``position`` from states made by calls ending at ``cuts``
    gives a cold prefill's bits: the same visible cuts (without ``merge``:
    the same cuts)."""
    if cuts is None or not cuts or cuts[-1] != position:
        return False
    cold = cold_cuts(length, segments, step)
    resumed = list(cuts) + resumed_cuts(length, segments, step, position)
    return visible_cuts(resumed, merge) == visible_cuts(cold, merge)
