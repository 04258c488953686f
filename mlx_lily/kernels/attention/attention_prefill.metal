// Prefill attention, flash style on matrix tiles: L queries (a prefill chunk)
// of the G query heads that share a KV head, against that head's S keys,
// causal within the chunk (query i sees keys j <= i + S - L) when CAUSAL.
//
// Launcher: mlx_lily/kernels/attention.py. A threadgroup owns BQ = 64 rows,
// packed GQA: row r is query position q0 + r / G of query head
// kv_head * G + r % G (QPOS = BQ / G positions), so every staged K/V tile
// serves all G heads. Its 8 SIMD groups split the work in 16x16 tiles: SIMD
// group w holds the queries of row tile w / 2 (D / 16 operand tiles, in
// registers) and the output of row tile w / 2, dims half w % 2 (D / 32 fp32
// accumulator tiles). Per step of BK = 32 keys:
//   1. K [BK][D] is staged as bf16 (16-byte moves); SIMD group w takes the
//      scores of its row tile and key tile w % 2, into threadgroup memory;
//   2. four threads per row take the online softmax in fp32 (running max and
//      sum per row), write P as bf16 and the row's rescale factor; meanwhile
//      V is staged transposed ([D][BK]: the n-major operand layout of P V);
//   3. each SIMD group rescales its output tiles and adds P V.
// K and V are read in place through their strides, 16 bytes at a time where
// the strides allow (as in attention_decode.metal).
//
// Template: D (head dim), G (query heads per KV head), BK (keys per step,
//           32), CAUSAL (bool).
// Inputs:   queries [1, Hq, L, D] bf16 (contiguous), keys, values [1, Hkv, S, D]
//           bf16 (strided), scale [1] float.
// Outputs:  out [1, Hq, L, D] bf16.
// Grid: (256 * ceil(L / QPOS), Hkv, 1), threadgroup (256, 1, 1).

constexpr int NW = 8;                        // SIMD groups
constexpr int THREADS = NW * 32;
constexpr int BQ = 64;                       // rows: 4 row tiles
constexpr int QPOS = BQ / G;                 // query positions per threadgroup
constexpr int CHUNK = 8;                     // bf16 per 16-byte move
constexpr int CHUNKS_PER_ROW = D / CHUNK;
constexpr int LDK = D + 8;                   // staged K rows (and Q rows, while loading)
// V^T rows padded by 4, not 8: at D = 256 that keeps the whole threadgroup
// memory within Metal's 32 KB (18 + 8 + 5 KB).
constexpr int LDV = BK + 4;
constexpr int LDP = BK + 8;                  // P rows
constexpr int KV_ROWS = BK > 32 ? BK : 32;    // K rows, or 32 query rows while loading
constexpr int KV_SIZE = KV_ROWS * LDK > D * LDV ? KV_ROWS * LDK : D * LDV;
constexpr int DT = D / 16;                   // tiles along the head dim
constexpr int KT = BK / 16;                  // tiles along a key step
constexpr int OT = DT / 2;                   // output tiles per SIMD group
constexpr int LANES_PER_ROW = THREADS / BQ;  // softmax threads per row: 4
constexpr int SPAN = BK / LANES_PER_ROW;     // scores per softmax thread: 8

threadgroup bfloat16_t staged_kv[KV_SIZE];
threadgroup float scores[BQ * BK];
threadgroup bfloat16_t probs[BQ * LDP];
threadgroup float row_scale[BQ];

const uint lane = thread_index_in_simdgroup;
const int sg = int(simdgroup_index_in_threadgroup);
const int tid = int(thread_index_in_threadgroup);
const int kv_head = int(threadgroup_position_in_grid.y);
const int q0 = int(threadgroup_position_in_grid.x) * QPOS;
const int L = int(queries_shape[2]);
const int S = int(keys_shape[2]);
const float s_scale = scale[0] * M_LOG2E_F;   // scores in the log2 domain
const uint4 nothing = {0u, 0u, 0u, 0u};

const int64_t k_row_stride = keys_strides[2];
const int64_t v_row_stride = values_strides[2];
const int64_t k_dim_stride = keys_strides[3];
const int64_t v_dim_stride = values_strides[3];
const device bfloat16_t* k_head = keys + int64_t(kv_head) * keys_strides[1];
const device bfloat16_t* v_head = values + int64_t(kv_head) * values_strides[1];
const bool rows_aligned = k_dim_stride == 1 && v_dim_stride == 1 && k_row_stride % CHUNK == 0 &&
                          v_row_stride % CHUNK == 0 && keys_strides[1] % CHUNK == 0 &&
                          values_strides[1] % CHUNK == 0;

// Row r of the threadgroup: (query position, query head); rows past the chunk
// or past QPOS * G compute on zero queries and store nothing.
// The last position this threadgroup holds bounds the keys it needs.
const int last_pos = min(L, q0 + QPOS) - 1;
const int k_stop = CAUSAL ? min(S, last_pos + S - L + 1) : S;

// This SIMD group's tiles: row tile (its 16 rows), key tile of the scores,
// first output dim tile.
const int row_tile = sg / 2;
const int key_tile = sg % 2;
const int dim_tile0 = (sg % 2) * OT;

// Queries: staged 32 rows at a time through staged_kv, then held as tiles.
lily_tile_a q_tiles[DT];
for (int half = 0; half < BQ / 32; ++half) {
  for (int at = tid; at < 32 * CHUNKS_PER_ROW; at += THREADS) {
    const int r = half * 32 + at / CHUNKS_PER_ROW;
    const int c = (at % CHUNKS_PER_ROW) * CHUNK;
    const int pos = q0 + r / G;
    const bool live = r < QPOS * G && pos < L;
    const int head = kv_head * G + r % G;
    const uint4 w = live ? lily_tile_load16(&queries[(int64_t(head) * L + pos) * D + c]) : nothing;
    lily_tile_store16(&staged_kv[(at / CHUNKS_PER_ROW) * LDK + c], w);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (row_tile / 2 == half) {
    for (int d = 0; d < DT; ++d) {
      lily_tile_load_a(q_tiles[d], &staged_kv[((row_tile % 2) * 16) * LDK + d * 16], LDK, lane);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

lily_tile_acc o_tiles[OT];
for (int d = 0; d < OT; ++d) {
  lily_tile_acc_zero(o_tiles[d]);
}

// The softmax threads: LANES_PER_ROW consecutive lanes per row, SPAN keys each.
const int my_row = tid / LANES_PER_ROW;
const int my_part = tid % LANES_PER_ROW;
const int my_pos = q0 + my_row / G;
const int my_limit = CAUSAL ? my_pos + S - L : S - 1;   // the last key this row sees
float run_max = -INFINITY;
float run_sum = 0.0f;

for (int k0 = 0; k0 < k_stop; k0 += BK) {
  // 1. Stage K and take S = Q K^T.
  for (int at = tid; at < BK * CHUNKS_PER_ROW; at += THREADS) {
    const int kk = at / CHUNKS_PER_ROW;
    const int c = (at % CHUNKS_PER_ROW) * CHUNK;
    const int key = k0 + kk;
    uint4 w = nothing;
    if (key < k_stop) {
      const device bfloat16_t* p = k_head + int64_t(key) * k_row_stride + c * k_dim_stride;
      if (rows_aligned) {
        w = lily_tile_load16(p);
      } else {
        w.x = lily_tile_pack2(static_cast<float>(p[0]), static_cast<float>(p[k_dim_stride]));
        w.y = lily_tile_pack2(static_cast<float>(p[2 * k_dim_stride]), static_cast<float>(p[3 * k_dim_stride]));
        w.z = lily_tile_pack2(static_cast<float>(p[4 * k_dim_stride]), static_cast<float>(p[5 * k_dim_stride]));
        w.w = lily_tile_pack2(static_cast<float>(p[6 * k_dim_stride]), static_cast<float>(p[7 * k_dim_stride]));
      }
    }
    lily_tile_store16(&staged_kv[kk * LDK + c], w);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  {
    lily_tile_acc s_tile;
    lily_tile_acc_zero(s_tile);
    for (int d = 0; d < DT; ++d) {
      lily_tile_b k_tile;
      lily_tile_load_b(k_tile, &staged_kv[(key_tile * 16) * LDK + d * 16], LDK, lane);
      lily_tile_mma(s_tile, q_tiles[d], k_tile);
    }
    for (int e = 0; e < LILY_TILE_ACC_ELEMS; ++e) {
      const int r = row_tile * 16 + lily_tile_acc_row(e, lane);
      scores[r * BK + key_tile * 16 + lily_tile_acc_col(e, lane)] = lily_tile_acc_get(s_tile, e);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 2. Stage V transposed, and the online softmax of this step's scores.
  for (int at = tid; at < BK * CHUNKS_PER_ROW; at += THREADS) {
    const int kk = at / CHUNKS_PER_ROW;
    const int c = (at % CHUNKS_PER_ROW) * CHUNK;
    const int key = k0 + kk;
    const device bfloat16_t* p = v_head + int64_t(key) * v_row_stride + c * v_dim_stride;
    const uint4 w = key < k_stop && rows_aligned ? lily_tile_load16(p) : nothing;
    for (int i = 0; i < CHUNK; ++i) {
      const float x = key >= k_stop ? 0.0f : (rows_aligned ? lily_tile_unpack(w, i)
                                                           : static_cast<float>(p[i * v_dim_stride]));
      staged_kv[(c + i) * LDV + kk] = static_cast<bfloat16_t>(x);
    }
  }
  float s[SPAN];
  float step_max = -INFINITY;
  for (int i = 0; i < SPAN; ++i) {
    const int key = k0 + my_part * SPAN + i;
    const bool seen = key <= my_limit && key < S;
    s[i] = seen ? scores[my_row * BK + my_part * SPAN + i] * s_scale : -INFINITY;
    step_max = max(step_max, s[i]);
  }
  for (int offset = 1; offset < LANES_PER_ROW; offset *= 2) {
    step_max = max(step_max, simd_shuffle_xor(step_max, ushort(offset)));
  }
  const float new_max = max(run_max, step_max);
  // A row that has seen no key yet keeps max -inf: its weights are all 0.
  const float base = new_max == -INFINITY ? 0.0f : new_max;
  const float rescale = exp2(run_max - base);
  float step_sum = 0.0f;
  for (int i = 0; i < SPAN; ++i) {
    const float p = exp2(s[i] - base);
    step_sum += p;
    probs[my_row * LDP + my_part * SPAN + i] = static_cast<bfloat16_t>(p);
  }
  for (int offset = 1; offset < LANES_PER_ROW; offset *= 2) {
    step_sum += simd_shuffle_xor(step_sum, ushort(offset));
  }
  run_sum = run_sum * rescale + step_sum;
  run_max = new_max;
  if (my_part == 0) {
    row_scale[my_row] = rescale;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // 3. O = O * rescale + P V.
  for (int d = 0; d < OT; ++d) {
    for (int e = 0; e < LILY_TILE_ACC_ELEMS; ++e) {
      const float f = row_scale[row_tile * 16 + lily_tile_acc_row(e, lane)];
      lily_tile_acc_set(o_tiles[d], e, lily_tile_acc_get(o_tiles[d], e) * f);
    }
  }
  for (int kk = 0; kk < KT; ++kk) {
    lily_tile_a p_tile;
    lily_tile_load_a(p_tile, &probs[(row_tile * 16) * LDP + kk * 16], LDP, lane);
    for (int d = 0; d < OT; ++d) {
      lily_tile_b v_tile;
      lily_tile_load_b(v_tile, &staged_kv[((dim_tile0 + d) * 16) * LDV + kk * 16], LDV, lane);
      lily_tile_mma(o_tiles[d], p_tile, v_tile);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// Normalise by each row's sum and store the rows this threadgroup owns.
if (my_part == 0) {
  row_scale[my_row] = run_sum > 0.0f ? 1.0f / run_sum : 0.0f;
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (int d = 0; d < OT; ++d) {
  for (int e = 0; e < LILY_TILE_ACC_ELEMS; ++e) {
    const int r = row_tile * 16 + lily_tile_acc_row(e, lane);
    const int pos = q0 + r / G;
    if (r < QPOS * G && pos < L) {
      const int head = kv_head * G + r % G;
      const int dim = (dim_tile0 + d) * 16 + lily_tile_acc_col(e, lane);
      const float v = lily_tile_acc_get(o_tiles[d], e) * row_scale[r];
      out[(int64_t(head) * L + pos) * D + dim] = static_cast<bfloat16_t>(v);
    }
  }
}
