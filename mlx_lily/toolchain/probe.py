"""The subset probe: every feature of the portable subset, checked against numpy.

``subset_probe.metal`` uses each feature once and stores a column per feature.
Running it on a backend and comparing with numpy checks that backend's meaning
of the subset: on CUDA, that the prelude is right.
"""

from __future__ import annotations

import math

import mlx.core as mx

from .kernel import SIMD_WIDTH, Kernel, Launch
from .sources import TOOLCHAIN_DIR


PROBE_THREADGROUP = 64  # two SIMD groups, as TG in the body
# Not a whole number of threadgroups: the last one has a tail that stores nothing.
PROBE_THREADS = 2 * PROBE_THREADGROUP + SIMD_WIDTH
PROBE_COLUMNS = (
    "simd_sum simd_max simd_min simd_product simd_shuffle simd_shuffle_xor "
    "simd_shuffle_down simd_shuffle_up simd_shuffle_rotate_down simd_shuffle_rotate_up "
    "simd_broadcast simd_broadcast_first simd_prefix_inclusive_sum simd_prefix_exclusive_sum "
    "simd_sum_uint simd_min_int simd_and simd_or simd_xor simd_all simd_any simd_ballot "
    "simd_is_first simd_sum_half bfloat16_round_trip threadgroup_neighbour "
    "threadgroup_atomic_add threadgroup_atomic_max uint3_times_2 "
    "thread_position_in_threadgroup threadgroup_position_in_grid threads_per_threadgroup "
    "threadgroups_per_grid threads_per_grid simdgroup_index_in_threadgroup "
    "simdgroups_per_threadgroup threads_per_simdgroup exp fast_exp precise_log "
    "sqrt_rsqrt clamp_select max_min fma_tanh_floor_ceil vectors"
).split()
# Columns whose values come from transcendental functions: (rtol, atol).
_PROBE_TOLERANCE = {
    "exp": (1e-5, 1e-6),
    "fast_exp": (1e-3, 1e-5),
    "precise_log": (1e-5, 1e-6),
    "sqrt_rsqrt": (1e-5, 1e-6),
    "fma_tanh_floor_ceil": (1e-5, 1e-6),
}


def _launch_subset_probe(x: mx.array) -> Launch:
    return Launch(
        inputs=[x],
        grid=(x.size, 1, 1),
        threadgroup=(PROBE_THREADGROUP, 1, 1),
        output_shapes=[(x.size, len(PROBE_COLUMNS))],
        output_dtypes=[mx.float32],
        template=[("COLS", len(PROBE_COLUMNS))],
        finish=lambda outputs: outputs[0],
    )


subset_probe_kernel = Kernel(
    name="lily_subset_probe",
    input_names=("x",),
    output_names=("out",),
    body=str(TOOLCHAIN_DIR / "subset_probe.metal"),
    launch=_launch_subset_probe,
)


def subset_probe_input() -> mx.array:
    """Quarter-integers: every sum and scan of them is exact in fp32, in any order."""
    i = mx.arange(PROBE_THREADS)
    return ((i * 7) % 17 - 8).astype(mx.float32) * 0.25


def subset_probe_expected(x: mx.array):
    """What subset_probe.metal must store, from numpy: [n, len(PROBE_COLUMNS)]."""
    import numpy as np

    n, tg, w = x.size, PROBE_THREADGROUP, SIMD_WIDTH
    padded = math.ceil(n / tg) * tg
    v = np.zeros(padded, np.float32)
    v[:n] = np.array(x)
    i = np.arange(padded)
    lane, t = i % w, i % tg
    simd = v.reshape(-1, w)
    rows = simd[i // w]  # each thread's SIMD group's values, [padded, 32]
    take = lambda src: rows[np.arange(padded), src]  # noqa: E731
    inclusive = np.cumsum(rows, axis=1)[np.arange(padded), lane]
    xor3 = np.bitwise_xor.reduce(np.arange(w) * 3)
    bf16 = np.array(mx.array(v).astype(mx.bfloat16).astype(mx.float32))
    groups = padded // tg
    col = {
        "simd_sum": rows.sum(1),
        "simd_max": rows.max(1),
        "simd_min": rows.min(1),
        "simd_product": np.full(padded, 2.0),
        "simd_shuffle": take((lane + 3) % w),
        "simd_shuffle_xor": take(lane ^ 5),
        "simd_shuffle_down": take(np.where(lane + 2 < w, lane + 2, lane)),
        "simd_shuffle_up": take(np.where(lane >= 2, lane - 2, lane)),
        "simd_shuffle_rotate_down": take((lane + 3) % w),
        "simd_shuffle_rotate_up": take((lane - 3) % w),
        "simd_broadcast": take(np.full(padded, 7)),
        "simd_broadcast_first": take(np.zeros(padded, int)),
        "simd_prefix_inclusive_sum": inclusive,
        "simd_prefix_exclusive_sum": inclusive - v,
        "simd_sum_uint": np.full(padded, w * (w - 1) / 2),
        "simd_min_int": np.full(padded, -5.0),
        "simd_and": np.full(padded, 64.0),
        "simd_or": np.full(padded, w - 1.0),
        "simd_xor": np.full(padded, float(xor3)),
        "simd_all": np.ones(padded),
        "simd_any": (rows[:, w - 1] > 0).astype(np.float64),
        "simd_ballot": ((lane ^ 1) % 3 == 0).astype(np.float64),
        "simd_is_first": (lane == 0).astype(np.float64),
        "simd_sum_half": np.full(padded, 0.5 * w),
        "bfloat16_round_trip": bf16,
        "threadgroup_neighbour": v[(i // tg) * tg + (t + 1) % tg],
        "threadgroup_atomic_add": np.full(padded, (tg // w) * w * (w + 1) / 2),
        "threadgroup_atomic_max": np.full(padded, tg - 1.0),
        "uint3_times_2": 2.0 * i,
        "thread_position_in_threadgroup": t.astype(np.float64),
        "threadgroup_position_in_grid": (i // tg).astype(np.float64),
        "threads_per_threadgroup": np.full(padded, float(tg)),
        "threadgroups_per_grid": np.full(padded, float(groups)),
        "threads_per_grid": np.full(padded, float(padded)),
        "simdgroup_index_in_threadgroup": (t // w).astype(np.float64),
        "simdgroups_per_threadgroup": np.full(padded, float(tg // w)),
        "threads_per_simdgroup": np.full(padded, float(w)),
        "exp": np.exp(0.1 * v),
        "fast_exp": np.exp(0.1 * v),
        "precise_log": np.log(1 + np.abs(v)),
        "sqrt_rsqrt": np.sqrt(np.abs(v)) + 1 / np.sqrt(1 + v * v),
        "clamp_select": np.clip(v, -1, 1) + (v > 0),
        "max_min": np.maximum(v, 0) + 2 * np.minimum(v, 0) + np.maximum(v, -0.5),
        "fma_tanh_floor_ceil": v * v + 1 + np.tanh(v) + np.floor(v) + np.ceil(v),
        "vectors": 3 * v + 9 + (v / 2 - v) + (2 - 4),
    }
    return np.stack([np.asarray(col[name], np.float64) for name in PROBE_COLUMNS], axis=1)[:n]


def run_subset_probe(backend: str) -> list[str]:
    """Run the subset probe on ``backend``; one line per column that is wrong."""
    import numpy as np

    x = subset_probe_input()
    got = np.array(subset_probe_kernel.run_on(backend, x)).astype(np.float64)
    want = subset_probe_expected(x)
    wrong = []
    for k, name in enumerate(PROBE_COLUMNS):
        rtol, atol = _PROBE_TOLERANCE.get(name, (0.0, 0.0))
        bad = ~np.isclose(got[:, k], want[:, k], rtol=rtol, atol=atol)
        if bad.any():
            row = int(np.argmax(bad))
            wrong.append(
                f"{name}: {int(bad.sum())} thread(s) differ, first thread {row}: "
                f"got {got[row, k]!r}, expected {want[row, k]!r}"
            )
    return wrong
