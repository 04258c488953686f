// MoE decode, launch 3 of 4: the down projections of the selected experts and
// the shared expert, expert by expert, each term weighted by its routing
// weight (or the shared expert's gate) and left at its row's slot:
//
//   terms[b, j, d] = bf16(s_bj * y_bj[d]),  terms[b, K, d] = bf16(g_b * y_sb[d])
//   y_bj[d] = bf16(down_(e_bj)[d] . act_bj),  y_sb[d] = bf16(shared_down[d] . act_sb),
//   g_b = bf16(sigmoid(row b's shared gate logit))
//
// with stock mlx-lm's roundings: each quantized matmul's output, each weighted
// slot, sigmoid and the gated shared term are bf16. Launch 4
// (moe_decode_combine.metal) sums each row's slots in its own order and adds
// the shared term and the residual.
//
// Launcher: mlx_lily/kernels/moe/decode.py. Threadgroup (block, entry) takes
// ROWS_PER_TG output rows d of one entry: entry 0 the shared expert, for every
// row of the batch; entry 1 + f the expert of pick f = b0 * K + j0 (launch
// 1's inds) if f is its first occurrence, for every row that picked it (found
// from inds as launch 2 finds them: moe_decode_gate_up.metal); the entries of
// later occurrences do nothing. So each expert's down weights are read once
// for all rows, and the entries run side by side over the grid.
// Each SIMD group takes ROWS_PER_SG output rows and reads the entry's down
// weights for them into registers once (lane l: hidden units of 16 4-bit
// weights, one 8-byte load per row, u = l, l + 32, ...); then, for each row b
// that uses the entry, in order, lane l accumulates scale * sum(q * a) + bias
// * sum(a) per unit in fp32 over its units in order, a SIMD sum finishing each
// output row. Every step of a term is fixed by its row's inputs alone: the
// same bits whatever B is and whichever threadgroup holds the expert.
//
// "bf16" here stands for T, the activations' dtype (bfloat16 or float16).
//
// Template: T, E (experts), K (top k), D (hidden size), I (experts' hidden
//           size), IS (shared expert's), IMAX (= max(I, IS)), MAX_BATCH (rows
//           at most, <= 32: a lane per row); I and IS multiples of 64; NSG
//           (SIMD groups per threadgroup), ROWS (output rows per SIMD group).
// Inputs:   act [B, K + 1, IMAX] bf16 (launch 2); inds [B, K] uint32 (launch
//           1); scores [B, K] bf16; gate_logit [B, 1, 1] bf16; down_w [E, D, I
//           / 8] uint32, down_s, down_b [E, D, I / 64] bf16; sdown_w [D, IS /
//           8] uint32, sdown_s, sdown_b [D, IS / 64] bf16. B is act's first
//           dimension.
// Output:   terms [B, K + 1, D] bf16: every (b, j, d) written (a row's picks
//           are distinct, so each slot is one entry's).
// Grid:     (ceil(D / ROWS_PER_TG) * THREADS, 1 + B * K, 1), threadgroup
//           (THREADS, 1, 1).

constexpr uint SIMD_WIDTH = 32;
// NSG SIMD groups of ROWS output rows (the launcher's choice; by default 8 of
// 4: 32 rows a threadgroup, 64 blocks at D = 2048; at one row, 9 entries
// (576 threadgroups), at 16 rows 129, of which those of repeated picks do
// nothing).
constexpr uint SIMD_GROUPS = NSG;
constexpr uint ROWS_PER_SG = ROWS;
constexpr uint ROWS_PER_TG = SIMD_GROUPS * ROWS_PER_SG;
constexpr uint UNIT = 16;                 // 4-bit weights per lane and load (uint2)
constexpr uint UNITS_PER_LANE = (uint(IMAX) / UNIT + SIMD_WIDTH - 1) / SIMD_WIDTH;

const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint d0 = threadgroup_position_in_grid.x * ROWS_PER_TG + sg * ROWS_PER_SG;
const uint entry = threadgroup_position_in_grid.y;
const uint B = min(uint(act_shape[0]), uint(MAX_BATCH));
const bool is_shared = entry == 0;

// Entry 1 + f: pick f, row b0's slot j0. Lane l < B: the first and the last
// slot (1 + slot, 0 if none) at which row l picked that expert.
const uint f = is_shared ? 0u : entry - 1u;
const uint b0 = f / uint(K);
const uint j0 = f % uint(K);
const uint picked = (is_shared || b0 >= B) ? 0u : inds[f];
uint first_slot = 0u;
uint last_slot = 0u;
if (!is_shared && lane < B) {
  for (uint j = 0; j < uint(K); ++j) {
    const bool hit = inds[lane * uint(K) + j] == picked;
    first_slot = (first_slot == 0u && hit) ? j + 1u : first_slot;
    last_slot = hit ? j + 1u : last_slot;
  }
}
const bool earlier_row = simd_any(lane < b0 && first_slot != 0u);
const uint first_in_row = simd_shuffle(first_slot, b0 % SIMD_WIDTH);
// The expert's first occurrence (the same for the whole threadgroup).
const bool active = is_shared || (b0 < B && !earlier_row && first_in_row == j0 + 1u);

if (active) {  // uniform within the threadgroup
  const uint hidden = is_shared ? uint(IS) : uint(I);
  const uint units = hidden / UNIT;
  const uint row_words = hidden / 8;
  const uint row_groups = hidden / 64;
  const uint row_base = is_shared ? 0u : min(picked, uint(E - 1)) * uint(D);
  const device uint32_t* w = is_shared ? sdown_w : down_w;
  const device T* s = is_shared ? sdown_s : down_s;
  const device T* bias = is_shared ? sdown_b : down_b;

  // The entry's weights for this SIMD group's rows, read once.
  uint2 q[ROWS_PER_SG][UNITS_PER_LANE];
  float scale[ROWS_PER_SG][UNITS_PER_LANE];
  float offset[ROWS_PER_SG][UNITS_PER_LANE];
  for (uint rr = 0; rr < ROWS_PER_SG; ++rr) {
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

  for (uint b = 0; b < B; ++b) {
    // 1 + the row's slot for this entry (the shared expert: slot K), or 0.
    const uint slot_of_b = simd_shuffle(last_slot, b % SIMD_WIDTH);
    const uint member = is_shared ? uint(K) + 1u : slot_of_b;
    if (member != 0u) {  // the same for the whole SIMD group
      const uint slot = member - 1u;
      const uint a_row = (b * (uint(K) + 1u) + slot) * uint(IMAX);
      float acc[ROWS_PER_SG];
      for (uint rr = 0; rr < ROWS_PER_SG; ++rr) {
        acc[rr] = 0.0f;
      }
      for (uint m = 0; m < UNITS_PER_LANE; ++m) {
        const uint u = lane + m * SIMD_WIDTH;
        if (u < units) {
          // The unit's steps (moe_decode_down.metal.h), as the combined build takes them.
          float a[UNIT];
          float a_sum;
          LILY_DOWN_UNIT_ACTIVATIONS(a, a_sum, act + a_row + u * UNIT);
          for (uint rr = 0; rr < ROWS_PER_SG; ++rr) {
            LILY_DOWN_UNIT_ACC(acc[rr], a, a_sum, q[rr][m], scale[rr][m], offset[rr][m]);
          }
        }
      }
      // The weight: the routing weight of row b's slot, or the shared gate.
      const float weight = is_shared
          ? static_cast<float>(static_cast<T>(1.0f / (1.0f + metal::exp(-static_cast<float>(gate_logit[b])))))
          : static_cast<float>(scores[b * uint(K) + slot]);
      const uint t_row = (b * (uint(K) + 1u) + slot) * uint(D);
      for (uint rr = 0; rr < ROWS_PER_SG; ++rr) {
        const float y = static_cast<float>(static_cast<T>(simd_sum(acc[rr])));
        if (lane == 0 && d0 + rr < uint(D)) {
          terms[t_row + d0 + rr] = static_cast<T>(is_shared ? weight * y : y * weight);
        }
      }
    }
  }
}
