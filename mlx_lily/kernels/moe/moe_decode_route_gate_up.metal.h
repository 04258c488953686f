// MoE decode launches 1 and 2 as one (moe_decode_gate_up.metal, "routed"):
// for a few rows (B <= ROUTED_MAX_ROWS in decode.py) each threadgroup first
// takes every row's top-k of its router logits and its RMSNorm's inverse
// rms, exactly as moe_decode_route.metal does (the same top-k routine; the
// norm's sum of squares split over the same 8 x 32 threads in the same
// order: NSG must be NORM_SG), keeps them in threadgroup memory with every
// row's x = bf16(w * bf16(h * inv_rms)), as launch 1 writes xn, and reads x
// there where launch 2 reads xn: the same bits, one launch fewer.
// Threadgroup (0, 0) writes the picks and weights that launch 3 reads.
// Why: on a GPU whose host launches kernels slower than
// they run (the H200 through MLX), a launch per layer costs more than the
// threadgroups' repeated top-k and norms.
//
// Inputs:  h [B, 1, D], logits [B, 1, E], norm_weight [D] (T); eps [1] fp32;
//          then gate/up's weights. Outputs: act; inds [B, K] uint32; scores
//          [B, K] T. Template: gate/up's, and E, VALS, NORMALIZE.

// (The top-k macro's own variables are lily_*: the picks it hands over are
// routed_*, lest a name shadow one of its own.)
#define LILY_ROWS(XN_SHAPE, H_SHAPE) H_SHAPE[0]
#define LILY_PICK(I) lily_picks[(I)]
// (Its threadgroup arrays open the body: moe_decode_route_gate_up.metal.)
#define LILY_GATE_UP_PROLOGUE                                                            \
  for (uint lily_rb = sg; lily_rb < uint(MAX_BATCH); lily_rb += uint(NSG)) {             \
    if (lily_rb < B) { /* uniform within the SIMD group */                               \
      uint routed_pick = 0u;                                                               \
      float routed_weight = 0.0f;                                                          \
      LILY_ROUTER_TOPK(T, E, K, VALS, NORMALIZE, logits, lily_rb * uint(E), lane, routed_pick, routed_weight); \
      if (lane < uint(K)) {                                                              \
        const uint lily_at = lily_rb * uint(K) + lane;                                   \
        lily_picks[lily_at] = min(routed_pick, uint(E - 1));                               \
        if (block == 0u && entry == 0u) {                                                \
          inds[lily_at] = min(routed_pick, uint(E - 1));                                   \
          scores[lily_at] = static_cast<T>(routed_weight);                                 \
        }                                                                                \
      }                                                                                  \
    }                                                                                    \
  }                                                                                      \
  for (uint lily_rb = 0; lily_rb < B; ++lily_rb) {                                       \
    float lily_squares = 0.0f;                                                           \
    for (uint lily_i = sg * SIMD_WIDTH + lane; lily_i < uint(D); lily_i += uint(NSG) * SIMD_WIDTH) { \
      const float lily_v = static_cast<float>(h[lily_rb * uint(D) + lily_i]);            \
      lily_squares += lily_v * lily_v;                                                   \
    }                                                                                    \
    const float lily_group_sum = simd_sum(lily_squares);                                 \
    if (lane == 0u) {                                                                    \
      lily_partial[sg] = lily_group_sum;                                                 \
    }                                                                                    \
    threadgroup_barrier(mem_flags::mem_threadgroup);                                     \
    if (sg == 0u && lane == 0u) {                                                        \
      float lily_total = 0.0f;                                                           \
      for (uint lily_j = 0; lily_j < uint(NSG); ++lily_j) {                              \
        lily_total += lily_partial[lily_j];                                              \
      }                                                                                  \
      lily_inv_rms[lily_rb] = metal::precise::rsqrt(lily_total / float(D) + eps[0]);     \
    }                                                                                    \
    threadgroup_barrier(mem_flags::mem_threadgroup);                                     \
  }                                                                                      \
  /* Each row's x, a word (eight values) a thread at a time, as launch 1 rounds it. */  \
  for (uint lily_rb = 0; lily_rb < min(B, uint(XN_ROWS)); ++lily_rb) {                   \
    const float lily_inv = lily_inv_rms[lily_rb];                                        \
    for (uint lily_w = sg * SIMD_WIDTH + lane; lily_w < uint(D) / 8u; lily_w += uint(NSG) * SIMD_WIDTH) { \
      const uint4 lily_hw = lily_tile_load16(h + lily_rb * uint(D) + 8u * lily_w);       \
      const uint4 lily_ww = lily_tile_load16(norm_weight + 8u * lily_w);                 \
      float lily_x[8];                                                                   \
      for (uint lily_i = 0; lily_i < 8; ++lily_i) {                                      \
        const float lily_normed = static_cast<float>(static_cast<T>(lily_tile_unpack_as<T>(lily_hw, lily_i) * lily_inv)); \
        lily_x[lily_i] = static_cast<float>(static_cast<T>(lily_tile_unpack_as<T>(lily_ww, lily_i) * lily_normed)); \
      }                                                                                  \
      const uint4 lily_words = {lily_tile_pack2_as<T>(lily_x[0], lily_x[1]), lily_tile_pack2_as<T>(lily_x[2], lily_x[3]), \
                                lily_tile_pack2_as<T>(lily_x[4], lily_x[5]), lily_tile_pack2_as<T>(lily_x[6], lily_x[7])}; \
      lily_xn[lily_rb * (uint(D) / 8u) + lily_w] = lily_words;                           \
    }                                                                                    \
  }                                                                                      \
  threadgroup_barrier(mem_flags::mem_threadgroup);
// XS[0..8) = row ROW's normed x at K0 .. K0 + 7 (K0 a multiple of 8), from
// the prologue's words (zeros where not PRESENT).
#define LILY_X_CHUNK(XS, ROW, K0, PRESENT)                                               \
  {                                                                                      \
    const uint4 lily_xw = (PRESENT) ? lily_xn[(ROW) * (uint(D) / 8u) + (K0) / 8u] : no_words; \
    for (uint lily_i = 0; lily_i < 8; ++lily_i) {                                        \
      XS[lily_i] = lily_tile_unpack_as<T>(lily_xw, lily_i);                              \
    }                                                                                    \
  }
