"""The gated delta rule over prompt rows of different lengths, one batch.

The server prefills prompts that arrive together as one call
(``layers/prompt_rows.py``), each row on its own state. Run one row at a time,
the recurrence of a few hundred tokens is bound by its launches; here the
rows run as one right-padded batch through the chunked passes, which read
each row's own length (its padding counts as tokens past the end: no decay,
no write). So a row's outputs up to its length, and its state after them,
are the bits the row alone gets from ``gated_delta``. Rows shorter than
``CHUNKED_FROM`` take the sequential scan alone, so the op does not take
them; neither does it take anything the chunked passes do not.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx
from mlx_lm.models.gated_delta import gated_delta_update

from ...toolchain.kernel import SampleCheckedKernels
from ...toolchain.registry import LilyOp, kernel_backend, register
from .chunked import CHUNK, CHUNKED_KERNELS, gated_delta_chunked_run
from .recurrence import (
    CHUNKED_FROM,
    _sample_recurrence,
    gated_delta_agree,
    gated_delta_compare,
    gated_delta_reference,
    uses_chunked,
)


def padding_mask(lengths: Sequence[int], steps: int) -> mx.array:
    """[B, steps] bool: True for each row's own tokens."""
    return mx.arange(steps)[None] < mx.array(list(lengths))[:, None]


def _zero_padding(y: mx.array, mask: mx.array) -> mx.array:
    return mx.where(mask[..., None, None], y, mx.zeros((), y.dtype))


def gated_delta_rows_reference(q, k, v, a, b, A_log, dt_bias, state, lengths: Sequence[int], capture: bool = False):
    """q, k [B, T, Hk, Dk]; v [B, T, Hv, Dv]; a, b [B, T, Hv]; state [B, Hv,
    Dv, Dk] fp32 or None; ``lengths`` B ints, each at most T (row b's tokens
    are its first lengths[b]) -> (y [B, T, Hv, Dv], zero past each row's
    length; the state after each row's tokens), with ``capture`` also each
    row's state after its whole chunks (``gated_delta``'s capture, per row).
    Stock's update with the padding masked: a masked step leaves the state
    as it was."""
    mask = padding_mask(lengths, q.shape[1])
    if not capture:
        y, state = gated_delta_update(q, k, v, a, b, A_log, dt_bias, state, mask)
        return _zero_padding(y, mask), state
    rows = [gated_delta_reference(*(x[r : r + 1, :n] for x in (q, k, v, a, b)), A_log, dt_bias,
                                  None if state is None else state[r : r + 1], capture=True)
            for r, n in enumerate(lengths)]
    T = q.shape[1]
    y = mx.concatenate([mx.pad(y_r, [(0, 0), (0, T - y_r.shape[1]), (0, 0), (0, 0)]) for y_r, _, _ in rows])
    return y, mx.concatenate([s for _, s, _ in rows]), mx.concatenate([p for _, _, p in rows])


def gated_delta_rows_supports(q, k, v, a, b, A_log, dt_bias, state, lengths: Sequence[int],
                              capture: bool = False) -> Optional[str]:
    """None when the chunked passes take these rows (each row alone would
    take them too), else why not."""
    if len(lengths) != q.shape[0]:
        return f"{len(lengths)} lengths for {q.shape[0]} rows"
    if not lengths or min(lengths) < CHUNKED_FROM:
        return f"a row of {min(lengths, default=0)} tokens (alone it takes the sequential scan below {CHUNKED_FROM})"
    if max(lengths) > q.shape[1]:
        return f"a row of {max(lengths)} tokens in a call of {q.shape[1]}"
    if state is not None and (state.dtype != mx.float32 or tuple(state.shape) != (q.shape[0], v.shape[2], v.shape[3],
                                                                                     q.shape[3])):
        return f"state {tuple(state.shape)} {state.dtype} (the rows' fp32 states)"
    return uses_chunked(q, k, v, a, b, A_log, dt_bias, state)


def run_gated_delta_rows(backend: str, q, k, v, a, b, A_log, dt_bias, state, lengths: Sequence[int],
                         capture: bool = False):
    y, state, *piece = gated_delta_chunked_run(backend, q, k, v, a, b, A_log, dt_bias, state, capture=capture,
                                               lengths=mx.array(list(lengths), dtype=mx.int32))
    y = _zero_padding(y, padding_mask(lengths, q.shape[1]))
    if not capture:
        return y, state
    # A row of whole chunks keeps its end state, as gated_delta's capture does.
    whole = mx.array([n % CHUNK == 0 for n in lengths])[:, None, None, None]
    return y, state, mx.where(whole, state, piece[0])


def _fuzz(rng):
    """Random rows the op takes: 2 or 3 rows of CHUNKED_FROM to 3 chunks of
    tokens, GQA, the head sizes the chunked passes take, a state or none."""
    B = int(rng.integers(2, 4))
    lengths = tuple(int(n) for n in rng.integers(CHUNKED_FROM, 3 * CHUNKED_FROM + 1, B))
    Hk = int(rng.integers(1, 3))
    args, _ = _sample_recurrence(B=B, T=max(lengths), Hk=Hk, Hv=Hk * int(rng.integers(1, 3)),
                                 Dk=int(rng.choice([64, 128])), Dv=int(rng.choice([32, 64, 128])),
                                 seed=int(rng.integers(1 << 30)))
    if rng.integers(2):
        args = args[:7] + (None,)
    return (*args, lengths), {}


def sample_gated_delta_rows():
    """Three rows: two chunks with the second partial, exactly one chunk,
    and three chunks (the longest, unpadded); GQA and incoming states, in
    bf16 as the model runs."""
    args, _ = _sample_recurrence(B=3, T=3 * 64, Hk=1, Hv=2, Dk=64, Dv=32, seed=8)
    return (*args, (64 + 9, 64, 3 * 64)), {}


def _agree(got, want, q, k, v, a, b, A_log, dt_bias, state, lengths, capture: bool = False):
    """The op's contract, with the reference: each row's y up to its
    length (zero past it), its state and, with ``capture``, its state after
    its whole chunks."""
    want = gated_delta_rows_reference(q, k, v, a, b, A_log, dt_bias, state, lengths, capture)
    mask = padding_mask(lengths, q.shape[1])
    why = gated_delta_agree(got[:2], want[:2], q, k, v, a, b, A_log, dt_bias, state, mask)
    if why is None and capture:
        why = gated_delta_agree((got[0], got[2]), (want[0], want[2]), q, k, v, a, b, A_log, dt_bias, state, mask)
        why = None if why is None else f"captured state: {why}"
    return why


def takes_rows(*args, **kwargs) -> bool:
    """Whether these rows, run together, get each row's bits alone: where
    the op runs its kernels (each row alone takes the chunked passes), or
    where no op runs a kernel (the references agree too). Not where kernels
    run but these rows' do not (then each row alone takes its own kernel)."""
    if kernel_backend()[0] is None:
        return True
    # Shapes first: a model the op never takes never builds its kernels.
    return (gated_delta_rows_supports(*args, **kwargs) is None
            and gated_delta_rows.choose(*args, **kwargs)[1] == "kernel")


gated_delta_rows_kernel = SampleCheckedKernels(
    "gated_delta_rows", CHUNKED_KERNELS, "chunked passes, a length per row",
    sample=sample_gated_delta_rows, run=run_gated_delta_rows, agree=_agree)

gated_delta_rows = register(
    LilyOp(
        "gated_delta_rows",
        gated_delta_rows_reference,
        kernel=gated_delta_rows_kernel,
        supports=gated_delta_rows_supports,
        description="gated delta rule over right-padded prompt rows, each as alone",
        sample=sample_gated_delta_rows,
        compare=gated_delta_compare,
        fuzz=_fuzz,
        # Called only for prompts packed together under the server's batch
        # generator, not by a model call of its own.
        in_model=False,
    )
)
