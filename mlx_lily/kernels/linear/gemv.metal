// Row-parallel quantized matrix-vector product for decode (one token of each
// of B sequences, 1 to 16, in a build for BATCH rows, B's bucket), with the input's prologue and the residual
// epilogue fused, for up to four projections that read the same input in one
// dispatch:
//
//   xin[b]   = x[b]                                  (PROLOGUE 0)
//            | rms_norm(x[b], norm_weight, eps)      (PROLOGUE 1)
//            | x[b] * sigmoid(gate[b])               (PROLOGUE 2)
//   out_s[b] = xin[b] . W_s^T   for each segment s (W_s = scales * q + biases)
//   out_0[b] = residual[b] + out_0[b]  (RESIDUAL, one segment only)
//
// Launcher: mlx_lily/kernels/linear/gemv.py. Each threadgroup first computes
// each row's norm (its sum of squares once per threadgroup). Each SIMD group
// takes one block of ROWS_PER_SIMDGROUP consecutive weight rows of one
// segment (segments are padded to whole blocks, so a block never straddles
// two of them) and its lanes split K: per step a lane loads 16 bytes of each
// weight row (its unit: 32 values at 4 bits, 16 at 8 bits, always inside one
// quantization group), so a SIMD group reads 512 contiguous bytes of a weight
// row per load instruction. A lane dequantizes each word once and applies it
// to all BATCH rows of x: BATCH x ROWS fp32 accumulators, each scale * q .
// xin per chunk of 8 values plus bias * sum(xin) per unit; simd_sum finishes
// each.
//
// Tiles: xin, rounded to XT as MLX's ops round it, is computed by all threads
// of the threadgroup into threadgroup memory, TILE values of each of the
// BATCH rows at a time; after a barrier every lane multiplies its chunks in
// that tile, and after another the next tile is staged. TILE >= K (WHOLE:
// B = 1, and every bucket whose BATCH x K values fit the budget) is one tile;
// TILE a multiple of 1024 (a 4-bit step) tiles K in runs of TILE values;
// TILE 512 or 256 (PARTS 2) makes tile 2j + p hold half p of each 32-value
// run of block j (BLOCK = 2 TILE values), so that a 4-bit unit's chunks 0-1
// are in one tile and 2-3 in the next, and at 512 all 32 lanes work in
// both (at 256, fp32 xin of 16 rows, half of them). A
// lane's units and chunks are visited in the same order in every form: units
// by step, chunks within a unit in order, in nondecreasing tiles (within a
// block an 8-bit lane's units keep one half, its chunks never split), so each
// accumulator takes the same fma sequence whatever TILE is. Units past K (the
// last step's zeros) are the last tile's.
//
// Batch invariance: row b's outputs are the same bits whatever B and BATCH
// are and whatever the other rows hold. NORM_SG (which orders the norm's sum
// of squares: its first NORM_SG SIMD groups sum it, the others wait) never
// depends on the batch; ROWS and NSG may (the launcher takes fewer rows per
// SIMD group for large buckets, so that BATCH x ROWS accumulators stay in
// registers; a tuning choice may take more SIMD groups, over which the
// staging of x is shared): a weight row's dot product is summed by the same
// lanes in the same order whatever ROWS and NSG are. Every accumulator takes
// the same sequence of operations in the same order for every b and every
// BATCH, and the multiply-adds are explicit fma() calls, so no compiler
// contracts them differently per instance. xin is the same value in every
// tile form (the same operations on the same inputs).
//
// Rows b >= B of the bucket (B = layout[8], a runtime value, so that one
// build serves every B of its bucket) read nothing and write nothing: every
// loop over b runs to BATCH (constant indices keep the accumulators in
// registers); those rows' xin is zero in the dot products (skipping their
// multiply-adds there leaves nvcc's batch loop rolled), and the norm, the
// staging and the stores skip them by a uniform branch.
//
// Rounding: xin is rounded where MLX's ops round it (rms_norm: x * inv_rms
// rounded to XT, times the weight rounded to XT; gate: sigmoid rounded to XT,
// the product rounded to XT); each row is rounded once to XT (the matmul's
// output) and, with RESIDUAL, residual + that rounded to OutT. Sums are fp32,
// in another order than MLX's.
//
// Template: XT (the matmul's input and output dtype: x's, bfloat16 or float16,
//           promoted with the norm weight's as rms_norm promotes it), OutT (the
//           output's dtype), K (a multiple of 64), S (segments, 1..4),
//           BITS0..BITS3 (4 or 8; 0 past S), NSG (SIMD groups per threadgroup),
//           NORM_SG (the SIMD groups that sum the norm's squares, <= NSG),
//           ROWS (weight rows per SIMD group), PROLOGUE (0, 1, 2), RESIDUAL
//           (bool), BATCH (the bucket of B: 1, 2, 4, 8 or 16, gemv.py's
//           BATCH_BUCKETS), TILE (values of K staged per row at a time: K or
//           more for the whole row, else 256, 512 or a multiple of 1024, with
//           BATCH x TILE values of XT within the threadgroup budget).
// Inputs:   x [B, 1, K] bf16 or fp16 (strided); w<s> [N_s, K * BITS<s> / 32]
//           uint32 (row-contiguous; value j of a word in bits BITS*j ...),
//           scales<s>, biases<s> [N_s, K / 64] x's dtype (row-contiguous);
//           norm_weight [K] (strided); gate [B, 1, G, D] x's dtype with
//           G * D = K (strided); residual [B, 1, N_0] x's dtype (strided);
//           layout uint32 [9]: each segment's end in row blocks (4), rows (4),
//           B (1);
//           scalars fp32 [1]: eps. An unused norm_weight, gate or residual
//           is a small dummy; the arrays of segments past S are not passed
//           (the launcher declares them as segment 0's, never read).
// Outputs:  out0..out3 [B, 1, N_s] (one output per segment, so each
//           projection is an array of its own, no view of a shared one; none
//           past S).
// Grid:     (threadgroups * NSG * 32, 1, 1), threadgroup (NSG * 32, 1, 1).

// Rows per SIMD group (ROWS): each lane keeps this many 16-byte loads in
// flight per step and reuses its xin values for all of them (the launcher
// picks 1, 2 or 4 by the call's weight rows and the bucket, gemv.py's
// launch_choice).
constexpr uint ROWS_PER_SIMDGROUP = ROWS;
constexpr uint SIMD_WIDTH = 32;
constexpr uint THREADS = NSG * SIMD_WIDTH;
constexpr uint GROUP_SIZE = 64;
constexpr uint GROUPS_PER_ROW = K / GROUP_SIZE;
// A lane's values per step: 16 bytes of a row.
constexpr uint VALUES4 = 32;
constexpr uint VALUES8 = 16;
constexpr uint STEPS4 = (K + SIMD_WIDTH * VALUES4 - 1) / (SIMD_WIDTH * VALUES4);
constexpr uint STEPS8 = (K + SIMD_WIDTH * VALUES8 - 1) / (SIMD_WIDTH * VALUES8);
constexpr uint WORDS4 = K / 8;  // uint32 words of a 4-bit row
constexpr uint WORDS8 = K / 4;  // of an 8-bit row
// The prologue's output in threadgroup memory, TILE values of each row at a
// time (the launcher's choice, gemv.py's tile_values; see "Tiles" above).
constexpr bool WHOLE = TILE >= K;
constexpr uint SPAN4 = SIMD_WIDTH * VALUES4;  // a SIMD group's step at 4 bits (two at 8)
constexpr uint PARTS = (WHOLE || TILE >= SPAN4) ? 1u : 2u;
constexpr uint RUN = 32 / PARTS;  // values of each 32-value run in one tile
constexpr uint BLOCK = WHOLE ? K : TILE * PARTS;
constexpr uint TILES = WHOLE ? 1u : (K + BLOCK - 1) / BLOCK * PARTS;
constexpr uint ROW_VALUES = WHOLE ? K : TILE;

// xin of row b's values in the current tile, held as XT at b * ROW_VALUES +
// swizzled(slot): within each run of 32 slots, pairs are rotated by
// (slot / 64) % 16, so that the 32 lanes reading "value i of their own 32
// (or 16)" touch 32 different banks.
threadgroup XT xin[BATCH * ROW_VALUES];
threadgroup float partial[BATCH * NORM_SG];
threadgroup float row_inv_rms[BATCH];

const uint tid = thread_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint gate_d = uint(gate_shape[3]);
// layout: block ends [0..3], rows [4..7], rows of x [8].
const uint batch_rows = layout[8];

// -- prologue: each row's norm ------------------------------------------------------
if (PROLOGUE == 1) {
  float squares[BATCH];
  for (uint b = 0; b < BATCH; ++b) {
    squares[b] = 0.0f;
  }
  constexpr uint NORM_THREADS = NORM_SG * SIMD_WIDTH;
  if (sg < NORM_SG) {  // uniform within a SIMD group
    for (uint k = tid; k < K; k += NORM_THREADS) {
      for (uint b = 0; b < BATCH; ++b) {
        if (b < batch_rows) {
          float v = static_cast<float>(x[b * x_strides[0] + k * x_strides[2]]);
          squares[b] = fma(v, v, squares[b]);
        }
      }
    }
    for (uint b = 0; b < BATCH; ++b) {
      float sum = simd_sum(squares[b]);
      if (lane == 0) {
        partial[b * NORM_SG + sg] = sum;
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid < BATCH) {
    float total = 0.0f;
    for (uint i = 0; i < NORM_SG; ++i) {
      total += partial[tid * NORM_SG + i];
    }
    row_inv_rms[tid] = metal::precise::rsqrt(total / float(K) + scalars[0]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
// -- this SIMD group's rows ---------------------------------------------------------
const uint block = threadgroup_position_in_grid.x * NSG + sg;
uint seg = 0;
for (uint s = 0; s + 1 < S; ++s) {
  if (block >= layout[s]) {
    seg = s + 1;
  }
}
const uint block_begin = seg == 0 ? 0u : layout[seg - 1];
const uint seg_rows = block < layout[S - 1] ? layout[4 + seg] : 0u;  // 0: past the last block
const uint row0 = (block - block_begin) * ROWS_PER_SIMDGROUP;
const uint bits = seg == 0 ? BITS0 : (seg == 1 ? BITS1 : (seg == 2 ? BITS2 : BITS3));
const uint4 no_words = {0u, 0u, 0u, 0u};
// A lane's values per step and steps, at this segment's bits.
const uint values = bits == 4 ? VALUES4 : VALUES8;
const uint steps = bits == 4 ? STEPS4 : STEPS8;
const uint words_per_row = bits == 4 ? WORDS4 : WORDS8;

float acc[BATCH][ROWS_PER_SIMDGROUP];
for (uint b = 0; b < BATCH; ++b) {
  for (uint r = 0; r < ROWS_PER_SIMDGROUP; ++r) {
    acc[b][r] = 0.0f;
  }
}

uint4 words[ROWS_PER_SIMDGROUP];
float scale[ROWS_PER_SIMDGROUP];
float bias[ROWS_PER_SIMDGROUP];
uint4 next_words[ROWS_PER_SIMDGROUP];
float next_scale[ROWS_PER_SIMDGROUP];
float next_bias[ROWS_PER_SIMDGROUP];
for (uint r = 0; r < ROWS_PER_SIMDGROUP; ++r) {
  next_words[r] = no_words;
  next_scale[r] = 0.0f;
  next_bias[r] = 0.0f;
}
// Each row's sum of xin over the lane's current unit (the bias term).
float xsum[BATCH];
const uint span = SIMD_WIDTH * values;  // a step: 32 lanes' values

// -- tile by tile: stage xin of all rows, then each lane's chunks in the tile -------
for (uint t = 0; t < TILES; ++t) {
  if (t > 0) {
    threadgroup_barrier(mem_flags::mem_threadgroup);  // every lane is done with tile t - 1
  }
  for (uint i = tid; i < ROW_VALUES; i += THREADS) {
    // Slot i of tile t holds value k of each row.
    const uint k = WHOLE ? i : (t / PARTS) * BLOCK + (PARTS == 1 ? i : (i / 16) * 32 + (t % PARTS) * 16 + (i & 15u));
    const uint at = (i & ~31u) | (((((i & 31u) >> 1) + (i >> 6)) & 15u) << 1) | (i & 1u);
    for (uint b = 0; b < BATCH; ++b) {
      if (b >= batch_rows || k >= K) {
        continue;
      }
      // xin[b][k]: x, normed (rounded as rms_norm rounds) or gated.
      float v = static_cast<float>(x[b * x_strides[0] + k * x_strides[2]]);
      if (PROLOGUE == 1) {
        float normed = static_cast<float>(static_cast<XT>(v * row_inv_rms[b]));
        v = normed * static_cast<float>(norm_weight[k * norm_weight_strides[0]]);
      } else if (PROLOGUE == 2) {
        const uint g = k / gate_d;
        const uint d = k - g * gate_d;
        float gx = static_cast<float>(gate[b * gate_strides[0] + g * gate_strides[2] + d * gate_strides[3]]);
        // sigmoid as MLX computes it in the gate's dtype (XT: x's, which the
        // gate shares; no norm here), rounded to it, then the product.
        float e = static_cast<float>(static_cast<XT>(metal::precise::exp(metal::abs(gx))));
        float sigmoid_neg = 1.0f / (1.0f + e);
        float sig = static_cast<float>(static_cast<XT>(gx < 0.0f ? sigmoid_neg : 1.0f - sigmoid_neg));
        v = v * sig;
      }
      xin[b * ROW_VALUES + at] = static_cast<XT>(v);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // The steps with a value in tile t (the last tile: every step left, whose
  // values past K are zeros). A lane's step s is its unit of `values` values
  // at k0; its chunks are multiplied in the tiles that hold them, in order,
  // and the unit's bias term after its last chunk.
  const uint s_begin = WHOLE ? 0u : (t / PARTS) * BLOCK / span;
  const uint s_block_end = ((t / PARTS + 1) * BLOCK + span - 1) / span;
  const uint s_end = (t + 1 == TILES || s_block_end > steps) ? steps : s_block_end;
  for (uint s = s_begin; s < s_end; ++s) {
    const uint k0 = s * span + lane * values;
    const bool active = k0 < K;
    // The tiles of the unit's first and last chunks (tile_of; values past
    // the last tile's: the last tile).
    const uint k_last = k0 + values - 8;
    uint first_tile = WHOLE ? 0u : (k0 / BLOCK) * PARTS + (k0 & 31u) / RUN;
    uint last_tile = WHOLE ? 0u : (k_last / BLOCK) * PARTS + (k_last & 31u) / RUN;
    first_tile = first_tile < TILES ? first_tile : TILES - 1;
    last_tile = last_tile < TILES ? last_tile : TILES - 1;
    if (first_tile == t) {
      // The unit's first chunk: its weights (fetched one unit ahead) and the
      // next unit's fetch (the first unit fetches its own first).
      for (uint f = s == 0 ? 0u : 1u; f < 2; ++f) {
        for (uint r = 0; r < ROWS_PER_SIMDGROUP; ++r) {
          words[r] = next_words[r];
          scale[r] = next_scale[r];
          bias[r] = next_bias[r];
        }
        const uint fetch_step = s + f;
        const uint k_next = fetch_step * span + lane * values;
        for (uint r = 0; r < ROWS_PER_SIMDGROUP; ++r) {
          const uint row = row0 + r;
          const uint wi = row * words_per_row + k_next / (32 / bits);
          const uint gi = row * GROUPS_PER_ROW + k_next / GROUP_SIZE;
          next_words[r] = no_words;
          next_scale[r] = 0.0f;
          next_bias[r] = 0.0f;
          if (fetch_step < steps && k_next < K && row < seg_rows) {
            if (seg == 0) {
              next_words[r] = *reinterpret_cast<const device uint4*>(w0 + wi);
              next_scale[r] = static_cast<float>(scales0[gi]);
              next_bias[r] = static_cast<float>(biases0[gi]);
            } else if (S > 1 && seg == 1) {
              next_words[r] = *reinterpret_cast<const device uint4*>(w1 + wi);
              next_scale[r] = static_cast<float>(scales1[gi]);
              next_bias[r] = static_cast<float>(biases1[gi]);
            } else if (S > 2 && seg == 2) {
              next_words[r] = *reinterpret_cast<const device uint4*>(w2 + wi);
              next_scale[r] = static_cast<float>(scales2[gi]);
              next_bias[r] = static_cast<float>(biases2[gi]);
            } else if (S > 3 && seg == 3) {
              next_words[r] = *reinterpret_cast<const device uint4*>(w3 + wi);
              next_scale[r] = static_cast<float>(scales3[gi]);
              next_bias[r] = static_cast<float>(biases3[gi]);
            }
          }
        }
      }
      for (uint b = 0; b < BATCH; ++b) {
        xsum[b] = 0.0f;
      }
    }
    // A step in chunks of 8 values: word c at 4 bits (4 chunks), words 2c
    // and 2c + 1 at 8 bits (2 chunks).
    for (uint c = 0; c < 4; ++c) {
      const uint kc = k0 + 8 * c;
      uint chunk_tile = WHOLE ? 0u : (kc / BLOCK) * PARTS + (kc & 31u) / RUN;
      chunk_tile = chunk_tile < TILES ? chunk_tile : TILES - 1;
      if (c < values / 8 && chunk_tile == t) {
        // Chunk c of each weight row, dequantized once for all BATCH rows of
        // x. 4 bits: values to floats without integer-to-float conversions (a
        // quarter-rate instruction on NVIDIA GPUs, slower than the memory at
        // 4 bits): nibble q under the bf16 pattern 0x4300 is the bf16 number
        // 128 + q, a word holds two such patterns (values m and m + 4 of its
        // eight), lily_tile_unpack turns them into floats, and subtracting
        // 128 is exact. 8 bits do not fit the pattern; at half the values
        // per byte the conversions keep up with the memory.
        float q[ROWS_PER_SIMDGROUP][8];
        for (uint r = 0; r < ROWS_PER_SIMDGROUP; ++r) {
          // Words selected, not indexed: a loop the compiler does not unroll
          // would index a local array in (slow) local memory.
          if (bits == 4) {
            const uint w = c == 0 ? words[r].x : (c == 1 ? words[r].y : (c == 2 ? words[r].z : words[r].w));
            const uint4 pairs = {(w & 0x000F000Fu) | 0x43004300u, ((w >> 4) & 0x000F000Fu) | 0x43004300u,
                                 ((w >> 8) & 0x000F000Fu) | 0x43004300u, ((w >> 12) & 0x000F000Fu) | 0x43004300u};
            for (uint m = 0; m < 4; ++m) {
              q[r][m] = lily_tile_unpack(pairs, 2 * m) - 128.0f;
              q[r][m + 4] = lily_tile_unpack(pairs, 2 * m + 1) - 128.0f;
            }
          } else {
            const uint first = c == 0 ? words[r].x : words[r].z;
            const uint second = c == 0 ? words[r].y : words[r].w;
            for (uint i = 0; i < 4; ++i) {
              q[r][i] = static_cast<float>((first >> (8 * i)) & 0xFFu);
              q[r][4 + i] = static_cast<float>((second >> (8 * i)) & 0xFFu);
            }
          }
        }
        // The chunk's values' places in the tile's rows.
        uint at[8];
        for (uint i = 0; i < 8; ++i) {
          const uint k = kc + i;
          const uint slot = WHOLE ? k : (PARTS == 1 ? k % BLOCK : (k % BLOCK) / 32 * 16 + (k & 15u));
          at[i] = (slot & ~31u) | (((((slot & 31u) >> 1) + (slot >> 6)) & 15u) << 1) | (slot & 1u);
        }
        for (uint b = 0; b < BATCH; ++b) {
          // Row b's xin at this chunk's values (zeros past B and past K:
          // nothing read).
          float xv[8];
          for (uint i = 0; i < 8; ++i) {
            xv[i] = 0.0f;
            if (active && b < batch_rows) {
              xv[i] = static_cast<float>(xin[b * ROW_VALUES + at[i]]);
            }
            xsum[b] += xv[i];
          }
          for (uint r = 0; r < ROWS_PER_SIMDGROUP; ++r) {
            float dot = 0.0f;
            for (uint i = 0; i < 8; ++i) {
              dot = fma(q[r][i], xv[i], dot);
            }
            acc[b][r] = fma(scale[r], dot, acc[b][r]);
          }
        }
      }
    }
    if (last_tile == t) {
      // The unit's last chunk done: its bias term.
      for (uint b = 0; b < BATCH; ++b) {
        for (uint r = 0; r < ROWS_PER_SIMDGROUP; ++r) {
          acc[b][r] = fma(bias[r], xsum[b], acc[b][r]);
        }
      }
    }
  }
}

// -- finish each row: the matmul's rounding, then the residual's -------------------
for (uint b = 0; b < BATCH; ++b) {
  if (b >= batch_rows) {
    continue;
  }
  for (uint r = 0; r < ROWS_PER_SIMDGROUP; ++r) {
    float total = simd_sum(acc[b][r]);
    const uint row = row0 + r;
    if (lane == r && row < seg_rows) {
      float y = static_cast<float>(static_cast<XT>(total));
      if (RESIDUAL) {
        y = static_cast<float>(residual[b * residual_strides[0] + row * residual_strides[2]]) + y;
      }
      const uint at = b * seg_rows + row;
      if (seg == 0) {
        out0[at] = static_cast<OutT>(y);
      } else if (S > 1 && seg == 1) {
        out1[at] = static_cast<OutT>(y);
      } else if (S > 2 && seg == 2) {
        out2[at] = static_cast<OutT>(y);
      } else if (S > 3 && seg == 3) {
        out3[at] = static_cast<OutT>(y);
      }
    }
  }
}
