// MoE decode, launch 3 of 3: the down projections of the selected experts and
// the shared expert, expert by expert, then per row the routing weights, the
// shared expert's gate and the residual:
//
//   out[b, d] = bf16(h[b, d] + bf16(bf16(sum_j bf16(s_bj * y_bj[d])) + bf16(g_b * y_sb[d])))
//   y_bj[d] = bf16(down_(e_bj)[d] . act_bj),  y_sb[d] = bf16(shared_down[d] . act_sb),
//   g_b = bf16(sigmoid(row b's shared gate logit))
//
// with stock mlx-lm's roundings: each quantized matmul's output, each weighted
// slot, sigmoid and the gated shared term are bf16; the slot sum is fp32, in
// the row's own slot order (as moe_combine sums it); then the MoE output and
// the residual sum are rounded as stock's `h + (y + shared)`.
//
// Launcher: mlx_lily/kernels/moe/decode.py. A threadgroup takes ROWS_PER_TG
// output rows d for every row b of the batch. Its SIMD groups share out the
// entries (0: the shared expert; 1 + u: the union's u-th distinct expert,
// launch 1's experts and members): a SIMD group reads an entry's down weights
// for the threadgroup's rows into registers once (lane l: hidden units of 16
// 4-bit weights, one 8-byte load per row, u = l, l + 32, ...), then, for each
// row b that uses the entry, accumulates scale * sum(q * a) + bias * sum(a)
// per unit in fp32 over its units in order, a SIMD sum finishing each output
// row, and leaves the weighted (or gated) term in threadgroup memory at (d,
// b, slot). After a barrier each thread (d, b) sums its row's slots in order
// and adds the shared term and the residual. Every step of row b's sums is
// fixed by row b's inputs alone: the same bits whatever B is and whichever
// SIMD group held the expert.
//
// "bf16" here stands for T, the activations' dtype (bfloat16 or float16).
//
// Template: T, E (experts), K (top k), D (hidden size), I (experts' hidden
//           size), IS (shared expert's), IMAX (= max(I, IS)), MAX_BATCH; I
//           and IS multiples of 64.
// Inputs:   h [B, 1, D] bf16; act [B, K + 1, IMAX] bf16 (launch 2); experts
//           [B * K], members [B * K, B] uint32 (launch 1); scores [B, K]
//           bf16; gate_logit [B, 1, 1] bf16; down_w [E, D, I / 8] uint32,
//           down_s, down_b [E, D, I / 64] bf16; sdown_w [D, IS / 8] uint32,
//           sdown_s, sdown_b [D, IS / 64] bf16. B is h's first dimension.
// Output:   out [B, 1, D] bf16.
// Grid:     (ceil(D / ROWS_PER_TG) * THREADS, 1, 1), threadgroup (THREADS, 1, 1).

constexpr uint SIMD_WIDTH = 32;
// 8 SIMD groups, 4 output rows a threadgroup: 512 threadgroups at D = 2048;
// at one row, 9 entries over 8 SIMD groups.
constexpr uint SIMD_GROUPS = 8;
constexpr uint THREADS = SIMD_GROUPS * SIMD_WIDTH;
constexpr uint ROWS_PER_TG = 4;
constexpr uint UNIT = 16;                 // 4-bit weights per lane and load (uint2)
constexpr uint UNITS_PER_LANE = (uint(IMAX) / UNIT + SIMD_WIDTH - 1) / SIMD_WIDTH;

threadgroup float weighted[ROWS_PER_TG * uint(MAX_BATCH) * uint(K)];  // bf16(s_bj * y_bj[d]) at (d, b, j)
threadgroup float gated[ROWS_PER_TG * uint(MAX_BATCH)];                // bf16(g_b * y_sb[d]) at (d, b)

const uint tid = thread_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint d0 = threadgroup_position_in_grid.x * ROWS_PER_TG;
const uint B = min(uint(h_shape[0]), uint(MAX_BATCH));
const uint entries = 1u + B * uint(K);

for (uint entry = sg; entry < entries; entry += SIMD_GROUPS) {  // uniform within a SIMD group
  const bool is_shared = entry == 0;
  // Entries past the union's size hold NO_EXPERT (>= E): nothing to do.
  const uint picked = is_shared ? 0u : experts[entry - 1];
  if (!is_shared && picked >= uint(E)) {
    continue;
  }
  const uint hidden = is_shared ? uint(IS) : uint(I);
  const uint units = hidden / UNIT;
  const uint row_words = hidden / 8;
  const uint row_groups = hidden / 64;
  const uint expert = picked;
  const uint row_base = is_shared ? 0u : expert * uint(D);
  const device uint32_t* w = is_shared ? sdown_w : down_w;
  const device T* s = is_shared ? sdown_s : down_s;
  const device T* bias = is_shared ? sdown_b : down_b;

  // The entry's weights for this threadgroup's rows, read once.
  uint2 q[ROWS_PER_TG][UNITS_PER_LANE];
  float scale[ROWS_PER_TG][UNITS_PER_LANE];
  float offset[ROWS_PER_TG][UNITS_PER_LANE];
  for (uint rr = 0; rr < ROWS_PER_TG; ++rr) {
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
    const uint member = is_shared ? uint(K) + 1u : members[(entry - 1) * B + b];
    if (member != 0u) {  // the same for the whole SIMD group
      const uint slot = member - 1u;
      const uint a_row = (b * (uint(K) + 1u) + slot) * uint(IMAX);
      float acc[ROWS_PER_TG];
      for (uint rr = 0; rr < ROWS_PER_TG; ++rr) {
        acc[rr] = 0.0f;
      }
      for (uint m = 0; m < UNITS_PER_LANE; ++m) {
        const uint u = lane + m * SIMD_WIDTH;
        if (u < units) {
          float a[UNIT];
          float a_sum = 0.0f;
          for (uint i = 0; i < UNIT; ++i) {
            a[i] = static_cast<float>(act[a_row + u * UNIT + i]);
            a_sum += a[i];
          }
          for (uint rr = 0; rr < ROWS_PER_TG; ++rr) {
            const uint words[2] = {q[rr][m].x, q[rr][m].y};
            float dot = 0.0f;
            for (uint wi = 0; wi < 2; ++wi) {
              for (uint n = 0; n < 8; ++n) {
                dot += a[wi * 8 + n] * static_cast<float>((words[wi] >> (4 * n)) & 0xFu);
              }
            }
            acc[rr] += scale[rr][m] * dot + offset[rr][m] * a_sum;
          }
        }
      }
      for (uint rr = 0; rr < ROWS_PER_TG; ++rr) {
        const float y = static_cast<float>(static_cast<T>(simd_sum(acc[rr])));
        if (lane == 0) {
          if (is_shared) {
            const float open = static_cast<float>(static_cast<T>(
                1.0f / (1.0f + metal::exp(-static_cast<float>(gate_logit[b])))));
            gated[rr * uint(MAX_BATCH) + b] = static_cast<float>(static_cast<T>(open * y));
          } else {
            const float s_bj = static_cast<float>(scores[b * uint(K) + slot]);
            weighted[(rr * uint(MAX_BATCH) + b) * uint(K) + slot] = static_cast<float>(static_cast<T>(y * s_bj));
          }
        }
      }
    }
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// -- per (d, b): the row's slots in its own order, the shared term, the residual ------
for (uint cell = tid; cell < ROWS_PER_TG * B; cell += THREADS) {
  const uint rr = cell / B;
  const uint b = cell % B;
  const uint d = d0 + rr;
  if (d < uint(D)) {
    float routed = 0.0f;
    for (uint j = 0; j < uint(K); ++j) {
      routed += weighted[(rr * uint(MAX_BATCH) + b) * uint(K) + j];
    }
    const float moe = static_cast<float>(static_cast<T>(
        static_cast<float>(static_cast<T>(routed)) + gated[rr * uint(MAX_BATCH) + b]));
    out[b * uint(D) + d] = static_cast<T>(static_cast<float>(h[b * uint(D) + d]) + moe);
  }
}
