"""``gated_delta_rows`` on the GPU at the real Qwen3.6-35B-A3B head shapes:
prompt rows of different lengths as one batch, each row the bits of the row
alone (``gated_delta`` on it), as the server's packed prompts need."""

from __future__ import annotations

import mlx.core as mx
import pytest

from mlx_lily import kernels as K
from mlx_lily.kernels.gated_delta.recurrence import _sample_recurrence
from mlx_lily.kernels.gated_delta.rows import takes_rows

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("lengths", [(256, 255, 250, 129, 64, 200, 256, 100), (2047, 64, 1024)], ids=str)
def test_rows_at_the_real_shapes_are_each_row_alone(backend, lengths):
    args, _ = _sample_recurrence(B=len(lengths), T=max(lengths), Hk=16, Hv=32, Dk=128, Dv=128, seed=3)
    q, k, v, a, b, A_log, dt_bias, state = args
    assert takes_rows(*args, lengths)
    y, s = K.gated_delta_rows(*args, lengths)
    assert K.gated_delta_rows.last_path == "kernel", K.gated_delta_rows.last_reason
    for r, n in enumerate(lengths):
        row = [x[r : r + 1, :n] for x in (q, k, v, a, b)]
        y_alone, s_alone = K.gated_delta(*row, A_log, dt_bias, state[r : r + 1])
        assert K.gated_delta.last_path == "kernel"
        assert mx.array_equal(y[r : r + 1, :n], y_alone).item(), f"row {r} ({n} tokens): y"
        assert mx.array_equal(s[r : r + 1], s_alone).item(), f"row {r} ({n} tokens): state"
