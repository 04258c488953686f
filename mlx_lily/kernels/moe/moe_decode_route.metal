// MoE decode, launch 1 of 3: for B rows (one token each, B <= MAX_BATCH), the
// router's top-k, the post-attention RMSNorm, and the union of the rows'
// picks that launches 2 and 3 walk expert by expert.
//
// Launcher: mlx_lily/kernels/moe/decode.py. One threadgroup of SIMD_GROUPS
// SIMD groups; SIMD group g takes rows g, g + SIMD_GROUPS, ...:
//  * the top-k (router_topk.metal.h, the router kernel's routine) of its
//    logits -> inds, scores, and the picks in threadgroup memory;
//  * xn = bf16(w * bf16(h * rsqrt(mean(h^2) + eps))), as mx.fast.rms_norm
//    rounds: lane l sums the squares of elements l, l + 32, ... in order, a
//    SIMD sum finishes them. A row's arithmetic is the same whatever B is and
//    whichever SIMD group takes it.
// Then the union: the distinct experts of the B * K picks in the order of
// their first occurrence (row-major over (row, slot)), and for each distinct
// expert the slot at which each row picked it. The union is built here, once,
// on the GPU, so that launches 2 and 3 read a short map instead of each
// threadgroup scanning the picks.
//
// "bf16" here stands for T, the activations' dtype (bfloat16 or float16).
//
// Template: T, E (experts), K (top k), VALS (= ceil(E / 32)), NORMALIZE
//           (bool), D (hidden size), MAX_BATCH (rows at most).
// Inputs:   h [B, 1, D] bf16; logits [B, 1, E] bf16; norm_weight [D] bf16;
//           eps [1] fp32. B is h's first dimension (read at run time: one
//           build for every B).
// Outputs:  xn [B, D] bf16; inds [B, K] uint32; scores [B, K] bf16;
//           experts [B * K] uint32: the u-th distinct expert for u < U (the
//           number of distinct experts), NO_EXPERT (0xFFFFFFFF) from U on
//           (so that the array's size is the picks' count, which byte
//           counting reads); members [B * K, B] uint32: members[u * B + b] =
//           1 + the slot at which row b picked the u-th expert, 0 if it did not.
// Grid:     (THREADS, 1, 1), threadgroup (THREADS, 1, 1).

constexpr uint SIMD_WIDTH = 32;
constexpr uint SIMD_GROUPS = 8;
constexpr uint THREADS = SIMD_GROUPS * SIMD_WIDTH;
constexpr uint PICKS = uint(MAX_BATCH) * uint(K);
constexpr uint NO_EXPERT = 0xFFFFFFFFu;

threadgroup uint picks[PICKS];
threadgroup uint first_of[PICKS];   // the first flat index holding the same expert
threadgroup uint distinct[PICKS];   // the union, in order of first occurrence
threadgroup uint distinct_count;

const uint tid = thread_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint B = min(uint(h_shape[0]), uint(MAX_BATCH));
const uint n = B * uint(K);

// -- per row: top-k and RMSNorm (the loop is uniform within a SIMD group) -------
for (uint b = sg; b < B; b += SIMD_GROUPS) {
  uint pick = 0u;
  float weight = 0.0f;
  LILY_ROUTER_TOPK(T, E, K, VALS, NORMALIZE, logits, b * uint(E), lane, pick, weight);
  if (lane < uint(K)) {
    // The router's picks are in [0, E) whatever the logits; min() keeps the
    // later launches' weight reads in range even so.
    pick = min(pick, uint(E - 1));
    inds[b * uint(K) + lane] = pick;
    scores[b * uint(K) + lane] = static_cast<T>(weight);
    picks[b * uint(K) + lane] = pick;
  }
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
threadgroup_barrier(mem_flags::mem_threadgroup);

// -- the union of the picks ----------------------------------------------------
for (uint f = tid; f < n; f += THREADS) {
  const uint e = picks[f];
  uint first = f;
  for (uint g = 0; g < f; ++g) {
    first = (first == f && picks[g] == e) ? g : first;
  }
  first_of[f] = first;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (sg == 0) {  // one SIMD group numbers the first occurrences, in order
  uint count = 0u;
  for (uint base = 0; base < n; base += SIMD_WIDTH) {
    const uint f = base + lane;
    const uint is_first = (f < n && first_of[f] == f) ? 1u : 0u;
    const uint at = count + simd_prefix_exclusive_sum(is_first);
    if (is_first != 0u) {
      distinct[at] = picks[f];
      experts[at] = picks[f];
    }
    count += simd_sum(is_first);
  }
  for (uint u = count + lane; u < n; u += SIMD_WIDTH) {
    experts[u] = NO_EXPERT;
  }
  if (lane == 0) {
    distinct_count = count;
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint cell = tid; cell < n * B; cell += THREADS) {
  const uint u = cell / B;
  const uint b = cell % B;
  uint member = 0u;
  if (u < distinct_count) {
    for (uint j = 0; j < uint(K); ++j) {
      member = picks[b * uint(K) + j] == distinct[u] ? j + 1u : member;
    }
  }
  members[cell] = member;
}
