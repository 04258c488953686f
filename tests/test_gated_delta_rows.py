"""``gated_delta_rows``: prompt rows of different lengths through the gated
delta rule as one right-padded batch. Each row's outputs up to its length,
and its state after them, must be the bits the row alone gets from
``gated_delta`` (the server's prompt rows rely on it: docs/serving.md), on the
emulated chunked passes and on the references."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_lily import kernels as K
from mlx_lily.kernels.gated_delta.recurrence import CHUNKED_FROM, _sample_recurrence
from mlx_lily.kernels.gated_delta.rows import gated_delta_rows_supports, takes_rows
from mlx_lily.toolchain.registry import BACKEND_ENV

LENGTHS = [
    (CHUNKED_FROM, CHUNKED_FROM),  # one whole chunk each, no padding
    (2 * CHUNKED_FROM + 3, CHUNKED_FROM, CHUNKED_FROM + 1),  # padded by more than a chunk
    (3 * CHUNKED_FROM - 1, 2 * CHUNKED_FROM, CHUNKED_FROM + 17, 3 * CHUNKED_FROM - 1),
]


def _rows(lengths, ratio=2, with_state=True, seed=0):
    B, T = len(lengths), max(lengths)
    args, _ = _sample_recurrence(B=B, T=T, Hk=2, Hv=2 * ratio, Dk=64, Dv=32, seed=seed + T)
    if not with_state:
        args = args[:7] + (None,)
    return args


def _assert_each_row_as_alone(args, lengths):
    q, k, v, a, b, A_log, dt_bias, state = args
    y, s = K.gated_delta_rows(*args, tuple(lengths))
    assert y.shape == v.shape and s.shape == (len(lengths), *v.shape[2:], q.shape[-1])
    for r, n in enumerate(lengths):
        row = [x[r : r + 1, :n] for x in (q, k, v, a, b)]
        y_alone, s_alone = K.gated_delta(*row, A_log, dt_bias, None if state is None else state[r : r + 1])
        assert mx.array_equal(y[r : r + 1, :n], y_alone).item(), f"row {r} ({n} tokens): y"
        assert mx.array_equal(s[r : r + 1], s_alone).item(), f"row {r} ({n} tokens): state"
    return K.gated_delta.last_path


@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
@pytest.mark.parametrize("with_state", [True, False])
def test_each_row_is_the_row_alone_on_the_emulated_passes(lengths, with_state, emulator_backend):
    args = _rows(lengths, with_state=with_state)
    assert takes_rows(*args, tuple(lengths))
    assert _assert_each_row_as_alone(args, lengths) == "kernel"
    assert K.gated_delta_rows.last_path == "kernel", K.gated_delta_rows.last_reason


@pytest.mark.parametrize("lengths", LENGTHS[1:], ids=str)
def test_each_row_is_the_row_alone_on_the_references(lengths, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "reference")
    args = _rows(lengths, ratio=1)
    assert takes_rows(*args, tuple(lengths))
    assert _assert_each_row_as_alone(args, lengths) == "reference"


def test_rows_the_passes_would_not_take_alone_are_refused():
    args = _rows((CHUNKED_FROM + 5, CHUNKED_FROM))
    assert gated_delta_rows_supports(*args, (CHUNKED_FROM + 5, CHUNKED_FROM)) is None
    # Alone, a row of fewer than CHUNKED_FROM tokens takes the sequential scan.
    assert "sequential scan" in gated_delta_rows_supports(*args, (CHUNKED_FROM + 5, CHUNKED_FROM - 1))
    assert "lengths for 2 rows" in gated_delta_rows_supports(*args, (CHUNKED_FROM,))
    assert "in a call of" in gated_delta_rows_supports(*args, (CHUNKED_FROM + 6, CHUNKED_FROM))
    half = tuple(x.astype(mx.float16) for x in args[:3]) + args[3:]
    assert "bfloat16" in gated_delta_rows_supports(*half, (CHUNKED_FROM + 5, CHUNKED_FROM))


def test_where_kernels_run_but_not_the_rows_each_row_runs_alone(emulator_backend):
    # fp16 rows: the rows' op would run its reference while each row alone
    # runs the sequential kernel, so the layer must not put them together.
    args = _rows((CHUNKED_FROM + 5, CHUNKED_FROM))
    half = tuple(x.astype(mx.float16) for x in args[:3]) + args[3:]
    assert not takes_rows(*half, (CHUNKED_FROM + 5, CHUNKED_FROM))


@pytest.mark.parametrize("backend_name", ["emulator", "reference"])
def test_each_row_keeps_the_checkpoint_it_keeps_alone(backend_name, monkeypatch):
    # Prefix reuse's checkpoints (capture): each row's state after its whole
    # chunks, at the start of its own last chunk (its end state when it is
    # whole chunks), the bits of the row alone.
    monkeypatch.setenv(BACKEND_ENV, backend_name)
    lengths = (2 * CHUNKED_FROM + 3, CHUNKED_FROM, 3 * CHUNKED_FROM - 1, CHUNKED_FROM + 17)
    q, k, v, a, b, A_log, dt_bias, state = _rows(lengths)
    y, s, piece = K.gated_delta_rows(q, k, v, a, b, A_log, dt_bias, state, lengths, capture=True)
    assert K.gated_delta_rows.last_path == ("kernel" if backend_name == "emulator" else "reference")
    for r, n in enumerate(lengths):
        row = [x[r : r + 1, :n] for x in (q, k, v, a, b)]
        y_alone, s_alone, piece_alone = K.gated_delta(*row, A_log, dt_bias, state[r : r + 1], capture=True)
        assert mx.array_equal(y[r : r + 1, :n], y_alone).item(), f"row {r}: y"
        assert mx.array_equal(s[r : r + 1], s_alone).item(), f"row {r}: state"
        assert mx.array_equal(piece[r : r + 1], piece_alone).item(), f"row {r}: checkpoint"
