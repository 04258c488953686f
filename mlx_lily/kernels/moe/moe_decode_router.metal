// MoE decode, the router's launch: for B rows (one token each, B <=
// MAX_BATCH), one threadgroup per row, everything before the experts:
//  1. the router GEMV's RMSNorm prologue and route's RMSNorm, each summing
//     its squares in its own kernel's order;
//  2. xin = the GEMV's normed input (threadgroup memory) and xn = route's
//     (the output gate/up reads);
//  3. the router's E rows and the shared expert gate's row, each dot
//     product in the GEMV's order (below), so the logits are the GEMV's
//     bits;
//  4. SIMD group 0: the top-k of the row's logits (router_topk.metal.h).
// So the launch gives, to the bit, what the router GEMV (gemv.metal with the
// norm prologue, its B = 1 launch's NORM_SG) and moe_decode_route.metal give
// as two launches; the tests compare them bit for bit. Why one threadgroup
// per row reads all E + 1 rows itself: the picks are there in the launch
// that made the logits, with no launch of its own (a launch per layer costs
// the H200's host more than its work) and no threadgroup of gate/up redoing
// them. The router's weights (E x D at 8 bits: 0.5 MB at the real shape)
// are read by every row's threadgroup, from cache after the first.
//
// The GEMV's order for one weight row (gemv.metal, BATCH 1, the whole row
// staged): lane l takes the 16-byte units at k0 = s * 32 * values + l *
// values for each step s (values = 32 at 4 bits, 16 at 8); per unit, per
// chunk c of 8 values in order: dot = fma(q_i, x_i, dot) over i from 0,
// acc = fma(scale, dot, acc), xsum += x_i; after the unit, acc = fma(bias,
// xsum, acc); then simd_sum(acc), rounded to T. Units past D add zeros.
// The route's norm: norm thread t (t < NORM_SG * 32, lane t % 32) adds v *
// v over elements t, t + NORM_SG * 32, ...; each SIMD group's simd_sum;
// the groups' sums added in order. The GEMV's the same with GEMV_NORM_SG
// groups and fma(v, v, squares).
//
// Template: T (h's dtype, bfloat16 or float16), E (experts), K (top k),
//           VALS (= ceil(E / 32)), NORMALIZE (bool), D (hidden size), BITS
//           (the router's: 4 or 8), SHARED_BITS (the shared gate's), NSG
//           (SIMD groups per threadgroup, >= GEMV_NORM_SG and NORM_SG),
//           GEMV_NORM_SG, NORM_SG (route's, ROUTE_NORM_SG), ROWS (weight
//           rows per SIMD group at a time), STEPS (a lane's 16-byte units
//           of a row, the more of the two widths': ceil(D / 512) at 8
//           bits, ceil(D / 1024) at 4).
// Inputs:   h [B, 1, D]; norm_weight [D] (T); eps [1] fp32; router_w [E,
//           D * BITS / 32] uint32, router_s, router_b [E, D / 64] (T);
//           shared_w [1, D * SHARED_BITS / 32], shared_s, shared_b [1, D / 64].
// Outputs:  logits [B, 1, E], shared_logit [B, 1, 1], xn [B, D] (T); inds
//           [B, K] uint32; scores [B, K] T.
// Grid:     (NSG * 32, B, 1), threadgroup (NSG * 32, 1, 1).

constexpr uint SIMD_WIDTH = 32;
constexpr uint THREADS = NSG * SIMD_WIDTH;
constexpr uint GROUP_SIZE = 64;
constexpr uint GROUPS_PER_ROW = D / GROUP_SIZE;
constexpr uint GEMV_NORM_THREADS = GEMV_NORM_SG * SIMD_WIDTH;
constexpr uint NORM_THREADS = NORM_SG * SIMD_WIDTH;
// The router's rows in blocks of ROWS, then one block: the shared gate's row.
constexpr uint ROUTER_BLOCKS = (E + ROWS - 1) / ROWS;

threadgroup T xin[D];
threadgroup T row_logits[E];
threadgroup float gemv_partial[GEMV_NORM_SG];
threadgroup float route_partial[NORM_SG];

const uint tid = thread_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint b = threadgroup_position_in_grid.y;
const uint4 no_words = {0u, 0u, 0u, 0u};

// -- 1. the two norms' sums of squares -------------------------------------------------
if (sg < GEMV_NORM_SG) {  // uniform within a SIMD group
  float squares = 0.0f;
  for (uint k = tid; k < uint(D); k += GEMV_NORM_THREADS) {
    const float v = static_cast<float>(h[b * uint(D) + k]);
    squares = fma(v, v, squares);
  }
  const float sum = simd_sum(squares);
  if (lane == 0u) {
    gemv_partial[sg] = sum;
  }
}
if (sg < NORM_SG) {
  float squares = 0.0f;
  for (uint i = tid; i < uint(D); i += NORM_THREADS) {
    const float v = static_cast<float>(h[b * uint(D) + i]);
    squares += v * v;
  }
  const float group_sum = simd_sum(squares);
  if (lane == 0u) {
    route_partial[sg] = group_sum;
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// -- 2. the GEMV's input and route's xn --------------------------------------------------
float gemv_total = 0.0f;
for (uint i = 0; i < GEMV_NORM_SG; ++i) {
  gemv_total += gemv_partial[i];
}
const float gemv_inv_rms = metal::precise::rsqrt(gemv_total / float(D) + eps[0]);
float route_total = 0.0f;
for (uint j = 0; j < NORM_SG; ++j) {
  route_total += route_partial[j];
}
const float route_inv_rms = metal::precise::rsqrt(route_total / float(D) + eps[0]);
for (uint k = tid; k < uint(D); k += THREADS) {
  const float v = static_cast<float>(h[b * uint(D) + k]);
  const float w = static_cast<float>(norm_weight[k]);
  const float normed = static_cast<float>(static_cast<T>(v * gemv_inv_rms));
  xin[k] = static_cast<T>(normed * w);
  const float route_normed = static_cast<float>(static_cast<T>(v * route_inv_rms));
  xn[b * uint(D) + k] = static_cast<T>(w * route_normed);
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// -- 3. the router's rows and the shared gate's ----------------------------------------
for (uint block = sg; block <= ROUTER_BLOCKS; block += NSG) {
  const bool is_shared = block == ROUTER_BLOCKS;  // uniform within the SIMD group
  const uint bits = is_shared ? uint(SHARED_BITS) : uint(BITS);
  const uint rows = is_shared ? 1u : uint(E);
  const uint row0 = is_shared ? 0u : block * ROWS;
  const uint values = bits == 4u ? 32u : 16u;
  const uint span = SIMD_WIDTH * values;
  const uint steps = (uint(D) + span - 1u) / span;
  const uint words_per_row = uint(D) * bits / 32u;
  // Every unit of the block's rows is loaded before any is multiplied: a
  // lane's loads all in flight at once, one trip to memory a block (the
  // sums' order is the multiplies', below, not the loads').
  uint4 words[ROWS][STEPS];
  float scale[ROWS][STEPS];
  float bias[ROWS][STEPS];
  for (uint s = 0; s < STEPS; ++s) {
    const uint k0 = s * span + lane * values;
    for (uint r = 0; r < ROWS; ++r) {
      const uint row = row0 + r;
      words[r][s] = no_words;
      scale[r][s] = 0.0f;
      bias[r][s] = 0.0f;
      if (s < steps && k0 < uint(D) && row < rows) {
        const uint wi = row * words_per_row + k0 / (32u / bits);
        const uint gi = row * GROUPS_PER_ROW + k0 / GROUP_SIZE;
        if (is_shared) {
          words[r][s] = *reinterpret_cast<const device uint4*>(shared_w + wi);
          scale[r][s] = static_cast<float>(shared_s[gi]);
          bias[r][s] = static_cast<float>(shared_b[gi]);
        } else {
          words[r][s] = *reinterpret_cast<const device uint4*>(router_w + wi);
          scale[r][s] = static_cast<float>(router_s[gi]);
          bias[r][s] = static_cast<float>(router_b[gi]);
        }
      }
    }
  }
  float acc[ROWS];
  for (uint r = 0; r < ROWS; ++r) {
    acc[r] = 0.0f;
  }
  for (uint s = 0; s < STEPS; ++s) {
    // Steps past this width's (4 bits: half of them) add nothing: their
    // units are zeros, as the GEMV's past D.
    const uint k0 = s * span + lane * values;
    const bool active = s < steps && k0 < uint(D);
    float xsum = 0.0f;
    for (uint c = 0; c < 4; ++c) {
      if (c < values / 8u) {
        float xv[8];
        for (uint i = 0; i < 8; ++i) {
          xv[i] = active ? static_cast<float>(xin[k0 + 8u * c + i]) : 0.0f;
          xsum += xv[i];
        }
        for (uint r = 0; r < ROWS; ++r) {
          // Chunk c's 8 values, exact small integers (the GEMV's 4-bit
          // pattern trick: nibble q under 0x4300 is the bf16 number 128 + q).
          const uint4 unit = words[r][s];
          float q[8];
          if (bits == 4u) {
            const uint w = c == 0 ? unit.x : (c == 1 ? unit.y : (c == 2 ? unit.z : unit.w));
            const uint4 pairs = {(w & 0x000F000Fu) | 0x43004300u, ((w >> 4) & 0x000F000Fu) | 0x43004300u,
                                 ((w >> 8) & 0x000F000Fu) | 0x43004300u, ((w >> 12) & 0x000F000Fu) | 0x43004300u};
            for (uint m = 0; m < 4; ++m) {
              q[m] = lily_tile_unpack(pairs, 2 * m) - 128.0f;
              q[m + 4] = lily_tile_unpack(pairs, 2 * m + 1) - 128.0f;
            }
          } else {
            const uint first = c == 0 ? unit.x : unit.z;
            const uint second = c == 0 ? unit.y : unit.w;
            for (uint i = 0; i < 4; ++i) {
              q[i] = static_cast<float>((first >> (8 * i)) & 0xFFu);
              q[4 + i] = static_cast<float>((second >> (8 * i)) & 0xFFu);
            }
          }
          float dot = 0.0f;
          for (uint i = 0; i < 8; ++i) {
            dot = fma(q[i], xv[i], dot);
          }
          acc[r] = fma(scale[r][s], dot, acc[r]);
        }
      }
    }
    for (uint r = 0; r < ROWS; ++r) {
      acc[r] = fma(bias[r][s], xsum, acc[r]);
    }
  }
  for (uint r = 0; r < ROWS; ++r) {
    const float total = simd_sum(acc[r]);
    const uint row = row0 + r;
    if (lane == r && row < rows) {
      const T y = static_cast<T>(total);
      if (is_shared) {
        shared_logit[b] = y;
      } else {
        row_logits[row] = y;
        logits[b * uint(E) + row] = y;
      }
    }
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// -- 4. the top-k ------------------------------------------------------------------------
if (sg == 0u) {
  uint pick = 0u;
  float weight = 0.0f;
  LILY_ROUTER_TOPK(T, E, K, VALS, NORMALIZE, row_logits, 0u, lane, pick, weight);
  if (lane < uint(K)) {
    // In [0, E) whatever the logits; min() keeps gate/up's reads in range even so.
    inds[b * uint(K) + lane] = min(pick, uint(E - 1));
    scores[b * uint(K) + lane] = static_cast<T>(weight);
  }
}
