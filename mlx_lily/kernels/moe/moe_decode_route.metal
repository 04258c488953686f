// MoE decode, launch 1 of 4: for B rows (one token each, B <= MAX_BATCH), the
// router's top-k and the post-attention RMSNorm, one threadgroup per row.
//
// Launcher: mlx_lily/kernels/moe/decode.py. Threadgroup b (row b) has
// 1 + NORM_SG SIMD groups:
//  * SIMD group 0: the top-k (router_topk.metal.h, the router kernel's
//    routine) of row b's logits -> inds, scores;
//  * SIMD groups 1..NORM_SG: xn = bf16(w * bf16(h * rsqrt(mean(h^2) + eps))),
//    as mx.fast.rms_norm rounds: norm thread t sums the squares of elements
//    t, t + NORM_THREADS, ... in order, a SIMD sum each group's, and the
//    groups' sums are added in order. (One SIMD group walking D = 2048 alone
//    kept the launch at 14.3 us on the H200 at e05dfbc7d5, its loads in
//    series.)
// A row's arithmetic is the same whatever B is and whichever threadgroup
// takes it.
//
// There is no union map: launches 2 and 3 have one entry per (row, slot) of
// the picks, and each entry finds from inds alone whether it is its expert's
// first occurrence (row by row, slot by slot) and which slot every row picked
// it at (moe_decode_gate_up.metal). So no step here waits on all rows.
//
// "bf16" here stands for T, the activations' dtype (bfloat16 or float16).
//
// Template: T, E (experts), K (top k), VALS (= ceil(E / 32)), NORMALIZE
//           (bool), D (hidden size), NORM_SG (SIMD groups of the norm).
// Inputs:   h [B, 1, D] bf16; logits [B, 1, E] bf16; norm_weight [D] bf16;
//           eps [1] fp32.
// Outputs:  xn [B, D] bf16; inds [B, K] uint32 (in [0, E), distinct within a
//           row); scores [B, K] bf16.
// Grid:     (THREADS, B, 1), threadgroup (THREADS, 1, 1).

constexpr uint SIMD_WIDTH = 32;
constexpr uint NORM_THREADS = NORM_SG * SIMD_WIDTH;

threadgroup float partial[NORM_SG];

const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint b = threadgroup_position_in_grid.y;
const uint t = (sg - 1) * SIMD_WIDTH + lane;  // a norm thread's index (sg > 0)

if (sg == 0) {  // uniform within the SIMD group
  uint pick = 0u;
  float weight = 0.0f;
  LILY_ROUTER_TOPK(T, E, K, VALS, NORMALIZE, logits, b * uint(E), lane, pick, weight);
  if (lane < uint(K)) {
    // The router's picks are in [0, E) whatever the logits; min() keeps the
    // later launches' weight reads in range even so.
    inds[b * uint(K) + lane] = min(pick, uint(E - 1));
    scores[b * uint(K) + lane] = static_cast<T>(weight);
  }
} else {
  float squares = 0.0f;
  for (uint i = t; i < uint(D); i += NORM_THREADS) {
    const float v = static_cast<float>(h[b * uint(D) + i]);
    squares += v * v;
  }
  const float group_sum = simd_sum(squares);
  if (lane == 0) {
    partial[sg - 1] = group_sum;
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (sg > 0) {
  float total = 0.0f;
  for (uint j = 0; j < NORM_SG; ++j) {
    total += partial[j];
  }
  const float inv_rms = metal::precise::rsqrt(total / float(D) + eps[0]);
  for (uint i = t; i < uint(D); i += NORM_THREADS) {
    const float normed = static_cast<float>(static_cast<T>(static_cast<float>(h[b * uint(D) + i]) * inv_rms));
    xn[b * uint(D) + i] = static_cast<T>(static_cast<float>(norm_weight[i]) * normed);
  }
}
