// MoE decode, launch 2 of 2: the down projections of the K selected experts
// and the shared expert, the routing weights, the shared expert's gate and the
// residual, for one token:
//
//   out[d] = bf16(h[d] + bf16(bf16(sum_j bf16(s_j * y_j[d])) + bf16(g * y_s[d])))
//   y_j[d] = bf16(down_j[d] . act_j),  y_s[d] = bf16(shared_down[d] . act_s),
//   g = bf16(sigmoid(shared gate logit))
//
// with stock mlx-lm's roundings: each quantized matmul's output, each weighted
// slot, sigmoid and the gated shared term are bf16; the slot sum is fp32, in
// slot order (deterministic), as moe_combine sums it; then the MoE output and
// the residual sum are rounded as stock's `h + (y + shared)`.
//
// Launcher: mlx_lily/kernels/moe_decode.py. Each SIMD group takes ROWS_PER_SG
// output rows; for each slot, lane l walks the slot's hidden units of 16
// 4-bit weights (one 8-byte load per row: a whole row of the real shape, 512
// values, in one coalesced pass of the SIMD group), u = l, l + 32, ..., and
// accumulates scale * sum(q * a) + bias * sum(a) in fp32; a SIMD sum finishes
// each row. The slot's activations are read once per unit for its rows.
//
// "bf16" here stands for T, the activations' dtype (bfloat16 or float16).
//
// Template: T (the activations' dtype), E (experts), K (top k), D (hidden size), I (experts' hidden
//           size), IS (shared expert's), IMAX (= max(I, IS)); I and IS are
//           multiples of 64.
// Inputs:   h [D] bf16 (any shape, read flat); act [K + 1, IMAX] bf16 (launch 1); inds [K] uint32;
//           scores [K] bf16; gate_logit [1] bf16 (any shape); down_w [E, D, I / 8]
//           uint32, down_s, down_b [E, D, I / 64] bf16; sdown_w [D, IS / 8]
//           uint32, sdown_s, sdown_b [D, IS / 64] bf16.
// Output:   out [D] bf16.
// Grid:     (ceil(D / ROWS_PER_TG) * THREADS, 1, 1), threadgroup (THREADS, 1, 1).

constexpr uint SIMD_WIDTH = 32;
// 4 SIMD groups (128 threads) of 2 rows: 8 rows a threadgroup, 256
// threadgroups at D = 2048.
constexpr uint SIMD_GROUPS = 4;
constexpr uint ROWS_PER_SG = 2;
constexpr uint ROWS_PER_TG = SIMD_GROUPS * ROWS_PER_SG;
constexpr uint UNIT = 16;                 // 4-bit weights per lane and load (uint2)

const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint d0 = threadgroup_position_in_grid.x * ROWS_PER_TG + sg * ROWS_PER_SG;

float routed[ROWS_PER_SG];
float gated[ROWS_PER_SG];
for (uint rr = 0; rr < ROWS_PER_SG; ++rr) {
  routed[rr] = 0.0f;
  gated[rr] = 0.0f;
}
const float open = static_cast<float>(static_cast<T>(
    1.0f / (1.0f + metal::exp(-static_cast<float>(gate_logit[0])))));

for (uint j = 0; j <= uint(K); ++j) {
  const bool is_shared = j == uint(K);
  const uint hidden = is_shared ? uint(IS) : uint(I);
  const uint units = hidden / UNIT;
  const uint row_words = hidden / 8;
  const uint row_groups = hidden / 64;
  // The router's picks are in [0, E); min() keeps the reads in range even so.
  const uint expert = is_shared ? 0u : min(inds[j], uint(E - 1));
  const uint row_base = is_shared ? 0u : expert * uint(D);
  const device uint32_t* w = is_shared ? sdown_w : down_w;
  const device T* s = is_shared ? sdown_s : down_s;
  const device T* b = is_shared ? sdown_b : down_b;

  float acc[ROWS_PER_SG];
  for (uint rr = 0; rr < ROWS_PER_SG; ++rr) {
    acc[rr] = 0.0f;
  }
  for (uint u = lane; u < units; u += SIMD_WIDTH) {
    float a[UNIT];
    float a_sum = 0.0f;
    for (uint i = 0; i < UNIT; ++i) {
      a[i] = static_cast<float>(act[j * uint(IMAX) + u * UNIT + i]);
      a_sum += a[i];
    }
    for (uint rr = 0; rr < ROWS_PER_SG; ++rr) {
      if (d0 + rr < uint(D)) {
        const uint row = row_base + d0 + rr;
        const uint2 q = *reinterpret_cast<const device uint2*>(w + row * row_words + u * 2);
        const uint words[2] = {q.x, q.y};
        float dot = 0.0f;
        for (uint wi = 0; wi < 2; ++wi) {
          for (uint n = 0; n < 8; ++n) {
            dot += a[wi * 8 + n] * static_cast<float>((words[wi] >> (4 * n)) & 0xFu);
          }
        }
        const uint at = row * row_groups + u / 4;
        acc[rr] += static_cast<float>(s[at]) * dot + static_cast<float>(b[at]) * a_sum;
      }
    }
  }
  for (uint rr = 0; rr < ROWS_PER_SG; ++rr) {
    float y = static_cast<float>(static_cast<T>(simd_sum(acc[rr])));
    if (is_shared) {
      gated[rr] = static_cast<float>(static_cast<T>(open * y));
    } else {
      routed[rr] += static_cast<float>(static_cast<T>(y * static_cast<float>(scores[j])));
    }
  }
}

for (uint rr = 0; rr < ROWS_PER_SG; ++rr) {
  const uint d = d0 + rr;
  if (lane == 0 && d < uint(D)) {
    float moe = static_cast<float>(static_cast<T>(
        static_cast<float>(static_cast<T>(routed[rr])) + gated[rr]));
    out[d] = static_cast<T>(static_cast<float>(h[d]) + moe);
  }
}
