// Grouped expert GEMM on matrix tiles, with 4-bit affine (group 64) weights
// dequantized inside the tile loop: the routed experts of an MoE layer.
//
// Launcher: mlx_lily/kernels/moe_gemm.py. The rows are the N * K (token,
// slot) assignments in expert order (``order``, from moe_routing.metal); a
// threadgroup takes one tile of at most TILE_M rows of one expert (``tiles``)
// and COLS output columns, and walks the input dimension in steps of one
// quantization group (64): it stages the tile's activations and the expert's
// weights for those columns, dequantized to bf16 (w = scale * q + bias), in
// threadgroup memory (16-byte moves; the next step's words and activations
// are fetched into registers while the current step is multiplied), then its
// four SIMD groups multiply them in 16x16 tiles with fp32 accumulation.
// Weights are never expanded in device memory. Activation rows must start
// 16-byte aligned (the model passes fresh arrays).
//
// Two forms of one body:
// * GATED (gate and up projections, SwiGLU): act = x [N, D_IN] (row = token),
//   w0/scales0/biases0 = gate, w1/scales1/biases1 = up; the 128 staged weight
//   rows are 64 gate columns then the same 64 up columns, so each lane holds
//   gate and up of the same elements; out = h [N * K, D_OUT] in expert order,
//   silu(gate) * up rounded to bf16 step by step as mlx-lm's SwiGLU rounds it.
// * down (not GATED): act = h (row = position in order), w0/... = down (w1/...
//   are not read); out = y [N * K, D_OUT] at row token * K + slot.
// Tiles of the invalid bucket (expert id >= E) run no K steps and write zeros;
// tiles past the real ones (no rows) write nothing.
//
// Template: GATED (bool), TILE_M (16, 32 or 64), D_IN, D_OUT (the weights'
//           output dimension), E (experts), TOPK (slots per token).
// Inputs:   act [*, D_IN] bf16, order [N * K] uint32, tiles [*, 3] uint32,
//           w0, w1 [E, D_OUT, D_IN / 8] uint32 (value j of a word in bits 4j..4j+3),
//           scales0, biases0, scales1, biases1 [E, D_OUT, D_IN / 64] bf16.
// Output:   out [N * K, D_OUT] bf16.
// Grid:     (D_OUT / COLS * THREADS, tiles, 1); threadgroup (THREADS, 1, 1).

constexpr uint SIMD_GROUPS = 4;
constexpr uint THREADS = SIMD_GROUPS * 32;
constexpr uint GROUP_SIZE = 64;               // quantization group
constexpr uint TILE_K = GROUP_SIZE;           // one scale and bias per row per step
constexpr uint PACK = 8;                      // 4-bit values per uint32
constexpr uint STEP_WORDS = TILE_K / PACK;    // words of a weight row per step
constexpr uint B_ROWS = 128;                  // staged weight rows (output columns)
constexpr uint COLS = GATED ? B_ROWS / 2 : B_ROWS;
constexpr uint PAD = 8;                       // breaks shared-memory bank conflicts
constexpr uint LDS = TILE_K + PAD;
constexpr uint M_TILES = TILE_M / 16;
constexpr uint ROW_WORDS = D_IN / PACK;
constexpr uint ROW_GROUPS = D_IN / GROUP_SIZE;
constexpr uint NO_ROW = 0xFFFFFFFFu;
constexpr uint A_ROW_CHUNKS = TILE_K / PACK;             // 16-byte chunks of a staged row
constexpr uint A_CHUNKS = TILE_M * A_ROW_CHUNKS / THREADS;  // per thread and step
constexpr uint B_WORDS = B_ROWS * STEP_WORDS / THREADS;     // per thread and step

threadgroup bfloat16_t staged_a[TILE_M * LDS];
threadgroup bfloat16_t staged_b[B_ROWS * LDS];
threadgroup uint src_row[TILE_M];  // act row of tile row r, NO_ROW past the tile's rows
threadgroup uint dst_row[TILE_M];  // out row of tile row r

const uint tid = thread_position_in_threadgroup.x;
const uint lane = thread_index_in_simdgroup;
const uint sg = simdgroup_index_in_threadgroup;
const uint tile = threadgroup_position_in_grid.y;
const uint col0 = threadgroup_position_in_grid.x * COLS;
const uint4 nothing = {0u, 0u, 0u, 0u};

const uint expert = tiles[3 * tile];
const uint begin = tiles[3 * tile + 1];
const uint end = tiles[3 * tile + 2];
// The invalid bucket (E) and the padding tiles have no weights to read.
const uint k_steps = expert < E ? ROW_GROUPS : 0u;

if (tid < TILE_M) {
  uint pos = begin + tid;
  bool real = pos < end;
  uint routed = real ? order[pos] : 0u;
  src_row[tid] = real ? (GATED ? routed / TOPK : pos) : NO_ROW;
  dst_row[tid] = real ? (GATED ? pos : routed) : NO_ROW;
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// This SIMD group's two column tiles among the staged weight rows: gate and
// up of the same 16 columns (GATED), or 32 adjacent columns (down).
const uint b_row0 = GATED ? sg * 16 : sg * 32;
const uint b_row1 = GATED ? COLS + sg * 16 : sg * 32 + 16;

lily_tile_acc acc[M_TILES][2];
for (uint m = 0; m < M_TILES; ++m) {
  lily_tile_acc_zero(acc[m][0]);
  lily_tile_acc_zero(acc[m][1]);
}

// Staging, in 16-byte moves: each thread carries A_CHUNKS chunks of eight
// activations and B_WORDS packed weight words (with their rows' scale and
// bias) per step, fetched into registers one step ahead so that their
// global-memory latency hides behind the current step's tensor work.
uint4 next_a[A_CHUNKS];
uint next_w[B_WORDS];
float next_scale[B_WORDS];
float next_bias[B_WORDS];
for (uint step = 0; step < k_steps; ++step) {
  if (step == 0) {
    for (uint c = 0; c < A_CHUNKS; ++c) {
      const uint at = tid + c * THREADS;
      const uint src = src_row[at / A_ROW_CHUNKS];
      next_a[c] = src != NO_ROW ? lily_tile_load16(&act[src * D_IN + (at % A_ROW_CHUNKS) * PACK]) : nothing;
    }
    for (uint j = 0; j < B_WORDS; ++j) {
      const uint at = tid + j * THREADS;
      const uint n = at / STEP_WORDS;
      const bool second = GATED && n >= COLS;
      const uint w_row = expert * D_OUT + col0 + (second ? n - COLS : n);
      next_w[j] = second ? w1[w_row * ROW_WORDS + at % STEP_WORDS] : w0[w_row * ROW_WORDS + at % STEP_WORDS];
      next_scale[j] = static_cast<float>(second ? scales1[w_row * ROW_GROUPS] : scales0[w_row * ROW_GROUPS]);
      next_bias[j] = static_cast<float>(second ? biases1[w_row * ROW_GROUPS] : biases0[w_row * ROW_GROUPS]);
    }
  }
  for (uint c = 0; c < A_CHUNKS; ++c) {
    const uint at = tid + c * THREADS;
    lily_tile_store16(&staged_a[(at / A_ROW_CHUNKS) * LDS + (at % A_ROW_CHUNKS) * PACK], next_a[c]);
  }
  // A word holds 8 weights of one row: dequantized (w = scale * q + bias,
  // rounded to bf16) into one 16-byte store.
  for (uint j = 0; j < B_WORDS; ++j) {
    const uint at = tid + j * THREADS;
    const uint packed = next_w[j];
    float w[PACK];
    for (uint i = 0; i < PACK; ++i) {
      w[i] = next_scale[j] * static_cast<float>((packed >> (4 * i)) & 0xFu) + next_bias[j];
    }
    const uint4 bf16x8 = {lily_tile_pack2(w[0], w[1]), lily_tile_pack2(w[2], w[3]),
                          lily_tile_pack2(w[4], w[5]), lily_tile_pack2(w[6], w[7])};
    lily_tile_store16(&staged_b[(at / STEP_WORDS) * LDS + (at % STEP_WORDS) * PACK], bf16x8);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // The next step's operands, into registers while this one is multiplied.
  const uint next = step + 1;
  if (next < k_steps) {
    for (uint c = 0; c < A_CHUNKS; ++c) {
      const uint at = tid + c * THREADS;
      const uint src = src_row[at / A_ROW_CHUNKS];
      next_a[c] = src != NO_ROW
          ? lily_tile_load16(&act[src * D_IN + next * TILE_K + (at % A_ROW_CHUNKS) * PACK])
          : nothing;
    }
    for (uint j = 0; j < B_WORDS; ++j) {
      const uint at = tid + j * THREADS;
      const uint n = at / STEP_WORDS;
      const bool second = GATED && n >= COLS;
      const uint w_row = expert * D_OUT + col0 + (second ? n - COLS : n);
      const uint w_at = w_row * ROW_WORDS + next * STEP_WORDS + at % STEP_WORDS;
      const uint s_at = w_row * ROW_GROUPS + next;
      next_w[j] = second ? w1[w_at] : w0[w_at];
      next_scale[j] = static_cast<float>(second ? scales1[s_at] : scales0[s_at]);
      next_bias[j] = static_cast<float>(second ? biases1[s_at] : biases0[s_at]);
    }
  }

  for (uint kk = 0; kk < TILE_K; kk += 16) {
    lily_tile_b b0;
    lily_tile_b b1;
    lily_tile_load_b(b0, &staged_b[b_row0 * LDS + kk], LDS, lane);
    lily_tile_load_b(b1, &staged_b[b_row1 * LDS + kk], LDS, lane);
    for (uint m = 0; m < M_TILES; ++m) {
      lily_tile_a a;
      lily_tile_load_a(a, &staged_a[m * 16 * LDS + kk], LDS, lane);
      lily_tile_mma(acc[m][0], a, b0);
      lily_tile_mma(acc[m][1], a, b1);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

for (uint m = 0; m < M_TILES; ++m) {
  for (int e = 0; e < LILY_TILE_ACC_ELEMS; ++e) {
    uint r = m * 16 + uint(lily_tile_acc_row(e, lane));
    uint c = uint(lily_tile_acc_col(e, lane));
    uint dst = dst_row[r];
    if (dst != NO_ROW) {
      if (GATED) {
        // mlx-lm: swiglu(gate, up) = silu(gate) * up = gate * sigmoid(gate) * up,
        // each op's result rounded to bf16, on the bf16 projections.
        float gate = static_cast<float>(static_cast<bfloat16_t>(lily_tile_acc_get(acc[m][0], e)));
        float up = static_cast<float>(static_cast<bfloat16_t>(lily_tile_acc_get(acc[m][1], e)));
        float sig = static_cast<float>(static_cast<bfloat16_t>(1.0f / (1.0f + metal::exp(-gate))));
        float silu = static_cast<float>(static_cast<bfloat16_t>(gate * sig));
        out[dst * D_OUT + col0 + sg * 16 + c] = static_cast<bfloat16_t>(silu * up);
      } else {
        uint col = col0 + sg * 32 + c;
        out[dst * D_OUT + col] = static_cast<bfloat16_t>(lily_tile_acc_get(acc[m][0], e));
        out[dst * D_OUT + col + 16] = static_cast<bfloat16_t>(lily_tile_acc_get(acc[m][1], e));
      }
    }
  }
}
