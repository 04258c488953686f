// The decode GEMV on matrix tiles: quantized_matvec's contract (gemv.metal:
// up to four 4-bit or 8-bit projections of one input, its RMSNorm or
// output-gate prologue, the residual epilogue) for B <= 16 rows of x, each
// weight tile read once for all rows and multiplied with x as the 16-row
// operand of lily_tile_mma. Launcher: mlx_lily/kernels/linear/gemv_tiles.py.
//
// A threadgroup owns TPG consecutive output tiles of 16 weight rows each and
// its NSG SIMD groups split K: SIMD group j takes the quantization groups
// [j * SLICE, (j + 1) * SLICE), on its own (no threadgroup barrier after the
// norm). Per group a SIMD group stages xin (the prologue's output, rounded to
// bf16 as gemv.metal rounds it) of its 64 values for the B rows, once for its
// TPG tiles, then per tile unpacks its 16 x 64 weights to bf16 integers q
// (exact: q < 16, or q < 256 at 8 bits; weights and x fetched a group ahead:
// 16 or 32 weight bytes a tile and two x values per row a lane) and
// multiplies: t = xin . q and xsum = xin . ones over the group (16 x 16 x 16
// products, fp32; xsum once for every tile), then acc = fma(scale, t, acc),
// acc = fma(bias, xsum, acc): the weights enter unrounded, as
// W = scale * q + bias does. (The sums on the matrix units, not one simd_sum
// per row: at 16 rows those shuffles and the row-by-row loads they
// serialised set the kernel's time. Several tiles a threadgroup: at 16 rows
// staging xin costs about what unpacking a tile does, and a lane keeps more
// weight loads in flight.)
// The SIMD groups' accumulators are summed in order j = 0..NSG-1, rounded to
// XT, then the residual is added.
//
// Batch invariance: output row m depends on x's row m alone (the tile
// product keeps rows apart), every sum runs in an order fixed by K and NSG
// (the launcher's choice per call shape, never B; TPG changes which
// threadgroup computes a tile, not a sum's order), and rows past B are
// zeros, staged once. So a row's bits are the same for every B, B = 1
// included.
//
// Template: XT (bfloat16_t: x's dtype, the norm weight's too), OutT (the
//           output's dtype), K (a multiple of 64), S (segments, 1..4), BITS
//           (4 or 8, every segment's), SBT (the scales' and biases' dtype where
//           every segment's share one, else float), NSG (SIMD groups per threadgroup: the
//           K split), TPG (output tiles per threadgroup), PROLOGUE (0 none,
//           1 RMSNorm, 2 sigmoid gate), RESIDUAL (bool), BATCH (B's bucket:
//           1, 2, 4, 8 or 16; sizes the loops over rows).
// Inputs:   as gemv.metal (x, w<s>, scales<s>, biases<s>, norm_weight, gate,
//           residual, scalars); layout uint32 [9]: each segment's end in
//           16-row tiles (4), rows (4), B (1).
// Outputs:  out0..out3 [B, 1, N_s].
// Grid:     (ceil(tiles / TPG) * NSG * 32, 1, 1), threadgroup (NSG * 32, 1, 1).

constexpr uint SIMD_WIDTH = 32;
constexpr uint THREADS = NSG * SIMD_WIDTH;
constexpr uint TILE_ROWS = 16;
constexpr uint GROUP = 64;
constexpr uint GROUPS = K / GROUP;
constexpr uint SLICE = (GROUPS + NSG - 1) / NSG;  // groups per SIMD group
constexpr uint WORDS = K * BITS / 32;             // uint32 words of a weight row
constexpr uint GROUP_WORDS = GROUP * BITS / 32;   // words of a row's group: 8 or 16
constexpr uint LANE_VECS = BITS / 4;              // 16-byte words a lane loads per tile and group
constexpr uint PAD = 8;                           // keeps rows 16-byte aligned, spreads banks
constexpr uint XLD = NSG * GROUP + PAD;           // staged xin row stride (bf16 values)
constexpr uint QLD = GROUP + PAD;                 // staged q row stride

threadgroup bfloat16_t xin[TILE_ROWS * XLD];         // rows past B stay zero
threadgroup bfloat16_t ones[TILE_ROWS * TILE_ROWS];
threadgroup bfloat16_t qs[NSG * TILE_ROWS * QLD];
threadgroup float partial[NSG * TILE_ROWS * TILE_ROWS];
threadgroup float norm_part[BATCH * NSG];
threadgroup float row_inv_rms[BATCH];

const uint tid = thread_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint batch_rows = layout[8];
const uint gate_d = uint(gate_shape[3]);

for (uint i = tid; i < TILE_ROWS * XLD; i += THREADS) {
  xin[i] = static_cast<bfloat16_t>(0.0f);
}
for (uint i = tid; i < TILE_ROWS * TILE_ROWS; i += THREADS) {
  ones[i] = static_cast<bfloat16_t>(1.0f);
}

// -- each row's norm: sum of squares by every thread, in an order of K and NSG --
if (PROLOGUE == 1) {
  float squares[BATCH];
  for (uint b = 0; b < BATCH; ++b) {
    squares[b] = 0.0f;
  }
  // A fixed trip count (not k < K from tid): the loop unrolls and its loads
  // are all issued before the sums wait on them (at 16 rows, 128 a thread).
  for (uint j = 0; j < (K + THREADS - 1) / THREADS; ++j) {
    const uint k = tid + j * THREADS;
    for (uint b = 0; b < BATCH; ++b) {
      if (b < batch_rows && k < K) {
        float v = static_cast<float>(x[b * x_strides[0] + k * x_strides[2]]);
        squares[b] = fma(v, v, squares[b]);
      }
    }
  }
  for (uint b = 0; b < BATCH; ++b) {
    float sum = simd_sum(squares[b]);
    if (lane == 0) {
      norm_part[b * NSG + sg] = sum;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (tid < BATCH) {
    float total = 0.0f;
    for (uint i = 0; i < NSG; ++i) {
      total += norm_part[tid * NSG + i];
    }
    row_inv_rms[tid] = metal::precise::rsqrt(total / float(K) + scalars[0]);
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// -- this threadgroup's tiles: TPG consecutive output tiles ------------------------
// Each tile's segment, first row, and the weight row this lane loads (16 or 32
// bytes of row row0 + lane / 2: half lane % 2 of a group's 64 values).
uint tile_seg[TPG];
uint tile_row0[TPG];
uint tile_rows[TPG];
bool tile_in[TPG];
const uint tiles_total = layout[S - 1];
LILY_UNROLL for (uint t = 0; t < TPG; ++t) {
  const uint tile = threadgroup_position_in_grid.x * TPG + t;
  uint seg = 0;
  for (uint s = 0; s + 1 < S; ++s) {
    if (tile >= layout[s]) {
      seg = s + 1;
    }
  }
  tile_seg[t] = seg;
  tile_rows[t] = layout[4 + seg];
  tile_row0[t] = (tile - (seg == 0 ? 0u : layout[seg - 1])) * TILE_ROWS;
  tile_in[t] = tile < tiles_total && tile_row0[t] + lane / 2 < tile_rows[t];
}
const uint4 no_words = {0u, 0u, 0u, 0u};

lily_tile_acc acc[TPG];
LILY_UNROLL for (uint t = 0; t < TPG; ++t) {
  lily_tile_acc_zero(acc[t]);
}

// A B operand of ones (staged before the norm's barrier): xin times it is
// each row's sum over the group, in every column, which the bias multiplies.
lily_tile_b ones_b;
lily_tile_load_b(ones_b, ones, int(TILE_ROWS), lane);

// This SIMD group's slice of K, a quantization group at a time; the SIMD
// groups run their slices independently (each stages its own xin and q).
// Pass g fetches group g's inputs and multiplies group g - 1's, fetched a
// pass earlier: per tile LANE_VECS 16-byte words of this lane's weight row
// (row tile_row0 + lane / 2) and the row's scale (even lanes) or bias (odd
// ones); per row of x its values lane and lane + 32 of the group; the
// prologue's norm weight or gate values for those columns. Every load of a
// pass is issued before any of them is used: the loads carry no branch
// (rows past B read row 0 and the pass past the slice group 0, values never
// used), the weights are moved as loaded, the scales and biases kept in
// their own dtype (SBT) until the pass ends, and x and the gate are packed to
// bf16 pairs only after all of their loads are out. (A load consumed in its
// own branch, one per row, made the pass wait for each row's load in turn:
// at 16 rows that, not the weights, set the kernel's time; H200, DeltaNet's
// output projection at 16 rows: 13.8 us against 32.9,
// bench/results/2026-12-04-nvidia-h200-efe1204.)
// xin is staged once a pass for all TPG tiles (at 16 rows staging it costs
// about what unpacking a tile's weights does).
const uint g_begin = sg * SLICE;
const uint g_end = g_begin + SLICE < GROUPS ? g_begin + SLICE : GROUPS;
const uint q0 = sg * TILE_ROWS * QLD;  // this SIMD group's rows of qs
uint4 words[TPG * LANE_VECS];
float scale_or_bias[TPG];
LILY_UNROLL for (uint t = 0; t < TPG; ++t) {
  for (uint v = 0; v < LANE_VECS; ++v) {
    words[t * LANE_VECS + v] = no_words;
  }
  scale_or_bias[t] = 0.0f;
}
uint xv[BATCH];         // per row, x's two values of this lane as bf16 bits (exact: x is bf16)
uint gate_bits[BATCH];  // per row, the gate's two values as bf16 bits (the gate has x's dtype)
float norm_w[2];        // the norm weight at this lane's two columns
for (uint b = 0; b < BATCH; ++b) {
  xv[b] = 0u;
  gate_bits[b] = 0u;
}
norm_w[0] = 1.0f;
norm_w[1] = 1.0f;
for (uint g = g_begin; g <= g_end; ++g) {
  const bool fetching = g < g_end;
  uint4 fetched[TPG * LANE_VECS];
  SBT fetched_sb[TPG];
  LILY_UNROLL for (uint t = 0; t < TPG; ++t) {
    for (uint v = 0; v < LANE_VECS; ++v) {
      fetched[t * LANE_VECS + v] = no_words;
    }
    fetched_sb[t] = static_cast<SBT>(0.0f);
    if (tile_in[t] && fetching) {
      const uint my_row = tile_row0[t] + lane / 2;
      const uint wi = my_row * WORDS + g * GROUP_WORDS + (lane % 2) * (GROUP_WORDS / 2);
      const uint gi = my_row * GROUPS + g;
      const uint seg = tile_seg[t];
      for (uint v = 0; v < LANE_VECS; ++v) {
        if (seg == 0) {
          fetched[t * LANE_VECS + v] = *reinterpret_cast<const device uint4*>(w0 + wi + 4 * v);
        } else if (S > 1 && seg == 1) {
          fetched[t * LANE_VECS + v] = *reinterpret_cast<const device uint4*>(w1 + wi + 4 * v);
        } else if (S > 2 && seg == 2) {
          fetched[t * LANE_VECS + v] = *reinterpret_cast<const device uint4*>(w2 + wi + 4 * v);
        } else if (S > 3 && seg == 3) {
          fetched[t * LANE_VECS + v] = *reinterpret_cast<const device uint4*>(w3 + wi + 4 * v);
        }
      }
      if (seg == 0) {
        fetched_sb[t] = static_cast<SBT>(lane % 2 == 0 ? scales0[gi] : biases0[gi]);
      } else if (S > 1 && seg == 1) {
        fetched_sb[t] = static_cast<SBT>(lane % 2 == 0 ? scales1[gi] : biases1[gi]);
      } else if (S > 2 && seg == 2) {
        fetched_sb[t] = static_cast<SBT>(lane % 2 == 0 ? scales2[gi] : biases2[gi]);
      } else if (S > 3 && seg == 3) {
        fetched_sb[t] = static_cast<SBT>(lane % 2 == 0 ? scales3[gi] : biases3[gi]);
      }
    }
  }
  // Columns k and k + 32 of the group fetched (group 0 in the pass past the
  // slice): every row's loads, then their packing.
  const uint k_lo = (fetching ? g : 0u) * GROUP + lane;
  uint gate_at[2];
  for (uint h = 0; h < 2; ++h) {
    gate_at[h] = 0u;
    if (PROLOGUE == 2) {
      const uint k = k_lo + h * SIMD_WIDTH;
      const uint gh = k / gate_d;
      gate_at[h] = gh * uint(gate_strides[2]) + (k - gh * gate_d) * uint(gate_strides[3]);
    }
  }
  XT x_loaded[2 * BATCH];
  XT gate_loaded[2 * BATCH];
  for (uint b = 0; b < BATCH; ++b) {
    const uint row = b < batch_rows ? b : 0u;
    const uint x_at = row * x_strides[0];
    x_loaded[2 * b] = x[x_at + k_lo * x_strides[2]];
    x_loaded[2 * b + 1] = x[x_at + (k_lo + SIMD_WIDTH) * x_strides[2]];
    if (PROLOGUE == 2) {
      const uint gate_row_at = row * uint(gate_strides[0]);
      gate_loaded[2 * b] = gate[gate_row_at + gate_at[0]];
      gate_loaded[2 * b + 1] = gate[gate_row_at + gate_at[1]];
    }
  }
  uint fetched_x[BATCH];
  uint fetched_gate[BATCH];
  for (uint b = 0; b < BATCH; ++b) {
    fetched_x[b] = lily_tile_pack2(static_cast<float>(x_loaded[2 * b]), static_cast<float>(x_loaded[2 * b + 1]));
    fetched_gate[b] = 0u;
    if (PROLOGUE == 2) {
      fetched_gate[b] = lily_tile_pack2(static_cast<float>(gate_loaded[2 * b]),
                                        static_cast<float>(gate_loaded[2 * b + 1]));
    }
  }
  XT norm_loaded[2];
  if (PROLOGUE == 1) {
    for (uint h = 0; h < 2; ++h) {
      norm_loaded[h] = norm_weight[(k_lo + h * SIMD_WIDTH) * norm_weight_strides[0]];
    }
  }
  float fetched_norm_w[2];
  for (uint h = 0; h < 2; ++h) {
    fetched_norm_w[h] = PROLOGUE == 1 ? static_cast<float>(norm_loaded[h]) : 1.0f;
  }
  if (g > g_begin) {
    // xin of group g - 1 for rows < B (lanes take values lane and lane + 32).
    for (uint b = 0; b < BATCH; ++b) {
      if (b >= batch_rows) {
        continue;  // uniform; rows past B stay zero
      }
      for (uint h = 0; h < 2; ++h) {
        const uint4 pair = {xv[b], 0u, 0u, 0u};
        float value = lily_tile_unpack(pair, int(h));
        if (PROLOGUE == 1) {
          float normed = static_cast<float>(static_cast<XT>(value * row_inv_rms[b]));
          value = normed * norm_w[h];
        } else if (PROLOGUE == 2) {
          // sigmoid as MLX computes it in the gate's dtype, rounded to it, then the product.
          const uint4 gate_pair = {gate_bits[b], 0u, 0u, 0u};
          const float gx = lily_tile_unpack(gate_pair, int(h));
          float e = static_cast<float>(static_cast<XT>(metal::precise::exp(metal::abs(gx))));
          float sigmoid_neg = 1.0f / (1.0f + e);
          float s = static_cast<float>(static_cast<XT>(gx < 0.0f ? sigmoid_neg : 1.0f - sigmoid_neg));
          value = value * s;
        }
        xin[b * XLD + sg * GROUP + lane + h * SIMD_WIDTH] = static_cast<bfloat16_t>(value);
      }
    }
    simdgroup_barrier(mem_flags::mem_threadgroup);

    // xin as the A operand of the group's four 16-wide k steps, and each
    // row's sum of xin over the group (xin . ones): the same for every tile.
    lily_tile_a a[GROUP / TILE_ROWS];
    lily_tile_acc xsum;
    lily_tile_acc_zero(xsum);
    for (uint kk = 0; kk < GROUP / TILE_ROWS; ++kk) {
      lily_tile_load_a(a[kk], xin + sg * GROUP + kk * TILE_ROWS, int(XLD), lane);
      lily_tile_mma(xsum, a[kk], ones_b);
    }
    LILY_UNROLL for (uint t = 0; t < TPG; ++t) {
      // This tile's 16 x 64 weights as bf16 integers q in this SIMD group's rows of qs.
      for (uint c = 0; c < 4; ++c) {
        float v[8];
        if (BITS == 4) {
          // Word c holds values 8c..8c+7 of this lane's 32; nibble q under the
          // bf16 pattern 0x4300 is 128 + q (exact), unpacked less 128: q, exact.
          const uint4 lo = words[t * LANE_VECS];
          const uint w = c == 0 ? lo.x : (c == 1 ? lo.y : (c == 2 ? lo.z : lo.w));
          const uint4 pairs = {(w & 0x000F000Fu) | 0x43004300u, ((w >> 4) & 0x000F000Fu) | 0x43004300u,
                               ((w >> 8) & 0x000F000Fu) | 0x43004300u, ((w >> 12) & 0x000F000Fu) | 0x43004300u};
          for (uint m = 0; m < 4; ++m) {
            v[m] = lily_tile_unpack(pairs, 2 * m) - 128.0f;
            v[m + 4] = lily_tile_unpack(pairs, 2 * m + 1) - 128.0f;
          }
        } else {
          // Words 2c and 2c + 1 hold values 8c..8c+7, a byte each: q < 256
          // has 8 significant bits, exact in bf16.
          const uint4 vec = words[t * LANE_VECS + c / 2];
          const uint w_lo = c % 2 == 0 ? vec.x : vec.z;
          const uint w_hi = c % 2 == 0 ? vec.y : vec.w;
          for (uint m = 0; m < 4; ++m) {
            v[m] = float((w_lo >> (8 * m)) & 0xFFu);
            v[m + 4] = float((w_hi >> (8 * m)) & 0xFFu);
          }
        }
        const uint4 packed = {lily_tile_pack2(v[0], v[1]), lily_tile_pack2(v[2], v[3]),
                              lily_tile_pack2(v[4], v[5]), lily_tile_pack2(v[6], v[7])};
        lily_tile_store16(qs + q0 + (lane / 2) * QLD + (lane % 2) * 32 + 8 * c, packed);
      }
      simdgroup_barrier(mem_flags::mem_threadgroup);

      // t = xin . q over the group.
      lily_tile_acc prod;
      lily_tile_acc_zero(prod);
      for (uint kk = 0; kk < GROUP / TILE_ROWS; ++kk) {
        lily_tile_b wb;
        lily_tile_load_b(wb, qs + q0 + kk * TILE_ROWS, int(QLD), lane);
        lily_tile_mma(prod, a[kk], wb);
      }
      // acc += scale * t + bias * sum(xin): the scale of weight row n from
      // lane 2n, its bias from lane 2n + 1.
      for (int e = 0; e < LILY_TILE_ACC_ELEMS; ++e) {
        const int n = lily_tile_acc_col(e, lane);
        const float scale = simd_shuffle(scale_or_bias[t], uint(2 * n));
        const float bias = simd_shuffle(scale_or_bias[t], uint(2 * n + 1));
        float value = fma(scale, lily_tile_acc_get(prod, e), lily_tile_acc_get(acc[t], e));
        value = fma(bias, lily_tile_acc_get(xsum, e), value);
        lily_tile_acc_set(acc[t], e, value);
      }
      simdgroup_barrier(mem_flags::mem_threadgroup);  // qs is rewritten next
    }
  }
  LILY_UNROLL for (uint t = 0; t < TPG; ++t) {
    for (uint v = 0; v < LANE_VECS; ++v) {
      words[t * LANE_VECS + v] = fetched[t * LANE_VECS + v];
    }
    scale_or_bias[t] = static_cast<float>(fetched_sb[t]);
  }
  for (uint b = 0; b < BATCH; ++b) {
    xv[b] = fetched_x[b];
    gate_bits[b] = fetched_gate[b];
  }
  for (uint h = 0; h < 2; ++h) {
    norm_w[h] = fetched_norm_w[h];
  }
}

// -- per tile: the SIMD groups' sums in order, the matmul's rounding, the residual --
LILY_UNROLL for (uint t = 0; t < TPG; ++t) {
  for (int e = 0; e < LILY_TILE_ACC_ELEMS; ++e) {
    const int m = lily_tile_acc_row(e, lane);
    const int n = lily_tile_acc_col(e, lane);
    partial[(sg * TILE_ROWS + uint(m)) * TILE_ROWS + uint(n)] = lily_tile_acc_get(acc[t], e);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const uint seg = tile_seg[t];
  const uint seg_rows = tile_rows[t];
  const uint row0 = tile_row0[t];
  const bool live = threadgroup_position_in_grid.x * TPG + t < tiles_total;
  for (uint o = tid; o < TILE_ROWS * TILE_ROWS; o += THREADS) {
    const uint m = o / TILE_ROWS;
    const uint row = row0 + o % TILE_ROWS;
    if (!live || m >= batch_rows || row >= seg_rows) {
      continue;
    }
    float total = partial[o];
    for (uint j = 1; j < NSG; ++j) {
      total += partial[j * TILE_ROWS * TILE_ROWS + o];
    }
    float y = static_cast<float>(static_cast<XT>(total));
    if (RESIDUAL) {
      y = static_cast<float>(residual[m * residual_strides[0] + row * residual_strides[2]]) + y;
    }
    const uint at = m * seg_rows + row;
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
  threadgroup_barrier(mem_flags::mem_threadgroup);  // partial is rewritten for the next tile
}
