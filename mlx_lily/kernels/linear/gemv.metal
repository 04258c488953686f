// Row-parallel quantized matrix-vector product for decode (one token), with
// the input's prologue and the residual epilogue fused, for up to four
// projections that read the same input in one dispatch:
//
//   xin   = x                                      (PROLOGUE 0)
//         | rms_norm(x, norm_weight, eps)          (PROLOGUE 1)
//         | x * sigmoid(gate)                      (PROLOGUE 2)
//   out_s = xin . W_s^T       for each segment s (W_s = scales * q + biases)
//   out_0 = residual + out_0  (RESIDUAL, one segment only)
//
// Launcher: mlx_lily/kernels/gemv.py. Each threadgroup first computes xin
// into threadgroup memory (the norm's sum of squares once per threadgroup),
// rounded to XT as MLX's ops round it. Each SIMD group then takes one block
// of ROWS_PER_SIMDGROUP consecutive rows of one segment (segments are padded
// to whole blocks, so a block never straddles two of them) and its lanes split
// K: per step a lane loads 16 bytes of each row (32 values at 4 bits, 16 at 8
// bits, always inside one quantization group), so a SIMD group reads 512
// contiguous bytes of a row per load instruction. A lane accumulates in fp32
// scale * sum(q * xin) + bias * sum(xin) over its values; simd_sum finishes
// each row.
//
// Rounding: xin is rounded where MLX's ops round it (rms_norm: x * inv_rms
// rounded to XT, times the weight rounded to XT; gate: sigmoid rounded to XT,
// the product rounded to XT); each row is rounded once to XT (the matmul's
// output) and, with RESIDUAL, residual + that rounded to OutT. Sums are fp32,
// in another order than MLX's.
//
// Template: XT (the matmul's input and output dtype: x's, bfloat16 or float16,
//           promoted with the norm weight's as rms_norm promotes it), OutT (the output's dtype), K (a multiple of
//           64), S (segments, 1..4), BITS0..BITS3 (4 or 8; 0 past S), NSG (SIMD
//           groups per threadgroup), ROWS (rows per SIMD group), PROLOGUE (0,
//           1, 2), RESIDUAL (bool).
// Inputs:   x [1, 1, K] bf16 or fp16 (strided); w<s> [N_s, K * BITS<s> / 32] uint32
//           (row-contiguous; value j of a word in bits BITS*j ...), scales<s>,
//           biases<s> [N_s, K / 64] x's dtype (row-contiguous); norm_weight [K]
//           (strided); gate [1, 1, G, D] x's dtype with G * D = K (strided);
//           residual [1, 1, N_0] x's dtype (strided); layout uint32 [8]: each
//           segment's end in row blocks (4), rows (4);
//           scalars fp32 [1]: eps. An unused norm_weight, gate or residual
//           is a small dummy; the arrays of segments past S are not passed
//           (the launcher declares them as segment 0's, never read).
// Outputs:  out0..out3, segment s's N_s values in out<s> (one output per
//           segment, so each projection is an array of its own, no view of a
//           shared one; none past S).
// Grid:     (threadgroups * NSG * 32, 1, 1), threadgroup (NSG * 32, 1, 1).

// Rows per SIMD group (ROWS): each lane keeps this many 16-byte loads in
// flight per step and reuses its xin values (read once from threadgroup
// memory) for all of them (up to 4 without spilling registers; the launcher
// picks 1, 2 or 4 by the call's rows, gemv.py's launch_choice).
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

// xin, held as XT. Element k sits at swizzled(k): within each run of 32
// values, pairs are rotated by (k / 64) % 16, so that the 32 lanes reading
// "value i of their own 32 (or 16)" touch 32 different banks.
threadgroup XT xin[K];
threadgroup float partial[NSG];

const uint tid = thread_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;

// -- prologue: xin into threadgroup memory --------------------------------------
float inv_rms = 1.0f;
if (PROLOGUE == 1) {
  float squares = 0.0f;
  for (uint k = tid; k < K; k += THREADS) {
    float v = static_cast<float>(x[k * x_strides[2]]);
    squares += v * v;
  }
  squares = simd_sum(squares);
  if (lane == 0) {
    partial[sg] = squares;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float total = 0.0f;
  for (uint i = 0; i < NSG; ++i) {
    total += partial[i];
  }
  inv_rms = metal::precise::rsqrt(total / float(K) + scalars[0]);
}
for (uint k = tid; k < K; k += THREADS) {
  float v = static_cast<float>(x[k * x_strides[2]]);
  if (PROLOGUE == 1) {
    float normed = static_cast<float>(static_cast<XT>(v * inv_rms));
    v = normed * static_cast<float>(norm_weight[k * norm_weight_strides[0]]);
  } else if (PROLOGUE == 2) {
    uint d_size = uint(gate_shape[3]);
    uint g = k / d_size;
    uint d = k - g * d_size;
    float gx = static_cast<float>(gate[g * gate_strides[2] + d * gate_strides[3]]);
    // sigmoid as MLX computes it in the gate's dtype (XT: x's, which the
    // gate shares; no norm here), rounded to it, then the product.
    float e = static_cast<float>(static_cast<XT>(metal::precise::exp(metal::abs(gx))));
    float sigmoid_neg = 1.0f / (1.0f + e);
    float sig = static_cast<float>(static_cast<XT>(gx < 0.0f ? sigmoid_neg : 1.0f - sigmoid_neg));
    v = v * sig;
  }
  uint at = (k & ~31u) | (((((k & 31u) >> 1) + (k >> 6)) & 15u) << 1) | (k & 1u);
  xin[at] = static_cast<XT>(v);
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// -- this SIMD group's rows ---------------------------------------------------------
// layout: block ends [0..3], rows [4..7].
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

float acc[ROWS_PER_SIMDGROUP];
for (uint r = 0; r < ROWS_PER_SIMDGROUP; ++r) {
  acc[r] = 0.0f;
}

if (bits == 4) {
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
  // Pass t fetches step t's weights and multiplies step t - 1's, fetched by
  // the pass before: a lane has two steps' loads in flight.
  for (uint step = 0; step <= STEPS4; ++step) {
    for (uint r = 0; r < ROWS_PER_SIMDGROUP; ++r) {
      words[r] = next_words[r];
      scale[r] = next_scale[r];
      bias[r] = next_bias[r];
    }
    const uint k_next = step * SIMD_WIDTH * VALUES4 + lane * VALUES4;
    for (uint r = 0; r < ROWS_PER_SIMDGROUP; ++r) {
      const uint row = row0 + r;
      const uint wi = row * WORDS4 + k_next / (32 / 4);
      const uint gi = row * GROUPS_PER_ROW + k_next / GROUP_SIZE;
      next_words[r] = no_words;
      next_scale[r] = 0.0f;
      next_bias[r] = 0.0f;
      if (step < STEPS4 && k_next < K && row < seg_rows) {
        if (BITS0 == 4 && seg == 0) {
          next_words[r] = *reinterpret_cast<const device uint4*>(w0 + wi);
          next_scale[r] = static_cast<float>(scales0[gi]);
          next_bias[r] = static_cast<float>(biases0[gi]);
        } else if (S > 1 && BITS1 == 4 && seg == 1) {
          next_words[r] = *reinterpret_cast<const device uint4*>(w1 + wi);
          next_scale[r] = static_cast<float>(scales1[gi]);
          next_bias[r] = static_cast<float>(biases1[gi]);
        } else if (S > 2 && BITS2 == 4 && seg == 2) {
          next_words[r] = *reinterpret_cast<const device uint4*>(w2 + wi);
          next_scale[r] = static_cast<float>(scales2[gi]);
          next_bias[r] = static_cast<float>(biases2[gi]);
        } else if (S > 3 && BITS3 == 4 && seg == 3) {
          next_words[r] = *reinterpret_cast<const device uint4*>(w3 + wi);
          next_scale[r] = static_cast<float>(scales3[gi]);
          next_bias[r] = static_cast<float>(biases3[gi]);
        }
      }
    }
    if (step > 0) {
      const uint k0 = k_next - SIMD_WIDTH * VALUES4;
      const bool active = k0 < K;
      // This lane's VALUES4 values (swizzled as written) and their sum.
      float xv[VALUES4];
      float xsum = 0.0f;
      for (uint i = 0; i < VALUES4; ++i) {
        const uint k = k0 + i;
        const uint at = (k & ~31u) | (((((k & 31u) >> 1) + (k >> 6)) & 15u) << 1) | (k & 1u);
        xv[i] = active ? static_cast<float>(xin[at]) : 0.0f;
        xsum += xv[i];
      }
      // Values to floats without integer-to-float conversions (a quarter-rate
      // instruction on NVIDIA GPUs, slower than the memory at 4 bits): nibble q
      // under the bf16 pattern 0x4300 is the bf16 number 128 + q, a word holds
      // two such patterns (values m and m + 4 of its eight), lily_tile_unpack
      // turns them into floats, and subtracting 128 is exact.
      for (uint r = 0; r < ROWS_PER_SIMDGROUP; ++r) {
        const uint w[4] = {words[r].x, words[r].y, words[r].z, words[r].w};
        float dot = 0.0f;
        for (uint j = 0; j < 4; ++j) {
          const uint4 pairs = {(w[j] & 0x000F000Fu) | 0x43004300u, ((w[j] >> 4) & 0x000F000Fu) | 0x43004300u,
                               ((w[j] >> 8) & 0x000F000Fu) | 0x43004300u, ((w[j] >> 12) & 0x000F000Fu) | 0x43004300u};
          for (uint m = 0; m < 4; ++m) {
            dot += (lily_tile_unpack(pairs, 2 * m) - 128.0f) * xv[8 * j + m];
            dot += (lily_tile_unpack(pairs, 2 * m + 1) - 128.0f) * xv[8 * j + m + 4];
          }
        }
        acc[r] += scale[r] * dot + bias[r] * xsum;
      }
    }
  }
} else {
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
  // Pass t fetches step t's weights and multiplies step t - 1's, fetched by
  // the pass before: a lane has two steps' loads in flight.
  for (uint step = 0; step <= STEPS8; ++step) {
    for (uint r = 0; r < ROWS_PER_SIMDGROUP; ++r) {
      words[r] = next_words[r];
      scale[r] = next_scale[r];
      bias[r] = next_bias[r];
    }
    const uint k_next = step * SIMD_WIDTH * VALUES8 + lane * VALUES8;
    for (uint r = 0; r < ROWS_PER_SIMDGROUP; ++r) {
      const uint row = row0 + r;
      const uint wi = row * WORDS8 + k_next / (32 / 8);
      const uint gi = row * GROUPS_PER_ROW + k_next / GROUP_SIZE;
      next_words[r] = no_words;
      next_scale[r] = 0.0f;
      next_bias[r] = 0.0f;
      if (step < STEPS8 && k_next < K && row < seg_rows) {
        if (BITS0 == 8 && seg == 0) {
          next_words[r] = *reinterpret_cast<const device uint4*>(w0 + wi);
          next_scale[r] = static_cast<float>(scales0[gi]);
          next_bias[r] = static_cast<float>(biases0[gi]);
        } else if (S > 1 && BITS1 == 8 && seg == 1) {
          next_words[r] = *reinterpret_cast<const device uint4*>(w1 + wi);
          next_scale[r] = static_cast<float>(scales1[gi]);
          next_bias[r] = static_cast<float>(biases1[gi]);
        } else if (S > 2 && BITS2 == 8 && seg == 2) {
          next_words[r] = *reinterpret_cast<const device uint4*>(w2 + wi);
          next_scale[r] = static_cast<float>(scales2[gi]);
          next_bias[r] = static_cast<float>(biases2[gi]);
        } else if (S > 3 && BITS3 == 8 && seg == 3) {
          next_words[r] = *reinterpret_cast<const device uint4*>(w3 + wi);
          next_scale[r] = static_cast<float>(scales3[gi]);
          next_bias[r] = static_cast<float>(biases3[gi]);
        }
      }
    }
    if (step > 0) {
      const uint k0 = k_next - SIMD_WIDTH * VALUES8;
      const bool active = k0 < K;
      // This lane's VALUES8 values (swizzled as written) and their sum.
      float xv[VALUES8];
      float xsum = 0.0f;
      for (uint i = 0; i < VALUES8; ++i) {
        const uint k = k0 + i;
        const uint at = (k & ~31u) | (((((k & 31u) >> 1) + (k >> 6)) & 15u) << 1) | (k & 1u);
        xv[i] = active ? static_cast<float>(xin[at]) : 0.0f;
        xsum += xv[i];
      }
      // 8 bits do not fit the bf16 pattern; at half the values per byte the
      // conversions keep up with the memory.
      for (uint r = 0; r < ROWS_PER_SIMDGROUP; ++r) {
        const uint w[4] = {words[r].x, words[r].y, words[r].z, words[r].w};
        float dot = 0.0f;
        for (uint j = 0; j < 4; ++j) {
          for (uint i = 0; i < 4; ++i) {
            dot += static_cast<float>((w[j] >> (8 * i)) & 0xFFu) * xv[4 * j + i];
          }
        }
        acc[r] += scale[r] * dot + bias[r] * xsum;
      }
    }
  }
}

// -- finish each row: the matmul's rounding, then the residual's -------------------
for (uint r = 0; r < ROWS_PER_SIMDGROUP; ++r) {
  float total = simd_sum(acc[r]);
  const uint row = row0 + r;
  if (lane == r && row < seg_rows) {
    float y = static_cast<float>(static_cast<XT>(total));
    if (RESIDUAL) {
      y = static_cast<float>(residual[row * residual_strides[2]]) + y;
    }
    if (seg == 0) {
      out0[row] = static_cast<OutT>(y);
    } else if (S > 1 && seg == 1) {
      out1[row] = static_cast<OutT>(y);
    } else if (S > 2 && seg == 2) {
      out2[row] = static_cast<OutT>(y);
    } else if (S > 3 && seg == 3) {
      out3[row] = static_cast<OutT>(y);
    }
  }
}
