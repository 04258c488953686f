// MoE decode, launches 3 and 4 as one, row by row (for a call of a few rows:
// COMBINED_DOWN_MAX_ROWS in decode.py). Threadgroup (block, b) takes ROWS
// output elements d of row b; its SIMD group s makes row b's terms at them for
// slots s, s + NSG, ... (slot j < K: pick j; slot K: the shared expert), each
// term exactly as down makes it (moe_decode_down.metal: the same unit steps
// from moe_decode_down.metal.h, the same SIMD sum, the same roundings), and
// leaves it in threadgroup memory; then one thread per element sums them as
// the combine does (moe_decode_combine.metal):
//
//   out[b, d] = bf16(h[b, d] + bf16(bf16(sum_j terms[b, j, d]) + terms[b, K, d]))
//
// So out is the same bits as down then combine give, and the terms never go
// to device memory. Why: one launch fewer per layer, on a GPU whose host
// launches kernels slower than it runs them (the H200 through MLX). Each SIMD
// group works as down's does (a slot's ROWS weight rows read at once, its
// activations loaded once for them), and a threadgroup holds every slot of
// its elements, so the grid has down's parallelism (at the real shapes, 512
// threadgroups of 9 SIMD groups). Down reads each selected expert once for
// all rows; this reads it once per row that picked it, the same for one row
// (one stream's step).
//
// RESIDUAL false (a tensor-parallel rank's partial sum): out[b, d] is the
// rounded MoE output, as the combine's, and h is not read.
//
// "bf16" here stands for T, the activations' dtype (bfloat16 or float16).
//
// Launcher: mlx_lily/kernels/moe/decode.py.
// Template: T, E (experts), K (top k), D (hidden size), I (experts' hidden
//           size), IS (shared expert's), IMAX (= max(I, IS)); I and IS
//           multiples of 64; NSG (SIMD groups per threadgroup, at most K +
//           1), ROWS (output elements per threadgroup, at most 32), RESIDUAL
//           (bool).
// Inputs:   h [B, 1, D] bf16; act [B, K + 1, IMAX] bf16 (launch 2); inds [B,
//           K] uint32; scores [B, K] bf16; gate_logit [B, 1, 1] bf16; down_w
//           [E, D, I / 8] uint32, down_s, down_b [E, D, I / 64] bf16; sdown_w
//           [D, IS / 8] uint32, sdown_s, sdown_b [D, IS / 64] bf16.
// Output:   out [B, 1, D] bf16.
// Grid:     (ceil(D / ROWS) * NSG * 32, B, 1), threadgroup (NSG * 32, 1, 1).

constexpr uint SIMD_WIDTH = 32;
constexpr uint SLOTS = uint(K) + 1u;  // the row's picks in slot order, then the shared expert
constexpr uint UNIT = 16;             // 4-bit weights per lane and load (uint2)
constexpr uint UNITS_PER_LANE = (uint(IMAX) / UNIT + SIMD_WIDTH - 1) / SIMD_WIDTH;

// Each slot's terms at this threadgroup's elements, as down would write them.
threadgroup T slot_terms[SLOTS * ROWS];

const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint d0 = threadgroup_position_in_grid.x * uint(ROWS);
const uint b = threadgroup_position_in_grid.y;

for (uint j = sg; j < SLOTS; j += uint(NSG)) {  // uniform within the SIMD group
  const bool is_shared = j == uint(K);
  const uint hidden = is_shared ? uint(IS) : uint(I);
  const uint units = hidden / UNIT;
  const uint row_words = hidden / 8;
  const uint row_groups = hidden / 64;
  const uint row_base = is_shared ? 0u : min(inds[b * uint(K) + j], uint(E - 1)) * uint(D);
  const device uint32_t* w = is_shared ? sdown_w : down_w;
  const device T* s = is_shared ? sdown_s : down_s;
  const device T* bias = is_shared ? sdown_b : down_b;

  // The slot's weights for the threadgroup's elements, read at once (zeros
  // past D, as down holds them: that element is not written).
  uint2 q[ROWS][UNITS_PER_LANE];
  float scale[ROWS][UNITS_PER_LANE];
  float offset[ROWS][UNITS_PER_LANE];
  for (uint rr = 0; rr < uint(ROWS); ++rr) {
    for (uint m = 0; m < UNITS_PER_LANE; ++m) {
      const uint u = lane + m * SIMD_WIDTH;
      q[rr][m] = uint2{0u, 0u};
      scale[rr][m] = 0.0f;
      offset[rr][m] = 0.0f;
      if (d0 + rr < uint(D) && u < units) {
        const uint row = row_base + d0 + rr;
        q[rr][m] = *reinterpret_cast<const device uint2*>(w + row * row_words + u * 2);
        const uint at = row * row_groups + u / 4;
        scale[rr][m] = static_cast<float>(s[at]);
        offset[rr][m] = static_cast<float>(bias[at]);
      }
    }
  }

  float acc[ROWS];
  for (uint rr = 0; rr < uint(ROWS); ++rr) {
    acc[rr] = 0.0f;
  }
  const uint a_row = (b * SLOTS + j) * uint(IMAX);
  for (uint m = 0; m < UNITS_PER_LANE; ++m) {
    const uint u = lane + m * SIMD_WIDTH;
    if (u < units) {
      float a[UNIT];
      float a_sum;
      LILY_DOWN_UNIT_ACTIVATIONS(a, a_sum, act + a_row + u * UNIT);
      for (uint rr = 0; rr < uint(ROWS); ++rr) {
        LILY_DOWN_UNIT_ACC(acc[rr], a, a_sum, q[rr][m], scale[rr][m], offset[rr][m]);
      }
    }
  }
  // The weight: the routing weight of the slot, or the shared gate.
  const float weight = is_shared
      ? static_cast<float>(static_cast<T>(1.0f / (1.0f + metal::exp(-static_cast<float>(gate_logit[b])))))
      : static_cast<float>(scores[b * uint(K) + j]);
  for (uint rr = 0; rr < uint(ROWS); ++rr) {
    const float y = static_cast<float>(static_cast<T>(simd_sum(acc[rr])));
    if (lane == 0) {
      slot_terms[j * uint(ROWS) + rr] = static_cast<T>(is_shared ? weight * y : y * weight);
    }
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// One thread per element: the combine's sum, in slot order.
const uint rr = sg * SIMD_WIDTH + lane;
if (rr < uint(ROWS) && d0 + rr < uint(D)) {
  float routed = 0.0f;
  for (uint j = 0; j < uint(K); ++j) {
    routed += static_cast<float>(slot_terms[j * uint(ROWS) + rr]);
  }
  const float moe = static_cast<float>(static_cast<T>(
      static_cast<float>(static_cast<T>(routed)) + static_cast<float>(slot_terms[uint(K) * uint(ROWS) + rr])));
  const uint d = d0 + rr;
  if (RESIDUAL) {
    out[b * uint(D) + d] = static_cast<T>(static_cast<float>(h[b * uint(D) + d]) + moe);
  } else {
    out[b * uint(D) + d] = static_cast<T>(moe);
  }
}
