"""Known-answer tests of the CPU Metal-kernel emulator (mlx_lily.emulator),
plus mlx-lm's own gated-delta Metal kernels run through it."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np
import pytest

from mlx_lily.emulator import (
    EmulatorError,
    KernelCompileError,
    KernelDeadlock,
    KernelOutOfBounds,
    metal_kernel,
)


def run(source, inputs, output_shapes, output_dtypes, grid, threadgroup, *,
        input_names=None, output_names=None, name="k", header="", **kw):
    input_names = input_names or [f"in{i}" for i in range(len(inputs))]
    output_names = output_names or ["out"]
    kernel_kw = {k: kw.pop(k) for k in ("ensure_row_contiguous", "atomic_outputs") if k in kw}
    kernel = metal_kernel(name, input_names, output_names, source, header=header, **kernel_kw)
    return kernel(inputs=inputs, output_shapes=output_shapes, output_dtypes=output_dtypes,
                  grid=grid, threadgroup=threadgroup, **kw)


def npa(x):
    return np.array(x)


# ---------------------------------------------------------------------------
# Elementwise, templates, dispatch geometry
# ---------------------------------------------------------------------------

EXP_SOURCE = """
    uint elem = thread_position_in_grid.x;
    T tmp = inp[elem];
    out[elem] = metal::exp(tmp);
"""


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_elementwise_with_template_dtype(dtype):
    a = mx.random.normal((4, 16), key=mx.random.key(1)).astype(dtype)
    kernel = metal_kernel("myexp", ["inp"], ["out"], EXP_SOURCE)
    (out,) = kernel(inputs=[a], template=[("T", dtype)], grid=(a.size, 1, 1),
                    threadgroup=(256, 1, 1), output_shapes=[a.shape], output_dtypes=[dtype])
    assert out.dtype == dtype and out.shape == a.shape
    # exp in float, rounded once to the storage type.
    expected = mx.exp(a.astype(mx.float32)).astype(dtype)
    np.testing.assert_allclose(npa(out.astype(mx.float32)), npa(expected.astype(mx.float32)),
                               rtol=1e-6, atol=0)


def test_int_and_bool_template_constants():
    src = """
        uint i = thread_position_in_grid.x;
        out[i] = inp[i] * Scale + (AddOne ? 1 : 0);
    """
    x = mx.arange(10, dtype=mx.int32)
    for add_one in (True, False):
        (out,) = run(src, [x], [(10,)], [mx.int32], (10, 1, 1), (4, 1, 1),
                     input_names=["inp"], template=[("Scale", 3), ("AddOne", add_one)])
        assert npa(out).tolist() == [3 * i + int(add_one) for i in range(10)]


def test_partial_edge_threadgroups_and_builtins():
    # grid 70x5 with 32x2 threadgroups: the last column of threadgroups is
    # 6 wide, the last row 1 high.
    src = """
        uint2 g = uint2(thread_position_in_grid.x, thread_position_in_grid.y);
        uint idx = (g.y * 70 + g.x) * 12;
        out[idx + 0] = thread_position_in_threadgroup.x;
        out[idx + 1] = thread_position_in_threadgroup.y;
        out[idx + 2] = threadgroup_position_in_grid.x;
        out[idx + 3] = threadgroup_position_in_grid.y;
        out[idx + 4] = threads_per_threadgroup.x;
        out[idx + 5] = threads_per_threadgroup.y;
        out[idx + 6] = thread_index_in_threadgroup;
        out[idx + 7] = simdgroup_index_in_threadgroup;
        out[idx + 8] = thread_index_in_simdgroup;
        out[idx + 9] = threadgroups_per_grid.x * 100 + threadgroups_per_grid.y;
        out[idx + 10] = dispatch_threads_per_threadgroup.x * 100 + threads_per_grid.x;
        out[idx + 11] = threads_per_simdgroup + simdgroups_per_threadgroup * 1000;
    """
    (out,) = run(src, [], [(5, 70, 12)], [mx.int32], (70, 5, 1), (32, 2, 1))
    out = npa(out)
    for y in range(5):
        for x in range(70):
            tgx, tgy = x // 32, y // 2
            w = min(32, 70 - tgx * 32)
            h = min(2, 5 - tgy * 2)
            lx, ly = x % 32, y % 2
            lid = ly * w + lx
            n = w * h
            assert out[y, x].tolist() == [
                lx, ly, tgx, tgy, w, h, lid, lid // 32, lid % 32, 3 * 100 + 3,
                32 * 100 + 70, 32 + ((n + 31) // 32) * 1000,
            ], (x, y)


def test_threadgroup_clamped_to_grid():
    src = """
        out[thread_position_in_grid.x] = threads_per_threadgroup.x * 10 + threads_per_threadgroup.y;
    """
    (out,) = run(src, [], [(5,)], [mx.int32], (5, 1, 1), (256, 4, 1))
    assert npa(out).tolist() == [51] * 5


# ---------------------------------------------------------------------------
# Threadgroup memory and barriers
# ---------------------------------------------------------------------------


def test_threadgroup_memory_tree_reduction():
    src = """
        uint lid = thread_position_in_threadgroup.x;
        threadgroup float partial[N];
        partial[lid] = x[thread_position_in_grid.x];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint s = N / 2; s > 0; s >>= 1) {
            if (lid < s) {
                partial[lid] += partial[lid + s];
            }
            threadgroup_barrier(mem_flags::mem_threadgroup);
        }
        if (lid == 0) {
            out[threadgroup_position_in_grid.x] = partial[0];
        }
    """
    x = mx.random.randint(-50, 50, (8 * 128,), key=mx.random.key(2)).astype(mx.float32)
    (out,) = run(src, [x], [(8,)], [mx.float32], (8 * 128, 1, 1), (128, 1, 1),
                 input_names=["x"], template=[("N", 128)])
    np.testing.assert_array_equal(npa(out), npa(x).reshape(8, 128).sum(1))


def test_two_dimensional_threadgroup_tile_transpose():
    # A 2-D threadgroup array, a scalar threadgroup variable, barriers.
    src = """
        threadgroup float tile[16][17];
        threadgroup int count;
        uint2 l = uint2(thread_position_in_threadgroup.x, thread_position_in_threadgroup.y);
        uint2 g = uint2(thread_position_in_grid.x, thread_position_in_grid.y);
        if (l.x == 0 && l.y == 0) count = 0;
        tile[l.y][l.x] = a[g.y * W + g.x];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        uint2 base = uint2(threadgroup_position_in_grid.x, threadgroup_position_in_grid.y) * 16;
        out[(base.x + l.y) * H + base.y + l.x] = tile[l.x][l.y];
    """
    a = mx.random.normal((32, 48), key=mx.random.key(3))
    (out,) = run(src, [a], [(48, 32)], [mx.float32], (48, 32, 1), (16, 16, 1),
                 input_names=["a"], template=[("W", 48), ("H", 32)])
    np.testing.assert_array_equal(npa(out), npa(a).T)


def test_threadgroup_memory_is_fresh_and_poisoned_per_threadgroup():
    src = """
        threadgroup float buf[4];
        uint l = thread_position_in_threadgroup.x;
        out[thread_position_in_grid.x] = buf[l];  // never written: poison
        threadgroup_barrier(mem_flags::mem_threadgroup);
        buf[l] = 1.0f;
    """
    (out,) = run(src, [], [(8,)], [mx.float32], (8, 1, 1), (4, 1, 1))
    assert np.isnan(npa(out)).all()


def test_threadgroup_memory_limit():
    src = """
        threadgroup float big[9000];
        big[thread_position_in_threadgroup.x] = 0;
        out[0] = 1;
    """
    with pytest.raises(EmulatorError, match="32768-byte threadgroup memory limit"):
        run(src, [], [(1,)], [mx.float32], (1, 1, 1), (1, 1, 1))


# ---------------------------------------------------------------------------
# SIMD-group functions
# ---------------------------------------------------------------------------

SIMD_SOURCE = """
    uint i = thread_position_in_grid.x;
    uint lane = thread_index_in_simdgroup;
    float v = x[i];
    float p = pm[i];
    int b = bits[i];
    device float* f = outf + i * 20;
    device int* n = outi + i * 8;
    f[0] = simd_sum(v);
    f[1] = simd_max(v);
    f[2] = simd_min(v);
    f[3] = simd_product(p);
    f[4] = simd_prefix_inclusive_sum(v);
    f[5] = simd_prefix_exclusive_sum(v);
    f[6] = simd_prefix_inclusive_product(p);
    f[7] = simd_prefix_exclusive_product(p);
    f[8] = simd_shuffle(v, (lane * 7) % 32);
    f[9] = simd_shuffle_xor(v, 5);
    f[10] = simd_shuffle_up(v, 3);
    f[11] = simd_shuffle_down(v, 3);
    f[12] = simd_broadcast(v, 5);
    f[13] = simd_broadcast_first(v);
    f[14] = simd_shuffle_rotate_down(v, 2);
    f[15] = simd_shuffle_and_fill_up(v, p, 2, 8);
    f[16] = simd_shuffle_and_fill_down(v, p, 3);
    f[17] = quad_sum(v);
    f[18] = quad_shuffle_xor(v, 1);
    f[19] = quad_broadcast(v, 2);
    n[0] = simd_all(v > -7.5f);
    n[1] = simd_any(v > 7.5f);
    n[2] = int(uint(uint64_t(simd_ballot(v > 0.0f))));
    n[3] = simd_and(b);
    n[4] = simd_or(b);
    n[5] = simd_xor(b);
    n[6] = simd_is_first();
    n[7] = simd_sum(b);
"""


def simd_reference(x, p, b):
    """Expected outputs for one full SIMD-group of 32 lanes."""
    lane = np.arange(32)
    f = np.zeros((32, 20), np.float32)
    n = np.zeros((32, 8), np.int64)
    f[:, 0] = x.sum()
    f[:, 1] = x.max()
    f[:, 2] = x.min()
    f[:, 3] = np.prod(p)
    f[:, 4] = np.cumsum(x)
    f[:, 5] = np.cumsum(x) - x
    f[:, 6] = np.cumprod(p)
    f[:, 7] = np.concatenate([[1], np.cumprod(p)[:-1]])
    f[:, 8] = x[(lane * 7) % 32]
    f[:, 9] = x[lane ^ 5]
    f[:, 10] = np.where(lane >= 3, x[np.maximum(lane - 3, 0)], x)
    f[:, 11] = np.where(lane + 3 < 32, x[np.minimum(lane + 3, 31)], x)
    f[:, 12] = x[5]
    f[:, 13] = x[0]
    f[:, 14] = x[(lane + 2) % 32]
    seg, i = lane - lane % 8, lane % 8
    f[:, 15] = np.where(i >= 2, x[seg + i - 2], p[(seg + i - 2 + 8) % 32])
    f[:, 16] = np.where(lane + 3 < 32, x[np.minimum(lane + 3, 31)], p[(lane + 3) % 32])
    f[:, 17] = x.reshape(8, 4).sum(1).repeat(4)
    f[:, 18] = x[lane ^ 1]
    f[:, 19] = x[(lane & ~3) + 2]
    n[:, 0] = (x > -7.5).all()
    n[:, 1] = (x > 7.5).any()
    n[:, 2] = np.int32(np.uint32(sum(1 << int(l) for l in lane[x > 0])))
    n[:, 3] = np.bitwise_and.reduce(b)
    n[:, 4] = np.bitwise_or.reduce(b)
    n[:, 5] = np.bitwise_xor.reduce(b)
    n[:, 6] = lane == 0
    n[:, 7] = b.sum()
    return f, n


def test_simd_collectives_match_numpy():
    rng = np.random.default_rng(4)
    nthreads = 128  # two threadgroups of two SIMD-groups
    x = rng.integers(-8, 9, nthreads).astype(np.float32)
    p = rng.choice(np.array([1.0, -1.0, 2.0, 0.5], np.float32), nthreads)
    b = rng.integers(0, 1 << 12, nthreads).astype(np.int32)
    outf, outi = run(SIMD_SOURCE, [mx.array(x), mx.array(p), mx.array(b)],
                     [(nthreads, 20), (nthreads, 8)], [mx.float32, mx.int32],
                     (nthreads, 1, 1), (64, 1, 1), input_names=["x", "pm", "bits"],
                     output_names=["outf", "outi"])
    outf, outi = npa(outf), npa(outi)
    for g in range(nthreads // 32):
        s = slice(32 * g, 32 * g + 32)
        f, n = simd_reference(x[s], p[s], b[s])
        np.testing.assert_array_equal(outf[s], f, err_msg=f"simdgroup {g}")
        np.testing.assert_array_equal(outi[s], n, err_msg=f"simdgroup {g}")


def test_simd_sum_is_the_ascending_xor_butterfly():
    # Bitwise equal to an explicit shuffle_xor tree, the order Apple GPUs use.
    src = """
        float v = x[thread_position_in_grid.x];
        float t = v;
        t += simd_shuffle_xor(t, 1);
        t += simd_shuffle_xor(t, 2);
        t += simd_shuffle_xor(t, 4);
        t += simd_shuffle_xor(t, 8);
        t += simd_shuffle_xor(t, 16);
        out[thread_position_in_grid.x] = simd_sum(v) - t;
    """
    x = mx.random.normal((256,), key=mx.random.key(5)) * 1000
    (out,) = run(src, [x], [(256,)], [mx.float32], (256, 1, 1), (128, 1, 1), input_names=["x"])
    assert (npa(out) == 0).all()


def test_simd_collectives_with_exited_and_missing_lanes():
    # Lanes with lane % 3 == 2 return first; the second SIMD-group of the
    # 40-thread threadgroup has only 8 lanes.
    src = """
        uint i = thread_position_in_grid.x;
        uint lane = thread_index_in_simdgroup;
        device float* f = out + i * 6;
        if (lane % 3 == 2) { f[0] = -1; return; }
        float v = x[i];
        f[0] = simd_sum(v);
        f[1] = simd_broadcast_first(v);
        f[2] = simd_shuffle_xor(v, 1);
        f[3] = simd_prefix_exclusive_sum(v);
        f[4] = float(uint64_t(simd_ballot(true)));
        f[5] = simd_shuffle_down(v, 4);
    """
    x = np.arange(40, dtype=np.float32) + 1
    (out,) = run(src, [mx.array(x)], [(40, 6)], [mx.float32], (40, 1, 1), (40, 1, 1),
                 input_names=["x"])
    out = npa(out)
    for g, size in ((0, 32), (1, 8)):
        lanes = np.arange(size)
        active = lanes % 3 != 2
        xs = x[32 * g: 32 * g + size]
        for l in lanes:
            row = out[32 * g + l]
            if not active[l]:
                assert row[0] == -1
                continue
            assert row[0] == xs[active].sum()
            assert row[1] == xs[0]
            partner = l ^ 1
            if partner < size and active[partner]:
                assert row[2] == xs[partner]
            else:
                assert np.isnan(row[2])  # exited or missing lane: poison
            assert row[3] == xs[:l][active[:l]].sum()
            assert row[4] == sum(1 << int(a) for a in lanes[active])
            src_lane = l + 4
            if src_lane >= 32:
                assert row[5] == xs[l]
            elif src_lane < size and active[src_lane]:
                assert row[5] == xs[src_lane]
            else:
                assert np.isnan(row[5])


def test_simd_collectives_on_vectors_and_half():
    src = """
        uint i = thread_position_in_grid.x;
        float4 v = float4(x[i], 2 * x[i], -x[i], 1.0f);
        float4 s = simd_sum(v);
        half h = simd_max(half(x[i]));
        out[i] = s.x + s.y * 10 + s.z * 100 + s.w * 1000 + float(h);
    """
    x = np.arange(32, dtype=np.float32)
    (out,) = run(src, [mx.array(x)], [(32,)], [mx.float32], (32, 1, 1), (32, 1, 1),
                 input_names=["x"])
    s = x.sum()
    assert (npa(out) == s + 20 * s - 100 * s + 32000 + 31).all()


# ---------------------------------------------------------------------------
# Atomics
# ---------------------------------------------------------------------------


def test_histogram_with_atomic_outputs():
    src = """
        uint i = thread_position_in_grid.x;
        int bin = clamp(int(x[i]), 0, 15);
        atomic_fetch_add_explicit(&hist[bin], 1, memory_order_relaxed);
    """
    x = mx.random.randint(0, 16, (5000,), key=mx.random.key(6)).astype(mx.float32)
    (hist,) = run(src, [x], [(16,)], [mx.int32], (5000, 1, 1), (256, 1, 1),
                  input_names=["x"], output_names=["hist"], atomic_outputs=True, init_value=0)
    np.testing.assert_array_equal(npa(hist), np.bincount(npa(x).astype(int), minlength=16))


def test_atomic_operations():
    src = """
        uint i = thread_position_in_grid.x;
        int v = vals[i];
        device atomic_int* a = (device atomic_int*)out;
        atomic_fetch_max_explicit(&a[0], v, memory_order_relaxed);
        atomic_fetch_min_explicit(a + 1, v, memory_order_relaxed);
        atomic_fetch_add_explicit(&a[2], v, memory_order_relaxed);
        atomic_fetch_or_explicit(&a[3], 1 << (i % 31), memory_order_relaxed);
        // A compare-and-swap loop: count how many threads see an even total.
        int expected = atomic_load_explicit(&a[4], memory_order_relaxed);
        while (!atomic_compare_exchange_weak_explicit(&a[4], &expected, expected + 2,
                                                      memory_order_relaxed,
                                                      memory_order_relaxed)) {}
        if (i == 7) atomic_store_explicit(&a[5], 42, memory_order_relaxed);
        // Threadgroup atomics.
        threadgroup atomic_uint count;
        if (thread_index_in_threadgroup == 0) atomic_store_explicit(&count, 0u, memory_order_relaxed);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        atomic_fetch_add_explicit(&count, 1u, memory_order_relaxed);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (thread_index_in_threadgroup == 0) {
            atomic_fetch_add_explicit(&a[6], int(atomic_load_explicit(&count, memory_order_relaxed)),
                                      memory_order_relaxed);
        }
        int old = atomic_exchange_explicit(&a[7], int(i), memory_order_relaxed);
        (void)old;
    """
    vals = mx.random.randint(-1000, 1000, (100,), key=mx.random.key(7))
    kernel = metal_kernel("atomics", ["vals"], ["out"], src)
    (out,) = kernel(inputs=[vals], output_shapes=[(8,)], output_dtypes=[mx.int32],
                    grid=(100, 1, 1), threadgroup=(32, 1, 1), init_value=0)
    out, v = npa(out), npa(vals)
    assert out[0] == max(v.max(), 0)
    assert out[1] == min(v.min(), 0)
    assert out[2] == v.sum()
    assert out[3] == np.bitwise_or.reduce([1 << (i % 31) for i in range(100)])
    assert out[4] == 200
    assert out[5] == 42
    assert out[6] == 100
    assert out[7] == 99  # threads run in order


def test_atomic_float_accumulation_is_deterministic():
    src = """
        uint i = thread_position_in_grid.x;
        atomic_fetch_add_explicit(&acc[i % 3], x[i], memory_order_relaxed);
    """
    x = mx.random.normal((3000,), key=mx.random.key(8)) * 1e3
    args = dict(input_names=["x"], output_names=["acc"], atomic_outputs=True, init_value=0)
    a = run(src, [x], [(3,)], [mx.float32], (3000, 1, 1), (64, 1, 1), **args)[0]
    b = run(src, [x], [(3,)], [mx.float32], (3000, 1, 1), (64, 1, 1), **args)[0]
    assert npa(a).tobytes() == npa(b).tobytes()
    np.testing.assert_allclose(npa(a), npa(x).reshape(-1, 3).sum(0), rtol=1e-4)


# ---------------------------------------------------------------------------
# simdgroup_matrix
# ---------------------------------------------------------------------------

MATMUL_SOURCE = """
    // 16x16 = (16xK)(Kx16), one 8x8 output tile per SIMD-group (4 per
    // threadgroup), K in steps of 8 through threadgroup memory.
    threadgroup T As[16 * 8];
    threadgroup T Bs[8 * 16];
    uint sg = simdgroup_index_in_threadgroup;
    uint tm = sg / 2, tn = sg % 2;
    uint lid = thread_index_in_threadgroup;
    simdgroup_matrix<float, 8, 8> acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    simdgroup_load(acc, c + tm * 8 * 16 + tn * 8, 16);
    for (uint k0 = 0; k0 < K; k0 += 8) {
        As[lid] = a[(lid / 8) * K + k0 + lid % 8];
        Bs[lid] = b[(k0 + lid / 16) * 16 + lid % 16];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        simdgroup_matrix<T, 8, 8> am, bm;
        simdgroup_load(am, As + tm * 8 * 8, 8);
        simdgroup_load(bm, Bs, 16, ulong2(tn * 8, 0));
        simdgroup_multiply_accumulate(acc, am, bm, acc);
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    simdgroup_store(acc, d, 16, ulong2(tn * 8, tm * 8));
"""


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_simdgroup_matrix_matmul(dtype):
    K = 24
    a = mx.random.normal((16, K), key=mx.random.key(9)).astype(dtype)
    b = mx.random.normal((K, 16), key=mx.random.key(10)).astype(dtype)
    c = mx.random.normal((16, 16), key=mx.random.key(11))
    (d,) = run(MATMUL_SOURCE, [a, b, c], [(16, 16)], [mx.float32], (128, 1, 1), (128, 1, 1),
               input_names=["a", "b", "c"], output_names=["d"],
               template=[("T", dtype), ("K", K)])
    expected = npa(a.astype(mx.float32)) @ npa(b.astype(mx.float32)) + npa(c)
    np.testing.assert_allclose(npa(d), expected, rtol=1e-5, atol=1e-5)


def test_simdgroup_matrix_transpose_fill_and_layout():
    src = """
        uint lane = thread_index_in_simdgroup;
        simdgroup_float8x8 m;
        simdgroup_load(m, a, 8, ulong2(0, 0), true);        // m = a^T
        simdgroup_float8x8 two = make_filled_simdgroup_matrix<float, 8, 8>(2.0f);
        simdgroup_float8x8 eye = simdgroup_float8x8(1.0f);  // identity
        simdgroup_float8x8 r;
        simdgroup_multiply(r, m, two);                      // a^T * 2s
        simdgroup_multiply_accumulate(r, eye, m, r);        // + a^T
        simdgroup_store(r, out, 8);
        // Which elements each lane holds (thread_elements).
        float2 e = m.thread_elements();
        lanes[lane * 2] = e.x;
        lanes[lane * 2 + 1] = e.y;
    """
    a = mx.arange(64, dtype=mx.float32).reshape(8, 8)
    out, lanes = run(src, [a], [(8, 8), (64,)], [mx.float32, mx.float32], (32, 1, 1),
                     (32, 1, 1), input_names=["a"], output_names=["out", "lanes"])
    at = npa(a).T
    np.testing.assert_allclose(npa(out), at @ np.full((8, 8), 2.0) + at)
    # Every element appears exactly once across the lanes' fragments.
    assert sorted(npa(lanes).tolist()) == sorted(at.ravel().tolist())
    # Lane 0 holds row 0, columns 0-1 (Apple's layout).
    assert npa(lanes)[:2].tolist() == at[0, :2].tolist()


# ---------------------------------------------------------------------------
# Types: half/bfloat rounding and promotion, vectors, math
# ---------------------------------------------------------------------------


def test_half_and_bfloat_conversions_round_like_mlx():
    rng = np.random.default_rng(12)
    special = np.array([0.0, -0.0, 1.0, 65504.0, 65520.0, 65519.0, 1e-8, 6e-8, 3e-8,
                        2.98e-8, 1 + 2**-11, 1 + 3 * 2**-11, 1 + 2**-8, 1 + 3 * 2**-8,
                        np.inf, -np.inf, np.nan, 3.4e38, -1e-40, 6.1e-5, 6.09e-5],
                       np.float32)
    values = np.concatenate([special, rng.normal(size=2000).astype(np.float32) * 10,
                             (rng.normal(size=500) * 1e-5).astype(np.float32)])
    x = mx.array(values)
    src = """
        uint i = thread_position_in_grid.x;
        h[i] = static_cast<half>(x[i]);
        b[i] = bfloat16_t(x[i]);
    """
    h, b = run(src, [x], [x.shape, x.shape], [mx.float16, mx.bfloat16], (x.size, 1, 1),
               (256, 1, 1), input_names=["x"], output_names=["h", "b"])
    # Bit-exact except for NaN payloads, which Metal does not specify.
    finite = ~np.isnan(values)
    for ours, dtype in ((h, mx.float16), (b, mx.bfloat16)):
        theirs = npa(x.astype(dtype).view(mx.uint16))
        assert npa(ours.view(mx.uint16))[finite].tolist() == theirs[finite].tolist()
        assert np.isnan(npa(ours.astype(mx.float32))[~finite]).all()


def test_half_arithmetic_promotion():
    src = """
        uint i = thread_position_in_grid.x;
        half a = x[i];
        half b = y[i];
        prod_h[i] = a * b;          // half * half -> half, rounded once
        sum_h[i] = a + 2;           // half + int  -> half
        mixed[i] = a * f[i];        // half * float -> float
        bfloat c = bfloat(f[i]);
        bprod[i] = c * c;           // bfloat * bfloat -> bfloat
    """
    rng = np.random.default_rng(13)
    x = mx.array(rng.normal(size=300).astype(np.float16))
    y = mx.array(rng.normal(size=300).astype(np.float16))
    f = mx.array(rng.normal(size=300).astype(np.float32))
    prod_h, sum_h, mixed, bprod = run(
        src, [x, y, f], [(300,)] * 4, [mx.float16, mx.float16, mx.float32, mx.bfloat16],
        (300, 1, 1), (64, 1, 1), input_names=["x", "y", "f"],
        output_names=["prod_h", "sum_h", "mixed", "bprod"])
    xf, yf, ff = (npa(t.astype(mx.float32)) for t in (x, y, f))
    assert npa(prod_h).tolist() == (xf * yf).astype(np.float16).tolist()
    assert npa(sum_h).tolist() == (xf + 2).astype(np.float16).tolist()
    assert npa(mixed).tolist() == (xf * ff).tolist()
    cb = npa(f.astype(mx.bfloat16).astype(mx.float32))
    expected_b = mx.array(cb * cb).astype(mx.bfloat16)
    assert npa(bprod.view(mx.uint16)).tolist() == npa(expected_b.view(mx.uint16)).tolist()


def test_vectors_math_and_pointer_arithmetic():
    src = """
        uint i = thread_position_in_grid.x;
        const device float4* x4 = reinterpret_cast<const device float4*>(x);
        float4 v = x4[i];
        float4 w = v * 2.0f + float4(1.0f, 2.0f, 3.0f, 4.0f);
        w.x += 1;
        w[1] = w[1] - 1;
        half4 h = half4(v);
        uint3 u = uint3(1, 2, 3) * 2u;
        bool4 positive = v > 0.0f;
        device float* o = out + i * 10;
        o[0] = dot(v, w);
        o[1] = clamp(v.z, 0.0f, 1.0f);
        o[2] = select(1.0f, 2.0f, v.w > 0) + float(all(positive)) * 10 + float(any(positive)) * 100;
        o[3] = metal::fast::exp(v.x) + metal::precise::sqrt(abs(v.y));
        o[4] = as_type<float>(as_type<uint>(v.x) ^ 0x80000000u);
        o[5] = isnan((v.x - v.x) / 0.0f) && isinf(v.x / 0.0f) ? 1.0f : 0.0f;
        o[6] = metal::numeric_limits<float>::infinity() == INFINITY ? fma(v.x, v.y, v.z) : 0.0f;
        const device float* p = x + 4 * i;
        p += 1;
        float acc = *p;
        p++;
        acc += p[1];
        o[7] = acc + float(h.x) + max(min(v.x, v.y), -1.0f);
        o[8] = float(u.x + u.y + u.z) + tanh(v.x) + float(numeric_limits<half>::max());
        o[9] = float(half(1.5h) * half(2));
    """
    x = mx.random.normal((16, 4), key=mx.random.key(14))
    (out,) = run(src, [x], [(16, 10)], [mx.float32], (16, 1, 1), (16, 1, 1), input_names=["x"])
    o, xn = npa(out), npa(x)
    w = xn * 2 + np.array([1, 2, 3, 4.0], np.float32)
    w[:, 0] += 1
    w[:, 1] -= 1
    pos = xn > 0
    expected = np.stack([
        (xn * w).sum(1),
        np.clip(xn[:, 2], 0, 1),
        np.where(xn[:, 3] > 0, 2, 1) + pos.all(1) * 10 + pos.any(1) * 100,
        np.exp(xn[:, 0]) + np.sqrt(np.abs(xn[:, 1])),
        -xn[:, 0],
        np.ones(16),
        xn[:, 0] * xn[:, 1] + xn[:, 2],
        xn[:, 1] + xn[:, 3] + xn[:, 0].astype(np.float16) + np.maximum(np.minimum(xn[:, 0], xn[:, 1]), -1),
        12 + np.tanh(xn[:, 0]) + 65504,
        np.full(16, 3.0),
    ], 1)
    np.testing.assert_allclose(o, expected, rtol=2e-6, atol=2e-6)


POINTER_HEADER = """
constant float kTable[4] = {1.0f, 10.0f, 100.0f, 1000.0f};

template <typename T>
T block_sum(threadgroup T* buf, uint lid, uint n) {
    for (uint s = n / 2; s > 0; s /= 2) {
        if (lid < s) buf[lid] += buf[lid + s];
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    return buf[0];
}

inline float first_two(const device float* p) { return p[0] + p[1]; }
"""


def test_pointer_forms_and_header_helpers():
    src = """
        uint i = thread_position_in_grid.x;
        uint lid = thread_position_in_threadgroup.x;
        threadgroup float buf[8];
        buf[lid] = x[i];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        float total = block_sum(buf, lid, 8);
        auto* p = x + (i / 2) * 2;                    // auto*
        const device float2* v = (const device float2*)p;   // C-style cast
        device float* o = out;
        o += i;
        thread float local[2] = {x[i], 1.0f};
        thread float* lp = local;
        *o = total + first_two(p) * kTable[i % 4] + v->y + lp[1];
    """
    x = mx.arange(16, dtype=mx.float32)
    (out,) = run(src, [x], [(16,)], [mx.float32], (16, 1, 1), (8, 1, 1), input_names=["x"],
                 header=POINTER_HEADER)
    xn = npa(x)
    i = np.arange(16)
    pair = (i // 2) * 2
    expected = (xn.reshape(2, 8).sum(1).repeat(8) + (xn[pair] + xn[pair + 1])
                * np.array([1, 10, 100, 1000.0])[i % 4] + xn[pair + 1] + 1)
    np.testing.assert_array_equal(npa(out), expected)


def test_spin_waits_make_progress():
    # Thread 0 waits for a flag that thread 9 of the same threadgroup sets,
    # through an atomic and through plain (volatile) memory.
    src = """
        uint i = thread_position_in_grid.x;
        device atomic_int* flags = (device atomic_int*)out;
        if (i == 0) {
            while (atomic_load_explicit(&flags[1], memory_order_relaxed) == 0) {}
            while (((volatile device int*)out)[2] == 0) {}
            atomic_store_explicit(&flags[0], 5, memory_order_relaxed);
        } else if (i == 9) {
            atomic_store_explicit(&flags[1], 1, memory_order_relaxed);
            out[2] = 1;
        }
    """
    (out,) = run(src, [], [(4,)], [mx.int32], (32, 1, 1), (32, 1, 1), init_value=0)
    assert npa(out).tolist() == [5, 1, 1, 0]


def test_endless_loops_time_out(monkeypatch):
    from mlx_lily.emulator import KernelTimeout

    monkeypatch.setenv("MLX_LILY_EMULATOR_TIMEOUT", "0.5")
    start = time.time()
    with pytest.raises(KernelTimeout, match="running the loop at source line 4"):
        run("""
            uint i = thread_position_in_grid.x;
            int k = 0;
            while (x[i] >= 0) { k++; }
            out[i] = k;
        """, [mx.zeros((8,))], [(8,)], [mx.int32], (8, 1, 1), (8, 1, 1), input_names=["x"],
            name="endless")
    # Waiting for a threadgroup that runs later (threadgroups run in order).
    with pytest.raises(KernelTimeout, match="kernel 'cross'"):
        run("""
            uint i = thread_position_in_grid.x;
            device atomic_int* flag = (device atomic_int*)out;
            if (i == 0) {
                while (atomic_load_explicit(&flag[0], memory_order_relaxed) == 0) {}
            } else if (i == 40) {
                atomic_store_explicit(&flag[0], 1, memory_order_relaxed);
            }
        """, [], [(1,)], [mx.int32], (64, 1, 1), (32, 1, 1), init_value=0, name="cross")
    assert time.time() - start < 5


# ---------------------------------------------------------------------------
# Inputs: shapes, strides, scalars, init_value, poison
# ---------------------------------------------------------------------------

COPY_STRIDED = """
    uint elem = thread_position_in_grid.x;
    int64_t loc = elem_to_loc(elem, inp_shape, inp_strides, inp_ndim);
    out[elem] = inp[loc];
"""


@pytest.mark.parametrize("contiguous", [True, False])
def test_shape_strides_ndim_parameters(contiguous):
    base = mx.arange(24, dtype=mx.float32).reshape(2, 3, 4)
    for a in (base.transpose(2, 0, 1), base[:, 1:, ::2], mx.broadcast_to(base[:, :1], (2, 5, 4))):
        (out,) = run(COPY_STRIDED, [a], [a.shape], [mx.float32], (a.size, 1, 1), (32, 1, 1),
                     input_names=["inp"], ensure_row_contiguous=contiguous)
        np.testing.assert_array_equal(npa(out), npa(a))


def test_strides_as_mlx_passes_them():
    src = """
        uint i = thread_position_in_grid.x;
        if (i < inp_ndim) {
            out[i] = inp_strides[i];
            out[4 + i] = inp_shape[i];
        }
    """
    a = mx.arange(12, dtype=mx.float32).reshape(3, 4).T
    for contiguous, strides in ((True, [3, 1]), (False, [1, 4])):
        (out,) = run(src, [a], [(8,)], [mx.int64], (2, 1, 1), (2, 1, 1), input_names=["inp"],
                     ensure_row_contiguous=contiguous, init_value=0)
        assert npa(out).tolist() == strides + [0, 0] + [4, 3] + [0, 0]


def test_scalar_inputs():
    src = """
        uint i = thread_position_in_grid.x;
        out[i] = flag ? x[i] * s + n : -1.0f;
    """
    x = mx.arange(4, dtype=mx.float32)
    for s, n, flag in ((2.5, 3, True), (mx.array(0.5), mx.array(-1), False)):
        (out,) = run(src, [x, s, n, flag], [(4,)], [mx.float32], (4, 1, 1), (4, 1, 1),
                     input_names=["x", "s", "n", "flag"])
        expected = npa(x) * float(s) + int(n) if flag else np.full(4, -1.0)
        np.testing.assert_array_equal(npa(out), expected)


def test_init_value_and_poisoned_outputs():
    src = """
        uint i = thread_position_in_grid.x;
        if (i % 2 == 0) out[i] = 1.0f;
    """
    (out,) = run(src, [], [(8,)], [mx.float32], (8, 1, 1), (8, 1, 1), init_value=2.5)
    assert npa(out).tolist() == [1.0, 2.5] * 4
    (out,) = run(src, [], [(8,)], [mx.float32], (8, 1, 1), (8, 1, 1))
    assert npa(out)[::2].tolist() == [1.0] * 4 and np.isnan(npa(out)[1::2]).all()


def test_determinism_bit_for_bit():
    src = """
        uint i = thread_position_in_grid.x;
        float v = exp(x[i]) * 1.37f;
        float s = simd_sum(v);
        threadgroup float buf[64];
        buf[thread_index_in_threadgroup] = s + v;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[i] = buf[(thread_index_in_threadgroup * 17) % 64] / 3.0f;
    """
    x = mx.random.normal((1024,), key=mx.random.key(15))
    a = run(src, [x], [(1024,)], [mx.float32], (1024, 1, 1), (64, 1, 1), input_names=["x"])[0]
    b = run(src, [x], [(1024,)], [mx.float32], (1024, 1, 1), (64, 1, 1), input_names=["x"])[0]
    assert npa(a).tobytes() == npa(b).tobytes()


# ---------------------------------------------------------------------------
# Errors: deadlocks, out-of-bounds, compile errors
# ---------------------------------------------------------------------------


def expect_error(cls, src, n=64, tg=32, name="faulty"):
    x = mx.arange(n, dtype=mx.float32)
    start = time.time()
    with pytest.raises(cls) as info:
        run(src, [x], [(n,)], [mx.float32], (n, 1, 1), (tg, 1, 1), input_names=["x"], name=name)
    assert time.time() - start < 10
    message = str(info.value)
    assert f"kernel '{name}'" in message
    return message


def test_deadlock_early_return_before_barrier():
    msg = expect_error(KernelDeadlock, """
        uint i = thread_position_in_grid.x;
        threadgroup float buf[32];
        if (i % 32 >= 16) return;
        buf[thread_position_in_threadgroup.x] = x[i];
        threadgroup_barrier(mem_flags::mem_threadgroup);
        out[i] = buf[0];
    """, name="early_return")
    assert "threadgroup_barrier at source line 6" in msg
    assert "16 thread(s) that already returned" in msg
    assert "threadgroup (0,0,0)" in msg
    assert "(0,0,0)" in msg and "(16,0,0)" in msg


def test_deadlock_divergent_barriers():
    msg = expect_error(KernelDeadlock, """
        uint i = thread_position_in_grid.x;
        if (i % 2) {
            threadgroup_barrier(mem_flags::mem_threadgroup);
        } else {
            threadgroup_barrier(mem_flags::mem_threadgroup);
        }
        out[i] = x[i];
    """, name="divergent")
    assert "divergent" in msg
    assert "source line 4" in msg and "source line 6" in msg
    assert "(1,0,0)" in msg and "(2,0,0)" in msg


def test_deadlock_divergent_simd_collectives():
    msg = expect_error(KernelDeadlock, """
        uint i = thread_position_in_grid.x;
        float s = i % 2 ? simd_sum(x[i]) : simd_max(x[i]);
        out[i] = s;
    """, name="simd_divergent")
    assert "simd_sum (source line 3)" in msg and "simd_max (source line 3)" in msg
    assert "lane 1" in msg


def test_deadlock_exited_lanes_at_simdgroup_barrier():
    msg = expect_error(KernelDeadlock, """
        uint i = thread_position_in_grid.x;
        if (thread_index_in_simdgroup == 3) return;
        simdgroup_barrier(mem_flags::mem_none);
        out[i] = x[i];
    """, name="simd_barrier")
    assert "simdgroup_barrier at source line 4" in msg


def test_out_of_bounds_read():
    msg = expect_error(KernelOutOfBounds, """
        uint i = thread_position_in_grid.x;
        out[i] = x[i + 1];
    """, name="oob_read")
    assert "buffer 'x'" in msg and "index 64" in msg
    assert "thread (31,0,0) of threadgroup (1,0,0)" in msg
    assert "source line 3" in msg


def test_out_of_bounds_write_through_pointer_arithmetic():
    msg = expect_error(KernelOutOfBounds, """
        uint i = thread_position_in_grid.x;
        device float* p = out + 10;
        p += 2;
        p[i] = x[i];
    """, name="oob_write")
    assert "buffer 'out'" in msg and "index 52" in msg and "element 64" in msg
    assert "thread (20,0,0) of threadgroup (1,0,0)" in msg
    assert "source line 5" in msg


def test_out_of_bounds_threadgroup_array():
    msg = expect_error(KernelOutOfBounds, """
        uint i = thread_position_in_grid.x;
        threadgroup float buf[16];
        buf[thread_position_in_threadgroup.x] = x[i];
        out[i] = 1;
    """, name="oob_tg")
    assert "threadgroup variable 'buf'" in msg and "index 16" in msg
    assert "source line 4" in msg


def test_crashes_become_errors():
    from mlx_lily.emulator import KernelRuntimeError

    src = """
        uint i = thread_position_in_grid.x;
        const device int* raw = &x[0];     // unchecked: a plain address
        out[i] = 100 / (x[i] - 5) + raw[i * Stride];
    """
    kernel = metal_kernel("crashy", ["x"], ["out"], src)
    call = dict(output_shapes=[(8,)], output_dtypes=[mx.int32], grid=(8, 1, 1),
                threadgroup=(8, 1, 1))
    x = mx.arange(8, dtype=mx.int32)
    with pytest.raises(KernelRuntimeError, match=r"thread \(5,0,0\).*division by zero"):
        kernel(inputs=[x], template=[("Stride", 1)], **call)
    with pytest.raises(KernelRuntimeError, match="invalid memory access"):
        kernel(inputs=[x + 10], template=[("Stride", 1 << 28)], **call)
    # The same kernel runs normally afterwards.
    (out,) = kernel(inputs=[x + 10], template=[("Stride", 1)], **call)
    assert npa(out).tolist() == [100 // (i + 5) + i + 10 for i in range(8)]


def test_compile_error_reports_body_lines():
    msg = expect_error(KernelCompileError, """
        uint i = thread_position_in_grid.x;
        out[i] = x[i] + undefined_thing;
    """, name="broken")
    assert "source:3:" in msg and "undefined_thing" in msg


def test_header_helpers_and_header_errors():
    header = """
    template <typename T>
    inline T twice(const device T* p, uint i) { return p[i] * 2; }
    """
    (out,) = run("out[thread_position_in_grid.x] = twice(x, thread_position_in_grid.x);",
                 [mx.arange(4, dtype=mx.float32)], [(4,)], [mx.float32], (4, 1, 1), (4, 1, 1),
                 input_names=["x"], header=header)
    assert npa(out).tolist() == [0, 2, 4, 6]
    with pytest.raises(KernelCompileError, match="header:3:"):
        run("out[0] = 1;", [], [(1,)], [mx.float32], (1, 1, 1), (1, 1, 1),
            header="\n\nint broken( {\n")


# ---------------------------------------------------------------------------
# API parity with mx.fast.metal_kernel, speed, cache
# ---------------------------------------------------------------------------


def test_verbose_prints_the_metal_source_mlx_generates(capsys):
    kernel = metal_kernel("myexp", ["inp", "s"], ["out"], EXP_SOURCE + "// inp_shape s")
    a = mx.ones((4,))
    kernel(inputs=[a, 2.0], template=[("T", mx.float32), ("B", True)], grid=(4, 1, 1),
           threadgroup=(4, 1, 1), output_shapes=[(4,)], output_dtypes=[mx.float32],
           verbose=True)
    text = capsys.readouterr().out
    assert "template <typename T, bool B>" in text
    assert "[[kernel]] void custom_kernel_myexp__float_1_floatc_floats_float(" in text
    assert "const constant float* inp [[buffer(0)]]" in text
    assert "const constant int* inp_shape [[buffer(1)]]" in text
    assert "const constant float& s [[buffer(2)]]" in text
    assert "device float* out [[buffer(3)]]" in text
    assert "uint3 thread_position_in_grid [[thread_position_in_grid]]" in text
    assert 'template [[host_name("custom_kernel_myexp__float_1_floatc_floats_float")]]' in text


def test_argument_validation_like_mlx():
    kernel = metal_kernel("v", ["x"], ["out"], "out[0] = x[0];")
    x = mx.ones((4,))
    with pytest.raises(ValueError, match="Expected `inputs` to have size 1"):
        kernel(inputs=[], output_shapes=[(1,)], output_dtypes=[mx.float32], grid=(1, 1, 1),
               threadgroup=(1, 1, 1))
    with pytest.raises(ValueError, match="greater than"):
        kernel(inputs=[x], output_shapes=[(1,)], output_dtypes=[mx.float32], grid=(1, 1, 1),
               threadgroup=(1024, 2, 1))
    with pytest.raises(ValueError, match="Invalid template argument"):
        kernel(inputs=[x], output_shapes=[(1,)], output_dtypes=[mx.float32], grid=(1, 1, 1),
               threadgroup=(1, 1, 1), template=[("T", 1.5)])
    with pytest.raises(ValueError, match="at least one output"):
        metal_kernel("v", ["x"], [], "")


def test_large_launch_is_fast():
    src = """
        uint i = thread_position_in_grid.x;
        out[i] = x[i] * 2.0f + 1.0f;
    """
    x = mx.random.normal((100_000,), key=mx.random.key(16))
    kernel = metal_kernel("fast", ["x"], ["out"], src)
    call = dict(inputs=[x], output_shapes=[x.shape], output_dtypes=[mx.float32],
                grid=(x.size, 1, 1), threadgroup=(256, 1, 1))
    kernel(**call)  # compile
    start = time.time()
    (out,) = kernel(**call)
    assert time.time() - start < 1.0
    np.testing.assert_allclose(npa(out), npa(x) * 2 + 1, rtol=1e-6)


def test_compiled_kernels_are_cached_on_disk():
    from mlx_lily.emulator import compiler

    src = "out[thread_position_in_grid.x] = 7;  // cache test"
    run(src, [], [(2,)], [mx.int32], (2, 1, 1), (2, 1, 1), name="cached")
    libs = list((compiler.toolchain_dir() / "kernels").glob("cached-*.so"))
    assert len(libs) == 1
    compiler._libraries.clear()  # as a fresh process would: loads, no compile
    start = time.time()
    (out,) = run(src, [], [(2,)], [mx.int32], (2, 1, 1), (2, 1, 1), name="cached")
    assert time.time() - start < 0.5
    assert npa(out).tolist() == [7, 7]


# ---------------------------------------------------------------------------
# mlx-lm's gated-delta Metal kernels, emulated, against its ops path
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gated_delta():
    """mlx_lm.models.gated_delta with its Metal kernels built by the emulator."""
    gd = pytest.importorskip("mlx_lm.models.gated_delta")
    saved = {n: getattr(gd, n) for n in (
        "_gated_delta_kernel", "_gated_delta_kernel_masked", "_gated_delta_kernel_vec",
        "_gated_delta_kernel_vec_masked", "_gated_delta_kernel_packed")}
    mp = pytest.MonkeyPatch()
    mp.setattr(mx.metal, "is_available", lambda: True)
    mp.setattr(mx.fast, "metal_kernel", metal_kernel)
    try:
        kernels = {
            "_gated_delta_kernel": gd._make_gated_delta_kernel(has_mask=False, vectorized=False),
            "_gated_delta_kernel_masked": gd._make_gated_delta_kernel(has_mask=True, vectorized=False),
            "_gated_delta_kernel_vec": gd._make_gated_delta_kernel(has_mask=False, vectorized=True),
            "_gated_delta_kernel_vec_masked": gd._make_gated_delta_kernel(has_mask=True, vectorized=True),
            "_gated_delta_kernel_packed": gd._make_gated_delta_packed_kernel(),
        }
    finally:
        mp.undo()
    for name, kernel in kernels.items():
        assert kernel is not None, name
        setattr(gd, name, kernel)
    yield gd
    for name, kernel in saved.items():
        setattr(gd, name, kernel)


@pytest.mark.parametrize(
    "B,T,Dk,Dv,vector_gate,masked,packed",
    [
        (1, 3, 32, 16, False, False, False),
        (2, 5, 64, 32, False, True, False),
        (2, 4, 32, 24, True, False, False),
        (1, 5, 64, 16, True, True, False),
        (1, 3, 128, 16, False, False, True),
        (2, 4, 128, 24, False, False, True),
    ],
)
def test_mlx_lm_gated_delta_kernels(gated_delta, B, T, Dk, Dv, vector_gate, masked, packed):
    gd = gated_delta
    Hk, Hv = 2, 4
    keys = mx.random.split(mx.random.key(100 + B * 10 + T + Dk + Dv), 7)
    q = mx.random.normal((B, T, Hk, Dk), key=keys[0]) * 0.3
    k = mx.random.normal((B, T, Hk, Dk), key=keys[1]) * 0.3
    v = mx.random.normal((B, T, Hv, Dv), key=keys[2])
    g_shape = (B, T, Hv, Dk) if vector_gate else (B, T, Hv)
    g = mx.random.uniform(0.5, 1.0, g_shape, key=keys[3])
    beta = mx.random.uniform(0.0, 1.0, (B, T, Hv), key=keys[4])
    state = mx.random.normal((B, Hv, Dv, Dk), key=keys[5]) * 0.1
    mask = mx.random.uniform(shape=(B, T), key=keys[6]) > 0.3 if masked else None

    y, s = gd._gated_delta_kernel_impl(q, k, v, g, beta, state, mask, allow_packed=packed)
    y_ref, s_ref = gd.gated_delta_ops(q, k, v, g, beta, state, mask)
    np.testing.assert_allclose(npa(s), npa(s_ref), rtol=1e-4, atol=1e-4)
    if mask is None:
        np.testing.assert_allclose(npa(y), npa(y_ref), rtol=1e-4, atol=1e-4)
    else:
        # The kernel writes 0 for masked steps; the ops path still computes y.
        m = npa(mask)[:, :, None, None]
        np.testing.assert_allclose(np.where(m, npa(y), 0), np.where(m, npa(y_ref), 0),
                                   rtol=1e-4, atol=1e-4)
        assert (npa(y)[~npa(mask)] == 0).all()


# ---------------------------------------------------------------------------
# More of mlx-lm's Metal kernels: its fused kernels and RWKV-7's recurrence
# ---------------------------------------------------------------------------


def load_with_emulator(module_name):
    """A fresh copy of an mlx-lm module whose Metal kernels are emulated
    (the imported module is left alone)."""
    import importlib.util

    spec = importlib.util.find_spec(module_name)
    if spec is None:
        pytest.skip(f"{module_name} not available")
    module = importlib.util.module_from_spec(spec)
    mp = pytest.MonkeyPatch()
    mp.setattr(mx.metal, "is_available", lambda: True)
    mp.setattr(mx.fast, "metal_kernel", metal_kernel)
    try:
        spec.loader.exec_module(module)
    finally:
        mp.undo()
    return module


def bf16_round(x):
    return x.astype(mx.bfloat16).astype(mx.float32)


def test_mlx_lm_qk_norm_rope_kernel():
    qk = load_with_emulator("mlx_lm.kernels.qk_norm")
    qkr = load_with_emulator("mlx_lm.kernels.qk_norm_rope")
    HQ, HK, D = 4, 2, 64
    qkvg = mx.random.normal((2, 3, 2 * (HQ + HK) * D), key=mx.random.key(20)).astype(mx.bfloat16)
    args = dict(n_heads=HQ, n_kv_heads=HK, head_dim=D, eps=1e-6, query_scale=0.125)
    q, k = qk.qk_norm(qkvg, **args)
    x = qkvg.reshape(2, 3, 2 * (HQ + HK), D)[:, :, : HQ + HK].astype(mx.float32)
    n = x * mx.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_array_equal(npa(q.astype(mx.float32)), npa(bf16_round(n[:, :, :HQ]) * 0.125))
    np.testing.assert_array_equal(npa(k.astype(mx.float32)), npa(bf16_round(n[:, :, HQ:])))
    q2, _ = qkr.qk_norm_rope(qkvg, rope_base=10000.0, offset=5, **args)
    q_ref = mx.fast.rope(q.transpose(0, 2, 1, 3), D, traditional=True, base=10000.0,
                         scale=1.0, offset=5).transpose(0, 2, 1, 3)
    np.testing.assert_allclose(npa(q2.astype(mx.float32)), npa(q_ref.astype(mx.float32)),
                               atol=4e-3)


def test_mlx_lm_expert_routing_kernel():
    er = load_with_emulator("mlx_lm.kernels.expert_routing")
    E, K = 64, 4
    logits = mx.random.normal((5, E), key=mx.random.key(21))
    bias = mx.random.normal((E,), key=mx.random.key(22)) * 0.1
    inds, w = er.expert_routing(logits, bias, top_k=K, multiplier=1.0, score_eps=1e-20,
                                route_scale=2.0)
    scores = mx.sigmoid(logits)
    top = mx.argsort(-(scores + bias), axis=-1)[:, :K]
    assert npa(inds).tolist() == npa(top).tolist()
    chosen = mx.take_along_axis(scores, inds.astype(mx.int32), -1)
    np.testing.assert_allclose(npa(w), npa(chosen / chosen.sum(-1, keepdims=True) * 2),
                               rtol=1e-5)


def test_mlx_lm_norm_add_norm_kernel():
    import mlx.nn as nn

    nan = load_with_emulator("mlx_lm.kernels.norm_add_norm")
    D = 512
    keys = mx.random.split(mx.random.key(23), 6)
    branch = mx.random.normal((3, D), key=keys[0]).astype(mx.bfloat16)
    stream = mx.random.normal((3, D), key=keys[1])
    alpha = mx.random.normal((D,), key=keys[2])
    beta = mx.random.normal((D,), key=keys[3])
    post_w = mx.random.normal((D,), key=keys[4]).astype(mx.bfloat16)
    norm = nn.RMSNorm(D, eps=1e-5)
    norm.weight = mx.random.normal((D,), key=keys[5]).astype(mx.bfloat16)
    new_stream, normed = nan.norm_add_norm(branch, stream, alpha=alpha, beta=beta,
                                           post_weight=post_w, post_eps=1e-5, next_norm=norm)
    b = bf16_round(post_w.astype(mx.float32) * branch.astype(mx.float32))
    b = bf16_round(b * mx.rsqrt((b * b).mean(-1, keepdims=True) + 1e-5))
    expected = alpha * stream + beta * b
    np.testing.assert_allclose(npa(new_stream), npa(expected), rtol=1e-5, atol=1e-5)
    expected_normed = norm(expected.astype(mx.float32)).astype(mx.float32)
    np.testing.assert_allclose(npa(normed.astype(mx.float32)), npa(expected_normed),
                               rtol=2e-2, atol=2e-2)


def test_mlx_lm_rwkv7_kernel():
    rw = load_with_emulator("mlx_lm.models.rwkv7")
    B, T, H, D = 1, 3, 2, 64
    keys = mx.random.split(mx.random.key(24), 7)
    r, k, v, a, b = (mx.random.normal((B, T, H, D), key=keys[i]) * 0.3 for i in range(5))
    w = mx.random.uniform(0.5, 1.0, (B, T, H, D), key=keys[5])
    state = mx.random.normal((B, H, D, D), key=keys[6]) * 0.1
    y, s = rw.wkv7_kernel(r, w, k, v, a, b, state)
    ys, st = [], state
    for t in range(T):
        yt, st = rw._wkv7_step_ops(r[:, t], w[:, t], k[:, t], v[:, t], a[:, t], b[:, t], st)
        ys.append(yt)
    np.testing.assert_allclose(npa(y), npa(mx.stack(ys, 1).squeeze(-1)), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(npa(s), npa(st), rtol=1e-4, atol=1e-4)


def test_a_large_launch_gives_its_fiber_stacks_back():
    # Each kernel library links its own runtime and stack pool, and each stack's
    # guard page is a mapping of its own: pools kept at 1024 stacks in hundreds
    # of loaded kernels exhausted vm.max_map_count ("failed to map segment").
    import sys
    from pathlib import Path

    if not Path("/proc/self/maps").exists():
        pytest.skip("needs /proc/self/maps")
    from mlx_lily.emulator import metal_kernel

    kernel = metal_kernel(
        name="stack_pool_probe", input_names=["x"], output_names=["y"],
        source="uint i = thread_position_in_grid.x; y[i] = x[i] + 1.0f;",
    )
    x = mx.zeros((4096,))

    def mappings() -> int:
        return len(Path("/proc/self/maps").read_text().splitlines())

    before = mappings()
    (y,) = kernel(inputs=[x], grid=(4096, 1, 1), threadgroup=(1024, 1, 1),
                  output_shapes=[(4096,)], output_dtypes=[mx.float32])
    assert mx.array_equal(y, x + 1).item()
    # The library's own segments, not 2 x 1024 stack mappings.
    assert mappings() - before < 200, sys.platform
