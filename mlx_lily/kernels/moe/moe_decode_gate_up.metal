// MoE decode, launch 1 of 2: for one token, the routing, the post-attention
// RMSNorm and, for each selected expert and the shared expert, the gate and up
// projections with the SwiGLU between them.
//
// Launcher: mlx_lily/kernels/moe_decode.py. Threadgroup (block, slot) takes
// ROWS_PER_TG hidden rows of slot `slot`: slots 0..K-1 are the routed experts
// by descending rank, slot K the shared expert. Every threadgroup first
//  * runs the router's top-k (router_topk.metal.h) on the logits, in every
//    SIMD group (identical, deterministic; E is small), and takes its slot's
//    expert from the lanes with a shuffle: no threadgroup needs another's work;
//  * normalises h: xn = bf16(w * bf16(h * rsqrt(mean(h^2) + eps))), as
//    mx.fast.rms_norm rounds, into threadgroup memory (fp32 values, one pad
//    word per 32 so that lanes reading consecutive 32-value units hit
//    distinct banks).
// Then each SIMD group takes ROWS_PER_SG rows: lane l walks the input in units
// of 32 4-bit weights (one 16-byte load per row), u = l, l + 32, ..., and
// accumulates scale * sum(q * x) + bias * sum(x) per unit in fp32 (w = scale *
// q + bias, the dequantization of MLX's affine group-64 format; a unit is half
// a group). Gate and up of a row share the unit's activations. A SIMD sum
// finishes each row; gate and up are rounded to bf16 (each quantized matmul's
// output is bf16 in stock) and SwiGLU rounds each step as mlx-lm's does:
// act = bf16(bf16(gate * bf16(sigmoid(gate))) * up).
// The threadgroup (0, 0) also writes the selected experts and their weights.
//
// "bf16" here stands for T, the activations' dtype (bfloat16 or float16).
//
// Template: T (the activations' dtype), E (experts), K (top k), VALS (= ceil(E / 32)), NORMALIZE (bool),
//           D (hidden size, a multiple of 64), I (experts' hidden size), IS
//           (shared expert's), IMAX (= max(I, IS)).
// Inputs:   h [D] bf16; logits [E] bf16 (each of any shape, read flat); norm_weight [D] bf16; eps [1] fp32;
//           gate_w, up_w [E, I, D / 8] uint32 (value j of a word in bits
//           4j..4j+3), gate_s, gate_b, up_s, up_b [E, I, D / 64] bf16;
//           sgate_w, sup_w [IS, D / 8] uint32, sgate_s, sgate_b, sup_s,
//           sup_b [IS, D / 64] bf16.
// Outputs:  act [K + 1, IMAX] bf16 (row j: slot j's activations, the first I
//           or IS of them written); inds [K] uint32; scores [K] bf16.
// Grid:     (ceil(IMAX / ROWS_PER_TG) * THREADS, K + 1, 1), threadgroup
//           (THREADS, 1, 1).

constexpr uint SIMD_WIDTH = 32;
// 8 SIMD groups of 2 rows: 16 rows a threadgroup, 288 threadgroups at the real
// shape (9 slots x 512 rows), about two per SM of a large GPU. Two rows (four
// weight rows with gate and up) a SIMD group reuse each activation read from
// threadgroup memory four times.
constexpr uint SIMD_GROUPS = 8;
constexpr uint THREADS = SIMD_GROUPS * SIMD_WIDTH;
constexpr uint ROWS_PER_SG = 2;
constexpr uint ROWS_PER_TG = SIMD_GROUPS * ROWS_PER_SG;
constexpr uint UNIT = 32;                 // 4-bit weights per lane and load (uint4)
constexpr uint UNITS = D / UNIT;
constexpr uint ROW_WORDS = D / 8;
constexpr uint ROW_GROUPS = D / 64;
constexpr uint XS_STRIDE = UNIT + 1;      // a unit's values, then one pad word
constexpr uint H_PER_THREAD = (uint(D) + THREADS - 1) / THREADS;

threadgroup float xs[UNITS * XS_STRIDE];
threadgroup float partial[SIMD_GROUPS];

const uint tid = thread_index_in_threadgroup;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint block = threadgroup_position_in_grid.x;
const uint slot = threadgroup_position_in_grid.y;
const bool is_shared = slot == uint(K);
const uint rows = is_shared ? uint(IS) : uint(I);

// h, read once into registers: its loads go out before the top-k, whose
// shuffles need no threadgroup memory, so the two latencies overlap.
float h_mine[H_PER_THREAD];
float squares = 0.0f;
for (uint j = 0; j < H_PER_THREAD; ++j) {
  const uint i = tid + j * THREADS;
  h_mine[j] = i < uint(D) ? static_cast<float>(h[i]) : 0.0f;
  squares += h_mine[j] * h_mine[j];
}

// -- routing: every SIMD group, identically ------------------------------------
uint pick = 0u;
float weight = 0.0f;
LILY_ROUTER_TOPK(T, E, K, VALS, NORMALIZE, logits, 0u, lane, pick, weight);
if (block == 0 && slot == 0 && sg == 0 && lane < uint(K)) {
  inds[lane] = pick;
  scores[lane] = static_cast<T>(weight);
}
// The router's picks are in [0, E) whatever the logits; min() keeps the
// weight reads in range even so.
const uint expert = min(simd_shuffle(pick, is_shared ? 0u : slot), uint(E - 1));

// -- RMSNorm of h into threadgroup memory --------------------------------------
squares = simd_sum(squares);
if (lane == 0) {
  partial[sg] = squares;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
float total = 0.0f;
for (uint s = 0; s < SIMD_GROUPS; ++s) {
  total += partial[s];
}
const float inv_rms = metal::precise::rsqrt(total / float(D) + eps[0]);
for (uint j = 0; j < H_PER_THREAD; ++j) {
  const uint i = tid + j * THREADS;
  if (i < uint(D)) {
    float n = static_cast<float>(static_cast<T>(h_mine[j] * inv_rms));
    xs[(i / UNIT) * XS_STRIDE + i % UNIT] =
        static_cast<float>(static_cast<T>(static_cast<float>(norm_weight[i]) * n));
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// -- gate and up rows of this slot ---------------------------------------------
const device uint32_t* gw = is_shared ? sgate_w : gate_w;
const device T* gs = is_shared ? sgate_s : gate_s;
const device T* gb = is_shared ? sgate_b : gate_b;
const device uint32_t* uw = is_shared ? sup_w : up_w;
const device T* us = is_shared ? sup_s : up_s;
const device T* ub = is_shared ? sup_b : up_b;
const uint row_base = is_shared ? 0u : expert * uint(I);
const uint r0 = block * ROWS_PER_TG + sg * ROWS_PER_SG;

float acc_gate[ROWS_PER_SG];
float acc_up[ROWS_PER_SG];
for (uint rr = 0; rr < ROWS_PER_SG; ++rr) {
  acc_gate[rr] = 0.0f;
  acc_up[rr] = 0.0f;
}
for (uint u = lane; u < UNITS; u += SIMD_WIDTH) {
  float x[UNIT];
  float x_sum = 0.0f;
  for (uint i = 0; i < UNIT; ++i) {
    x[i] = xs[u * XS_STRIDE + i];
    x_sum += x[i];
  }
  for (uint rr = 0; rr < ROWS_PER_SG; ++rr) {
    if (r0 + rr < rows) {
      const uint row = row_base + r0 + rr;
      const uint4 qg = *reinterpret_cast<const device uint4*>(gw + row * ROW_WORDS + u * 4);
      const uint4 qu = *reinterpret_cast<const device uint4*>(uw + row * ROW_WORDS + u * 4);
      const uint at = row * ROW_GROUPS + u / 2;
      const uint words_g[4] = {qg.x, qg.y, qg.z, qg.w};
      const uint words_u[4] = {qu.x, qu.y, qu.z, qu.w};
      float dot_g = 0.0f;
      float dot_u = 0.0f;
      for (uint w = 0; w < 4; ++w) {
        for (uint n = 0; n < 8; ++n) {
          dot_g += x[w * 8 + n] * static_cast<float>((words_g[w] >> (4 * n)) & 0xFu);
          dot_u += x[w * 8 + n] * static_cast<float>((words_u[w] >> (4 * n)) & 0xFu);
        }
      }
      acc_gate[rr] += static_cast<float>(gs[at]) * dot_g + static_cast<float>(gb[at]) * x_sum;
      acc_up[rr] += static_cast<float>(us[at]) * dot_u + static_cast<float>(ub[at]) * x_sum;
    }
  }
}
for (uint rr = 0; rr < ROWS_PER_SG; ++rr) {
  float gate = simd_sum(acc_gate[rr]);
  float up = simd_sum(acc_up[rr]);
  if (lane == 0 && r0 + rr < rows) {
    gate = static_cast<float>(static_cast<T>(gate));
    up = static_cast<float>(static_cast<T>(up));
    float sig = static_cast<float>(static_cast<T>(1.0f / (1.0f + metal::exp(-gate))));
    float silu = static_cast<float>(static_cast<T>(gate * sig));
    act[slot * uint(IMAX) + r0 + rr] = static_cast<T>(silu * up);
  }
}
