// MoE decode, launch 2 of 4: gate, up and SwiGLU, expert by expert: each
// selected expert's 4-bit rows (and the shared expert's) are read once and
// applied to every row of the batch that picked that expert.
//
// Launcher: mlx_lily/kernels/moe/decode.py. Threadgroup (block, entry) takes
// ROWS_PER_TG = NSG x ROWS hidden rows of one expert: entry 0 the shared
// expert, for every row of the batch; entry 1 + f the expert of pick f = b0 * K + j0 (row b0's
// slot j0, launch 1's inds), for the rows that picked it, if f is that
// expert's first occurrence among the picks (row by row, slot by slot);
// entries of later occurrences do nothing. So each distinct expert is read
// by one entry, and no launch builds a union map: each SIMD group reads the
// B * K picks (lane l < B: row l's K picks) and finds whether the expert
// occurs before f (a SIMD any over the rows before b0, and row b0's first
// slot holding it) and at which slot each row picked it (the last slot
// holding it: picks are distinct within a row).
//
// Each SIMD group takes one hidden row of gate and of up a turn (ROWS turns),
// and its lanes split D as the decode GEMV splits K: per step a lane loads 16
// bytes of each row (its unit: 32 4-bit values, half a quantization group),
// so a SIMD group reads 512 contiguous bytes of a row per load (D / 1024
// steps, two at D = 2048; each step's loads issued a step ahead, the next
// turn's first step during this turn's last). Each word is unpacked once a
// pass (the bf16 pattern trick of gemv.metal: no integer-to-float
// conversion) and applied to the pass's rows of the batch that use this
// expert, each of which reads its 8 values of xn at a chunk in one 16-byte
// load.
// Per row b and per unit, in order (units by step, chunks of 8 values in
// order): dot = fma chain over the chunk's 8 q * x, acc = fma(scale, dot,
// acc); after the unit's last chunk acc = fma(bias, sum(x over the unit),
// acc) (w = scale * q + bias: MLX's affine group-64 format); a SIMD sum
// finishes the row. That sequence depends on row b's xn and the expert's
// weights only: not on B, on the other rows, or on which threadgroup holds
// the expert, so each row's result is the same bits whatever the batch (the
// batch invariance of moe_decode), nor on GROUP: the rows that use the
// expert are taken GROUP at a time, each pass reading the expert's rows again
// (from cache after the first), so that a lane holds GROUP rows'
// accumulators, not MAX_BATCH's. Every loop over a pass's rows runs to GROUP
// with a uniform branch per row (constant indices keep the accumulators in
// registers).
// Gate and up are rounded to bf16 (each quantized matmul's output is bf16 in
// stock) and SwiGLU rounds each step as mlx-lm's does:
// act = bf16(bf16(gate * bf16(sigmoid(gate))) * up).
//
// "bf16" here stands for T, the activations' dtype (bfloat16 or float16).
//
// Template: T, E (experts), K (top k), D (hidden size, a multiple of 64), I
//           (experts' hidden size), IS (shared expert's), IMAX (= max(I,
//           IS)), MAX_BATCH (rows at most, <= 16: a lane per row, and four
//           bits a row in the packed member list), GROUP (rows a pass), NSG
//           (SIMD groups per threadgroup), ROWS (hidden rows per SIMD group).
// Two builds share this body (the macros LILY_ROWS, LILY_GATE_UP_PROLOGUE,
// LILY_PICK and LILY_X_CHUNK, from each build's header): launch 2 as
// described, reading launch 1's xn and inds; and, for a few rows, launches 1
// and 2 as one ("routed": moe_decode_route_gate_up.metal.h), whose
// threadgroups each take every row's top-k and norm first, as launch 1
// computes them, and read x as h and the norm weight give it.
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
// NSG SIMD groups (the launcher's choice, 8 by default), ROWS hidden rows
// each: at one row a turn, 64 blocks of an expert at I = 512, and at one row
// of the batch 9 entries (576 threadgroups). More rows a SIMD group, fewer
// threadgroups: the routed build's threadgroups each redo the top-k and norm.
constexpr uint SIMD_GROUPS = NSG;
constexpr uint ROWS_PER_TG = SIMD_GROUPS * ROWS;
constexpr uint VALUES = 32;                   // a lane's 4-bit values per step: 16 bytes
constexpr uint SPAN = SIMD_WIDTH * VALUES;    // a SIMD group's step
constexpr uint STEPS = (D + SPAN - 1) / SPAN;
constexpr uint ROW_WORDS = D / 8;
constexpr uint ROW_GROUPS = D / 64;

const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint block = threadgroup_position_in_grid.x;
const uint entry = threadgroup_position_in_grid.y;
// (Both builds' row counts are named here: a build is given the shapes of
// the inputs its body names.)
const uint B = min(uint(LILY_ROWS(xn_shape, h_shape)), uint(MAX_BATCH));
// The routed build's top-k and norms (moe_decode_route_gate_up.metal.h);
// nothing in this build (moe_decode_gate_up.metal.h).
LILY_GATE_UP_PROLOGUE
const bool is_shared = entry == 0;
// Entry 1 + f: pick f, row b0's slot j0. Lane l < B: the first and the last
// slot (1 + slot, 0 if none) at which row l picked that expert.
const uint f = is_shared ? 0u : entry - 1u;
const uint b0 = f / uint(K);
const uint j0 = f % uint(K);
const uint picked = (is_shared || b0 >= B) ? 0u : LILY_PICK(f);
uint first_slot = 0u;
uint last_slot = 0u;
if (!is_shared && lane < B) {
  for (uint j = 0; j < uint(K); ++j) {
    const bool hit = LILY_PICK(lane * uint(K) + j) == picked;
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
// The members: lane b < B holds row b's 1 + slot for this expert (the shared
// expert: K + 1; 0 where row b does not use it, and on an idle entry). They
// are packed in row order four bits a row into member_rows (16 rows at most:
// MAX_BATCH <= 16) and taken GROUP at a time: each pass keeps GROUP rows'
// accumulators in registers and reads the expert's rows again (from cache
// after the first pass), so the registers a lane needs follow GROUP, not
// MAX_BATCH. An idle entry has no member: it loads and stores nothing.
const uint my_slot = (active && lane < B) ? (is_shared ? uint(K) + 1u : last_slot) : 0u;
uint member_rows_lo = 0u;
uint member_rows_hi = 0u;
uint members = 0u;
for (uint b = 0; b < uint(MAX_BATCH); ++b) {
  const uint slot_of_b = simd_shuffle(my_slot, b % SIMD_WIDTH);
  if (slot_of_b != 0u) {  // uniform
    if (members < 8u) {
      member_rows_lo |= b << (4u * members);
    } else {
      member_rows_hi |= b << (4u * (members - 8u));
    }
    members += 1u;
  }
}

const device uint32_t* gw = is_shared ? sgate_w : gate_w;
const device T* gs = is_shared ? sgate_s : gate_s;
const device T* gb = is_shared ? sgate_b : gate_b;
const device uint32_t* uw = is_shared ? sup_w : up_w;
const device T* us = is_shared ? sup_s : up_s;
const device T* ub = is_shared ? sup_b : up_b;
const uint4 no_words = {0u, 0u, 0u, 0u};
// This SIMD group's hidden rows: ROWS of them, one a turn, the threadgroup's
// SIMD groups taking consecutive rows in each turn. Each row's sums are the
// same whichever turn, SIMD group or threadgroup takes it. A turn past the
// expert's rows does nothing (and every turn after it: r grows with the
// turn); no early return before the SIMD sums of the turns that do.
const uint r_first = block * ROWS_PER_TG + sg;

for (uint first = 0; first < members; first += uint(GROUP)) {  // uniform
  // This pass's rows: member first + g, for g < GROUP while there is one.
  uint pass_row[GROUP];
  bool in_pass[GROUP];
  for (uint g = 0; g < uint(GROUP); ++g) {
    const uint m = first + g;
    in_pass[g] = m < members;
    pass_row[g] = m < 8u ? (member_rows_lo >> (4u * m)) & 0xFu : (member_rows_hi >> (4u * (m - 8u))) & 0xFu;
  }

  // -- this lane's weights, a step ahead: step s + 1's loads are issued before
  // step s's multiplies, and a turn's first step's during the turn before's
  // last, so that two steps' words stay in flight from the pass's first
  // hidden row to its last (ROWS rows cost about ROWS times the loads of one,
  // not ROWS times a row's whole latency). Scalars, not arrays indexed by the
  // step: a loop nvcc leaves rolled would put those in local memory.
  uint4 next_gate = no_words;
  uint4 next_up = no_words;
  float next_s_gate = 0.0f, next_b_gate = 0.0f, next_s_up = 0.0f, next_b_up = 0.0f;
  if (r_first < rows && lane * VALUES < uint(D)) {  // D a multiple of 64: a unit is all in or all out
    const uint row = row_base + r_first;
    next_gate = *reinterpret_cast<const device uint4*>(gw + row * ROW_WORDS + lane * VALUES / 8);
    next_up = *reinterpret_cast<const device uint4*>(uw + row * ROW_WORDS + lane * VALUES / 8);
    next_s_gate = static_cast<float>(gs[row * ROW_GROUPS + lane * VALUES / 64]);
    next_b_gate = static_cast<float>(gb[row * ROW_GROUPS + lane * VALUES / 64]);
    next_s_up = static_cast<float>(us[row * ROW_GROUPS + lane * VALUES / 64]);
    next_b_up = static_cast<float>(ub[row * ROW_GROUPS + lane * VALUES / 64]);
  }

  for (uint turn = 0; turn < uint(ROWS); ++turn) {
    const uint r = r_first + turn * SIMD_GROUPS;  // this turn's hidden row
    if (r < rows) {  // uniform
      const uint row = row_base + r;
      // Whether the next turn has a row (then its first step loads during this
      // turn's last).
      const bool next_turn = turn + 1u < uint(ROWS) && r + SIMD_GROUPS < rows;
      float acc_gate[GROUP];
      float acc_up[GROUP];
      float x_sum[GROUP];
      for (uint g = 0; g < uint(GROUP); ++g) {
        acc_gate[g] = 0.0f;
        acc_up[g] = 0.0f;
      }
      for (uint s = 0; s < STEPS; ++s) {
        const uint k0 = s * SPAN + lane * VALUES;
        const bool present = k0 < uint(D);
        const uint4 words_gate = next_gate;
        const uint4 words_up = next_up;
        const float s_gate = next_s_gate, b_gate = next_b_gate, s_up = next_s_up, b_up = next_b_up;
        // The next step's loads: this row's, or the next turn's row's first.
        const bool ahead = s + 1 < STEPS;
        const uint k_next = ahead ? k0 + SPAN : lane * VALUES;
        const uint row_next = ahead ? row : row + SIMD_GROUPS;
        if ((ahead || next_turn) && k_next < uint(D)) {
          next_gate = *reinterpret_cast<const device uint4*>(gw + row_next * ROW_WORDS + k_next / 8);
          next_up = *reinterpret_cast<const device uint4*>(uw + row_next * ROW_WORDS + k_next / 8);
          next_s_gate = static_cast<float>(gs[row_next * ROW_GROUPS + k_next / 64]);
          next_b_gate = static_cast<float>(gb[row_next * ROW_GROUPS + k_next / 64]);
          next_s_up = static_cast<float>(us[row_next * ROW_GROUPS + k_next / 64]);
          next_b_up = static_cast<float>(ub[row_next * ROW_GROUPS + k_next / 64]);
        }
        for (uint g = 0; g < uint(GROUP); ++g) {
          x_sum[g] = 0.0f;
        }
        for (uint c = 0; c < 4; ++c) {
          // Chunk c (word c): values m and m + 4 of its eight under the bf16
          // pattern 0x4300 are the bf16 numbers 128 + q (exact after - 128).
          const uint wg = c == 0 ? words_gate.x : (c == 1 ? words_gate.y : (c == 2 ? words_gate.z : words_gate.w));
          const uint wu = c == 0 ? words_up.x : (c == 1 ? words_up.y : (c == 2 ? words_up.z : words_up.w));
          const uint4 pairs_gate = {(wg & 0x000F000Fu) | 0x43004300u, ((wg >> 4) & 0x000F000Fu) | 0x43004300u,
                                    ((wg >> 8) & 0x000F000Fu) | 0x43004300u, ((wg >> 12) & 0x000F000Fu) | 0x43004300u};
          const uint4 pairs_up = {(wu & 0x000F000Fu) | 0x43004300u, ((wu >> 4) & 0x000F000Fu) | 0x43004300u,
                                  ((wu >> 8) & 0x000F000Fu) | 0x43004300u, ((wu >> 12) & 0x000F000Fu) | 0x43004300u};
          float q_gate[8];
          float q_up[8];
          for (uint m = 0; m < 4; ++m) {
            q_gate[m] = lily_tile_unpack(pairs_gate, 2 * m) - 128.0f;
            q_gate[m + 4] = lily_tile_unpack(pairs_gate, 2 * m + 1) - 128.0f;
            q_up[m] = lily_tile_unpack(pairs_up, 2 * m) - 128.0f;
            q_up[m + 4] = lily_tile_unpack(pairs_up, 2 * m + 1) - 128.0f;
          }
          for (uint g = 0; g < uint(GROUP); ++g) {
            if (in_pass[g]) {  // uniform
              float xs[8];
              LILY_X_CHUNK(xs, pass_row[g], k0 + 8 * c, present);
              float dot_gate = 0.0f;
              float dot_up = 0.0f;
              for (uint i = 0; i < 8; ++i) {
                const float x = xs[i];
                x_sum[g] += x;
                dot_gate = fma(q_gate[i], x, dot_gate);
                dot_up = fma(q_up[i], x, dot_up);
              }
              acc_gate[g] = fma(s_gate, dot_gate, acc_gate[g]);
              acc_up[g] = fma(s_up, dot_up, acc_up[g]);
            }
          }
        }
        for (uint g = 0; g < uint(GROUP); ++g) {
          acc_gate[g] = fma(b_gate, x_sum[g], acc_gate[g]);
          acc_up[g] = fma(b_up, x_sum[g], acc_up[g]);
        }
      }

      // -- finish each row of the pass: gate and up, then SwiGLU ------------------------
      for (uint g = 0; g < uint(GROUP); ++g) {
        if (in_pass[g]) {  // uniform
          float gate = simd_sum(acc_gate[g]);
          float up = simd_sum(acc_up[g]);
          const uint slot = simd_shuffle(my_slot, pass_row[g]);
          if (lane == 0) {
            gate = static_cast<float>(static_cast<T>(gate));
            up = static_cast<float>(static_cast<T>(up));
            const float sig = static_cast<float>(static_cast<T>(1.0f / (1.0f + metal::exp(-gate))));
            const float silu = static_cast<float>(static_cast<T>(gate * sig));
            act[(pass_row[g] * (uint(K) + 1u) + slot - 1u) * uint(IMAX) + r] = static_cast<T>(silu * up);
          }
        }
      }
    }
  }
}
