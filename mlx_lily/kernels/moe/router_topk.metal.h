// The MoE router's top-k, shared by the bodies that route a token: softmax over
// all E experts of a row of logits, in fp32, then the K experts ranked as stock
// mlx-lm ranks them: by the probability rounded to T (stock takes the top k of
// the softmax in the activation dtype), the higher expert index first among
// equal rounded probabilities (the order of MLX's CPU argpartition). Their
// rounded probabilities are the weights, renormalised to sum 1 (in T's
// rounding, as stock) when NORMALIZE is set.
//
// A row whose softmax is NaN (NaN or infinite logits) still yields K distinct
// experts in [0, E): NaN probabilities rank below every number, so such a
// row's picks are its highest indices; their weights are NaN, as stock's.
//
// One SIMD group (all 32 lanes, in uniform control flow) runs
//
//   LILY_ROUTER_TOPK(T, E, K, VALS, NORMALIZE, LOGITS, SRC, LANE, PICK, WEIGHT)
//
// T: the logits' dtype; E experts; K picks (K <= 32, K <= E); VALS =
// ceil(E / 32); NORMALIZE: bool; LOGITS[SRC + e]: the row's logits; LANE: the
// lane's index in its SIMD group. Lane r < K leaves with the r-th pick in PICK
// (a uint variable) and its weight in WEIGHT (a float variable); other lanes'
// PICK and WEIGHT keep their values. Lane l holds experts l, l + 32, l + 64,
// ... in registers (VALS of them), so the loads of a row are coalesced and
// the softmax needs one simd_max and one simd_sum. Each of the K rounds is a
// SIMD argmax: the largest rank, then the largest expert index holding it,
// taken as one butterfly over (rank, index) pairs (an order on pairs, so
// every lane ends with the same pair): five exchanges of two independent
// shuffles each, not a max of ranks and then a max of indices (ten
// exchanges, each waiting on the one before).
//
// Ranks: a probability's rounded value (>= 0); below them NaN's rank (-0.5),
// then -1, which marks experts already picked and the padding slots of lanes
// past E, so that neither is picked again. A lane may end a round on a retired
// slot; K <= E leaves a better one in some lane. Retiring compares instead of
// indexing the rank array by the pick, so that the ranks stay in registers.
//
// (A macro, not a function: a helper function would need a CUDA execution
// space qualifier, which the portable subset cannot spell.)

#define LILY_ROUTER_TOPK(T, E, K, VALS, NORMALIZE, LOGITS, SRC, LANE, PICK, WEIGHT)          \
  {                                                                                          \
    float lily_rank[VALS];                                                                   \
    float lily_row_max = -INFINITY;                                                          \
    for (int lily_j = 0; lily_j < (VALS); ++lily_j) {                                        \
      uint lily_e = lily_j * 32u + (LANE);                                                   \
      lily_rank[lily_j] = lily_e < (E) ? static_cast<float>((LOGITS)[(SRC) + lily_e]) : -INFINITY; \
      lily_row_max = max(lily_row_max, lily_rank[lily_j]);                                   \
    }                                                                                        \
    lily_row_max = simd_max(lily_row_max);                                                   \
    float lily_row_sum = 0.0f;                                                               \
    for (int lily_j = 0; lily_j < (VALS); ++lily_j) {                                        \
      uint lily_e = lily_j * 32u + (LANE);                                                   \
      lily_rank[lily_j] = lily_e < (E) ? metal::exp(lily_rank[lily_j] - lily_row_max) : 0.0f; \
      lily_row_sum += lily_rank[lily_j];                                                     \
    }                                                                                        \
    lily_row_sum = simd_sum(lily_row_sum);                                                   \
    for (int lily_j = 0; lily_j < (VALS); ++lily_j) {                                        \
      uint lily_e = lily_j * 32u + (LANE);                                                   \
      float lily_p = static_cast<float>(static_cast<T>(lily_rank[lily_j] / lily_row_sum));   \
      lily_rank[lily_j] = lily_e < (E) ? (lily_p >= 0.0f ? lily_p : -0.5f) : -1.0f;          \
    }                                                                                        \
    for (int lily_r = 0; lily_r < (K); ++lily_r) {                                           \
      float lily_best = -INFINITY;                                                           \
      uint lily_best_expert = 0;                                                             \
      for (int lily_j = 0; lily_j < (VALS); ++lily_j) {                                      \
        if (lily_rank[lily_j] >= lily_best) {                                                \
          lily_best = lily_rank[lily_j];                                                     \
          lily_best_expert = lily_j * 32u + (LANE);                                          \
        }                                                                                    \
      }                                                                                      \
      float lily_top = lily_best;                                                            \
      uint lily_pick = lily_best_expert;                                                     \
      for (uint lily_o = 16u; lily_o > 0u; lily_o >>= 1u) {                                  \
        const float lily_other = simd_shuffle_xor(lily_top, lily_o);                         \
        const uint lily_other_pick = simd_shuffle_xor(lily_pick, lily_o);                    \
        const bool lily_take = lily_other > lily_top ||                                      \
                               (lily_other == lily_top && lily_other_pick > lily_pick);      \
        lily_top = lily_take ? lily_other : lily_top;                                        \
        lily_pick = lily_take ? lily_other_pick : lily_pick;                                 \
      }                                                                                      \
      for (int lily_j = 0; lily_j < (VALS); ++lily_j) {                                      \
        if (lily_j * 32u + (LANE) == lily_pick) {                                            \
          lily_rank[lily_j] = -1.0f;                                                         \
        }                                                                                    \
      }                                                                                      \
      if ((LANE) == uint(lily_r)) {                                                          \
        PICK = lily_pick;                                                                    \
        WEIGHT = lily_top >= 0.0f ? lily_top : NAN;                                          \
      }                                                                                      \
    }                                                                                        \
    float lily_kept = simd_sum((LANE) < uint(K) ? (WEIGHT) : 0.0f);                          \
    if (NORMALIZE) {                                                                         \
      WEIGHT = (WEIGHT) / static_cast<float>(static_cast<T>(lily_kept));                    \
    }                                                                                        \
  }
