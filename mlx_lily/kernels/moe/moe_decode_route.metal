// MoE decode, launch 1 of 4: for B rows (one token each, B <= MAX_BATCH), the
// router's top-k and the post-attention RMSNorm, one threadgroup per row.
//
// Launcher: mlx_lily/kernels/moe/decode.py. Threadgroup b (row b) has two
// SIMD groups, which share nothing and meet no barrier:
//  * SIMD group 0: the top-k (router_topk.metal.h, the router kernel's
//    routine) of row b's logits -> inds, scores;
//  * SIMD group 1: xn = bf16(w * bf16(h * rsqrt(mean(h^2) + eps))), as
//    mx.fast.rms_norm rounds: lane l sums the squares of elements l, l + 32,
//    ... in order, a SIMD sum finishes them.
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
//           (bool), D (hidden size).
// Inputs:   h [B, 1, D] bf16; logits [B, 1, E] bf16; norm_weight [D] bf16;
//           eps [1] fp32.
// Outputs:  xn [B, D] bf16; inds [B, K] uint32 (in [0, E), distinct within a
//           row); scores [B, K] bf16.
// Grid:     (THREADS, B, 1), threadgroup (THREADS, 1, 1).

constexpr uint SIMD_WIDTH = 32;

const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint b = threadgroup_position_in_grid.y;

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
  for (uint i = lane; i < uint(D); i += SIMD_WIDTH) {
    const float v = static_cast<float>(h[b * uint(D) + i]);
    squares += v * v;
  }
  const float inv_rms = metal::precise::rsqrt(simd_sum(squares) / float(D) + eps[0]);
  for (uint i = lane; i < uint(D); i += SIMD_WIDTH) {
    const float normed = static_cast<float>(static_cast<T>(static_cast<float>(h[b * uint(D) + i]) * inv_rms));
    xn[b * uint(D) + i] = static_cast<T>(static_cast<float>(norm_weight[i]) * normed);
  }
}
