// MoE decode, launch 2 of 4: gate, up and SwiGLU, expert by expert: each
// selected expert's 4-bit rows (and the shared expert's) are read once and
// applied to every row of the batch that picked that expert.
//
// Launcher: mlx_lily/kernels/moe/decode.py. Threadgroup (block, entry) takes
// ROWS_PER_TG hidden rows of one expert: entry 0 the shared expert, for every
// row of the batch; entry 1 + f the expert of pick f = b0 * K + j0 (row b0's
// slot j0, launch 1's inds), for the rows that picked it, if f is that
// expert's first occurrence among the picks (row by row, slot by slot);
// entries of later occurrences do nothing. So each distinct expert is read
// by one entry, and no launch builds a union map: each SIMD group reads the
// B * K picks (lane l < B: row l's K picks) and finds whether the expert
// occurs before f (a SIMD any over the rows before b0, and row b0's first
// slot holding it) and at which slot each row picked it (the last slot
// holding it: picks are distinct within a row).
//
// Each SIMD group takes ROWS_PER_SG rows and first reads their gate and up
// weights into registers: lane l holds the units (a group of 64 4-bit
// weights, two 16-byte loads per row) u = l, l + 32, ... (one unit at D =
// 2048), with their scales and biases.
// Then for each row b of the batch that uses this expert, in order, lane l
// accumulates scale * sum(q * x) + bias * sum(x) per unit in fp32 over its
// units in order (w = scale * q + bias: the dequantization of MLX's affine
// group-64 format), x the unit of xn's row b; a
// SIMD sum finishes each row. That sequence of operations depends on row b's
// xn and the expert's weights only: not on B, on the other rows, or on which
// threadgroup holds the expert, so each row's result is the same bits
// whatever the batch (the batch invariance of moe_decode).
// Gate and up are rounded to bf16 (each quantized matmul's output is bf16 in
// stock) and SwiGLU rounds each step as mlx-lm's does:
// act = bf16(bf16(gate * bf16(sigmoid(gate))) * up).
//
// "bf16" here stands for T, the activations' dtype (bfloat16 or float16).
//
// Template: T, E (experts), K (top k), D (hidden size, a multiple of 64), I
//           (experts' hidden size), IS (shared expert's), IMAX (= max(I,
//           IS)), MAX_BATCH (rows at most, <= 32: a lane per row).
// Inputs:   xn [B, D] bf16; inds [B, K] uint32 (launch 1); gate_w, up_w [E,
//           I, D / 8] uint32 (value j of a word in bits 4j..4j+3), gate_s,
//           gate_b, up_s, up_b [E, I, D / 64] bf16; sgate_w, sup_w [IS, D /
//           8] uint32, sgate_s, sgate_b, sup_s, sup_b [IS, D / 64] bf16. B is
//           xn's first dimension.
// Output:   act [B, K + 1, IMAX] bf16: (b, j) row b's activations at its slot
//           j (j = K: the shared expert), the first I or IS of them written.
// Grid:     (ceil(IMAX / ROWS_PER_TG) * THREADS, 1 + B * K, 1), threadgroup
//           (THREADS, 1, 1).

constexpr uint SIMD_WIDTH = 32;
// 8 SIMD groups of one row: 8 rows a threadgroup, 64 blocks of an expert at
// I = 512; at one row, 9 entries (576 threadgroups). One row a SIMD group
// keeps its loops small enough for nvcc to unroll them, so that the
// weights held across the batch stay in registers (two rows spill them).
constexpr uint SIMD_GROUPS = 8;
constexpr uint ROWS_PER_SG = 1;
constexpr uint ROWS_PER_TG = SIMD_GROUPS * ROWS_PER_SG;
constexpr uint UNIT = 64;                 // 4-bit weights per lane and row: a group, two uint4 loads
constexpr uint UNITS = D / UNIT;
// One at D = 2048 (a SIMD group's 32 lanes cover a row in one pass).
constexpr uint UNITS_PER_LANE = (UNITS + SIMD_WIDTH - 1) / SIMD_WIDTH;
constexpr uint ROW_WORDS = D / 8;
constexpr uint ROW_GROUPS = D / 64;

const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint block = threadgroup_position_in_grid.x;
const uint entry = threadgroup_position_in_grid.y;
const uint B = min(uint(xn_shape[0]), uint(MAX_BATCH));
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
// The expert's first occurrence (the same for every SIMD group of the
// threadgroup); later occurrences' entries do nothing.
const bool active = is_shared || (b0 < B && !earlier_row && first_in_row == j0 + 1u);
const uint expert = active ? min(picked, uint(E - 1)) : 0u;
const uint rows = is_shared ? uint(IS) : uint(I);
const uint row_base = is_shared ? 0u : expert * uint(I);
const uint r0 = block * ROWS_PER_TG + sg * ROWS_PER_SG;

const device uint32_t* gw = is_shared ? sgate_w : gate_w;
const device T* gs = is_shared ? sgate_s : gate_s;
const device T* gb = is_shared ? sgate_b : gate_b;
const device uint32_t* uw = is_shared ? sup_w : up_w;
const device T* us = is_shared ? sup_s : up_s;
const device T* ub = is_shared ? sup_b : up_b;

// -- this SIMD group's weights, read once ----------------------------------------
// Lanes past the row's units (D not a multiple of 2048) hold zeros, so that
// the loops below need no branch: they unroll and the weights stay in registers.
uint q_gate[ROWS_PER_SG][UNITS_PER_LANE][8];
uint q_up[ROWS_PER_SG][UNITS_PER_LANE][8];
float s_gate[ROWS_PER_SG][UNITS_PER_LANE];
float b_gate[ROWS_PER_SG][UNITS_PER_LANE];
float s_up[ROWS_PER_SG][UNITS_PER_LANE];
float b_up[ROWS_PER_SG][UNITS_PER_LANE];
for (uint rr = 0; rr < ROWS_PER_SG; ++rr) {
  for (uint m = 0; m < UNITS_PER_LANE; ++m) {
    const uint u = lane + m * SIMD_WIDTH;
    const bool present = active && r0 + rr < rows && u < UNITS;
    const uint row = present ? row_base + r0 + rr : 0u;
    const uint at = row * ROW_GROUPS + (present ? u : 0u);
    for (uint half_ = 0; half_ < 2; ++half_) {
      const uint4 g = *reinterpret_cast<const device uint4*>(gw + row * ROW_WORDS + (present ? u : 0u) * 8 + half_ * 4);
      const uint4 p = *reinterpret_cast<const device uint4*>(uw + row * ROW_WORDS + (present ? u : 0u) * 8 + half_ * 4);
      q_gate[rr][m][half_ * 4 + 0] = present ? g.x : 0u;
      q_gate[rr][m][half_ * 4 + 1] = present ? g.y : 0u;
      q_gate[rr][m][half_ * 4 + 2] = present ? g.z : 0u;
      q_gate[rr][m][half_ * 4 + 3] = present ? g.w : 0u;
      q_up[rr][m][half_ * 4 + 0] = present ? p.x : 0u;
      q_up[rr][m][half_ * 4 + 1] = present ? p.y : 0u;
      q_up[rr][m][half_ * 4 + 2] = present ? p.z : 0u;
      q_up[rr][m][half_ * 4 + 3] = present ? p.w : 0u;
    }
    s_gate[rr][m] = present ? static_cast<float>(gs[at]) : 0.0f;
    b_gate[rr][m] = present ? static_cast<float>(gb[at]) : 0.0f;
    s_up[rr][m] = present ? static_cast<float>(us[at]) : 0.0f;
    b_up[rr][m] = present ? static_cast<float>(ub[at]) : 0.0f;
  }
}

// -- each row of the batch that uses this expert ------------------------------------
for (uint b = 0; b < (active ? B : 0u); ++b) {  // uniform: active is the threadgroup's
  // 1 + the row's slot for this expert (the shared expert: slot K), or 0.
  const uint slot_of_b = simd_shuffle(last_slot, b % SIMD_WIDTH);
  const uint member = is_shared ? uint(K) + 1u : (active ? slot_of_b : 0u);
  if (member != 0u) {  // uniform: every thread of the group sees the same member
    float acc_gate[ROWS_PER_SG];
    float acc_up[ROWS_PER_SG];
    for (uint rr = 0; rr < ROWS_PER_SG; ++rr) {
      acc_gate[rr] = 0.0f;
      acc_up[rr] = 0.0f;
    }
    for (uint m = 0; m < UNITS_PER_LANE; ++m) {
      const uint u = min(lane + m * SIMD_WIDTH, UNITS - 1);  // in range; its weights are zeros past D
      float x[UNIT];
      float x_sum = 0.0f;
      for (uint i = 0; i < UNIT; ++i) {
        x[i] = static_cast<float>(xn[b * uint(D) + u * UNIT + i]);
        x_sum += x[i];
      }
      for (uint rr = 0; rr < ROWS_PER_SG; ++rr) {
        float dot_g = 0.0f;
        float dot_u = 0.0f;
        for (uint w = 0; w < 8; ++w) {
          for (uint k = 0; k < 8; ++k) {
            dot_g += x[w * 8 + k] * static_cast<float>((q_gate[rr][m][w] >> (4 * k)) & 0xFu);
            dot_u += x[w * 8 + k] * static_cast<float>((q_up[rr][m][w] >> (4 * k)) & 0xFu);
          }
        }
        acc_gate[rr] += s_gate[rr][m] * dot_g + b_gate[rr][m] * x_sum;
        acc_up[rr] += s_up[rr][m] * dot_u + b_up[rr][m] * x_sum;
      }
    }
    const uint out_row = (b * (uint(K) + 1u) + member - 1u) * uint(IMAX);
    for (uint rr = 0; rr < ROWS_PER_SG; ++rr) {
      float gate = simd_sum(acc_gate[rr]);
      float up = simd_sum(acc_up[rr]);
      if (lane == 0 && r0 + rr < rows) {
        gate = static_cast<float>(static_cast<T>(gate));
        up = static_cast<float>(static_cast<T>(up));
        const float sig = static_cast<float>(static_cast<T>(1.0f / (1.0f + metal::exp(-gate))));
        const float silu = static_cast<float>(static_cast<T>(gate * sig));
        act[out_row + r0 + rr] = static_cast<T>(silu * up);
      }
    }
  }
}
