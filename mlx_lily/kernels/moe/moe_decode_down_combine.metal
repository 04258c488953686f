// MoE decode, launches 3 and 4 as one, row by row (for a call of a few rows:
// COMBINED_DOWN_MAX_ROWS in decode.py): each SIMD group takes ROWS output
// elements d of one row b and makes that row's terms at them slot by slot
// (its K picks in slot order, then the shared expert), each term exactly as
// down makes it (moe_decode_down.metal: the same unit steps from
// moe_decode_down.metal.h, the same SIMD sum, the same roundings), and sums
// them as the combine does (moe_decode_combine.metal):
//
//   out[b, d] = bf16(h[b, d] + bf16(bf16(sum_j terms[b, j, d]) + terms[b, K, d]))
//
// So out is the same bits as down then combine give, and the terms never go
// to memory. Why: one launch fewer per layer, on a GPU whose host launches
// kernels slower than they run (the H200 through MLX). Down reads each
// selected expert's weights once for all rows; this reads them once per row
// that picked them, which is the same for one row (one stream's step).
//
// RESIDUAL false (a tensor-parallel rank's partial sum): out[b, d] is the
// rounded MoE output, as the combine's, and h is not read.
//
// "bf16" here stands for T, the activations' dtype (bfloat16 or float16).
//
// Launcher: mlx_lily/kernels/moe/decode.py.
// Template: T, E (experts), K (top k), D (hidden size), I (experts' hidden
//           size), IS (shared expert's), IMAX (= max(I, IS)); I and IS
//           multiples of 64; NSG (SIMD groups per threadgroup), ROWS (output
//           elements per SIMD group), RESIDUAL (bool).
// Inputs:   h [B, 1, D] bf16; act [B, K + 1, IMAX] bf16 (launch 2); inds [B,
//           K] uint32; scores [B, K] bf16; gate_logit [B, 1, 1] bf16; down_w
//           [E, D, I / 8] uint32, down_s, down_b [E, D, I / 64] bf16; sdown_w
//           [D, IS / 8] uint32, sdown_s, sdown_b [D, IS / 64] bf16.
// Output:   out [B, 1, D] bf16.
// Grid:     (ceil(D / ROWS_PER_TG) * THREADS, B, 1), threadgroup (THREADS, 1, 1).

constexpr uint SIMD_WIDTH = 32;
constexpr uint SIMD_GROUPS = NSG;
constexpr uint ROWS_PER_SG = ROWS;
constexpr uint ROWS_PER_TG = SIMD_GROUPS * ROWS_PER_SG;
constexpr uint UNIT = 16;  // 4-bit weights per lane and load (uint2)
constexpr uint UNITS_PER_LANE = (uint(IMAX) / UNIT + SIMD_WIDTH - 1) / SIMD_WIDTH;

const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint d0 = threadgroup_position_in_grid.x * ROWS_PER_TG + sg * ROWS_PER_SG;
const uint b = threadgroup_position_in_grid.y;

constexpr uint SLOTS = uint(K) + 1u;  // the row's picks in slot order, then the shared expert

// Every slot's weights for this SIMD group's elements, read first, so that all
// of them are in flight at once (zeros past D, as down holds them: that
// element is not written).
uint2 q[SLOTS][ROWS_PER_SG][UNITS_PER_LANE];
float scale[SLOTS][ROWS_PER_SG][UNITS_PER_LANE];
float offset[SLOTS][ROWS_PER_SG][UNITS_PER_LANE];
for (uint j = 0; j < SLOTS; ++j) {
  const bool is_shared = j == uint(K);
  const uint hidden = is_shared ? uint(IS) : uint(I);
  const uint units = hidden / UNIT;
  const uint row_words = hidden / 8;
  const uint row_groups = hidden / 64;
  const uint row_base = is_shared ? 0u : min(inds[b * uint(K) + j], uint(E - 1)) * uint(D);
  const device uint32_t* w = is_shared ? sdown_w : down_w;
  const device T* s = is_shared ? sdown_s : down_s;
  const device T* bias = is_shared ? sdown_b : down_b;
  for (uint rr = 0; rr < ROWS_PER_SG; ++rr) {
    for (uint m = 0; m < UNITS_PER_LANE; ++m) {
      const uint u = lane + m * SIMD_WIDTH;
      q[j][rr][m] = uint2{0u, 0u};
      scale[j][rr][m] = 0.0f;
      offset[j][rr][m] = 0.0f;
      if (d0 + rr < uint(D) && u < units) {
        const uint row = row_base + d0 + rr;
        q[j][rr][m] = *reinterpret_cast<const device uint2*>(w + row * row_words + u * 2);
        const uint at = row * row_groups + u / 4;
        scale[j][rr][m] = static_cast<float>(s[at]);
        offset[j][rr][m] = static_cast<float>(bias[at]);
      }
    }
  }
}

// The routed slots' sum (fp32, in slot order) and the shared term, per element.
float routed[ROWS_PER_SG];
float shared_term[ROWS_PER_SG];
for (uint rr = 0; rr < ROWS_PER_SG; ++rr) {
  routed[rr] = 0.0f;
  shared_term[rr] = 0.0f;
}
for (uint j = 0; j < SLOTS; ++j) {  // uniform: every lane takes every slot
  const bool is_shared = j == uint(K);
  const uint units = (is_shared ? uint(IS) : uint(I)) / UNIT;
  const uint a_row = (b * SLOTS + j) * uint(IMAX);
  float acc[ROWS_PER_SG];
  for (uint rr = 0; rr < ROWS_PER_SG; ++rr) {
    acc[rr] = 0.0f;
  }
  for (uint m = 0; m < UNITS_PER_LANE; ++m) {
    const uint u = lane + m * SIMD_WIDTH;
    if (u < units) {
      float a[UNIT];
      float a_sum;
      LILY_DOWN_UNIT_ACTIVATIONS(a, a_sum, act + a_row + u * UNIT);
      for (uint rr = 0; rr < ROWS_PER_SG; ++rr) {
        LILY_DOWN_UNIT_ACC(acc[rr], a, a_sum, q[j][rr][m], scale[j][rr][m], offset[j][rr][m]);
      }
    }
  }
  // The weight: the routing weight of the slot, or the shared gate.
  const float weight = is_shared
      ? static_cast<float>(static_cast<T>(1.0f / (1.0f + metal::exp(-static_cast<float>(gate_logit[b])))))
      : static_cast<float>(scores[b * uint(K) + j]);
  for (uint rr = 0; rr < ROWS_PER_SG; ++rr) {
    const float y = static_cast<float>(static_cast<T>(simd_sum(acc[rr])));
    const float term = static_cast<float>(static_cast<T>(is_shared ? weight * y : y * weight));
    if (is_shared) {
      shared_term[rr] = term;
    } else {
      routed[rr] += term;
    }
  }
}

if (lane == 0) {
  for (uint rr = 0; rr < ROWS_PER_SG; ++rr) {
    const uint d = d0 + rr;
    if (d < uint(D)) {
      const float moe = static_cast<float>(static_cast<T>(static_cast<float>(static_cast<T>(routed[rr])) + shared_term[rr]));
      if (RESIDUAL) {
        out[b * uint(D) + d] = static_cast<T>(static_cast<float>(h[b * uint(D) + d]) + moe);
      } else {
        out[b * uint(D) + d] = static_cast<T>(moe);
      }
    }
  }
}
