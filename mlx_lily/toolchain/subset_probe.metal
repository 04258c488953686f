// Subset probe: not an op. It uses each feature of lily's portable kernel
// subset once and stores one column per feature, so that a backend (and the
// CUDA prelude in particular) can be checked against numpy on a new machine:
// toolchain.run_subset_probe(). Column order: toolchain.PROBE_COLUMNS.
//
// Template: COLS. Inputs: x [n] float. Outputs: out [n, COLS] float.
// Launch: threadgroups of TG threads (two SIMD groups), n not a multiple of TG,
// so the last threadgroup has a tail of threads that take part in every
// barrier and SIMD-group function but store nothing.

constexpr uint TG = 64;
threadgroup float tile[TG];
threadgroup atomic_uint counters[2];

uint i = thread_position_in_grid.x;
uint t = thread_index_in_threadgroup;
uint l = thread_index_in_simdgroup;
uint n = x_shape[0];
bool live = i < n;
float v = live ? x[i] : 0.0f;

// Threadgroup memory, barriers and threadgroup atomics.
tile[t] = v;
if (t == 0) {
  atomic_store_explicit(&counters[0], 0u, memory_order_relaxed);
  atomic_store_explicit(&counters[1], 0u, memory_order_relaxed);
}
threadgroup_barrier(mem_flags::mem_threadgroup);
atomic_fetch_add_explicit(&counters[0], l + 1u, memory_order_relaxed);
atomic_fetch_max_explicit(&counters[1], t, memory_order_relaxed);
threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup);
float neighbour = tile[(t + 1) % TG];
uint added = atomic_load_explicit(&counters[0], memory_order_relaxed);
uint largest = atomic_load_explicit(&counters[1], memory_order_relaxed);
simdgroup_barrier(mem_flags::mem_none);

float c[COLS];
// SIMD-group reductions, shuffles and scans on float.
c[0] = simd_sum(v);
c[1] = simd_max(v);
c[2] = simd_min(v);
c[3] = simd_product(l == 0 ? 2.0f : 1.0f);
c[4] = simd_shuffle(v, (l + 3) % 32);
c[5] = simd_shuffle_xor(v, 5u);
c[6] = simd_shuffle_down(v, 2u);
c[7] = simd_shuffle_up(v, 2u);
c[8] = simd_shuffle_rotate_down(v, 3u);
c[9] = simd_shuffle_rotate_up(v, 3u);
c[10] = simd_broadcast(v, 7u);
c[11] = simd_broadcast_first(v);
c[12] = simd_prefix_inclusive_sum(v);
c[13] = simd_prefix_exclusive_sum(v);
// Integer reductions and votes.
c[14] = float(simd_sum(l));
c[15] = float(simd_min(int(l) - 5));
c[16] = float(simd_and(l | 64u));
c[17] = float(simd_or(l));
c[18] = float(simd_xor(l * 3u));
c[19] = simd_all(l < 32u) ? 1.0f : 0.0f;
c[20] = simd_any(l == 31u && v > 0.0f) ? 1.0f : 0.0f;
uint64_t ballot = static_cast<uint64_t>(simd_ballot(l % 3u == 0u));
c[21] = float(uint((ballot >> (l ^ 1u)) & uint64_t(1)));
c[22] = simd_is_first() ? 1.0f : 0.0f;
// 16-bit floats.
half h = static_cast<half>(0.5f);
c[23] = static_cast<float>(simd_sum(h));
bfloat16_t b = static_cast<bfloat16_t>(v);
c[24] = static_cast<float>(b);
// Threadgroup memory and atomics (from above).
c[25] = neighbour;
c[26] = float(added);
c[27] = float(largest);
// Builtins.
uint3 g = thread_position_in_grid;
uint3 doubled = g * 2u;
c[28] = float(doubled.x);
c[29] = float(thread_position_in_threadgroup.x);
c[30] = float(threadgroup_position_in_grid.x);
c[31] = float(threads_per_threadgroup.x);
c[32] = float(threadgroups_per_grid.x);
c[33] = float(threads_per_grid.x);
c[34] = float(simdgroup_index_in_threadgroup);
c[35] = float(simdgroups_per_threadgroup);
c[36] = float(threads_per_simdgroup);
// Math and vectors.
c[37] = metal::exp(0.1f * v);
c[38] = metal::fast::exp(0.1f * v);
c[39] = metal::precise::log(1.0f + abs(v));
c[40] = sqrt(abs(v)) + rsqrt(1.0f + v * v);
c[41] = clamp(v, -1.0f, 1.0f) + select(0.0f, 1.0f, v > 0.0f);
c[42] = max(v, 0.0f) + 2.0f * min(v, 0.0f) + metal::max(v, -0.5f);
c[43] = fma(v, v, 1.0f) + metal::tanh(v) + floor(v) + ceil(v);
float4 q = {v, 1.0f, 2.0f, 3.0f};
q = q * 2.0f + q;
float2 p = {v, 4.0f};
p = p / 2.0f - p;
c[44] = q.x + q.w + p.x + p.y;

if (live) {
  for (int k = 0; k < COLS; ++k) {
    out[i * COLS + k] = c[k];
  }
}
