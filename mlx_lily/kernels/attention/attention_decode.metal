// Decode attention, packed GQA: one query token of G query heads that share
// a KV head, against keys [k_begin, k_end) of that head's cache, online
// softmax in fp32.
//
// Launcher: mlx_lily/kernels/attention/sdpa.py. A threadgroup serves one KV head
// and all G query heads on it, so each K/V row is read once for all of them.
// A SIMD group reads whole rows: lane l holds eight dims ([col, col + 8)) of
// one row in a 16-byte load, LANES_PER_ROW = D / 8 lanes cover a row and a
// SIMD group reads ROWS_PER_PASS rows at once (1, 2 or 4 for D = 256, 128,
// 64). The SIMD groups take passes in turn and keep their own running max,
// sum and accumulator per query head; at the end they are merged through
// threadgroup memory.
//
// Without SPLIT one threadgroup covers all keys and writes the output. With
// SPLIT threadgroup b covers keys [b * BLOCK, (b + 1) * BLOCK) and writes its
// normalised partial output and log2-sum-exp2 (part_o, part_lse), which
// attention_combine.metal merges. A block that sees no key writes lse -inf.
//
// BATCHED (server decode, rows of a left-padded batch cache): grid z is the
// row; row r's keys are [start[r], end_r) of its view, end_r = length[r] with
// ROW_ENDS, else length[0]. Everything a row computes is a function of its own
// span only, so its bits do not depend on the batch, the other rows, the
// view's capacity or where the span sits: its key blocks start at start[r],
// and their size follows the span's length n alone: one block below
// SPLIT_FROM_KEYS keys, else MIN_BLOCK doubled (up to BLOCK) until the row's
// blocks times the KV heads fit SPLIT_TGS. Threadgroups past a row's blocks
// see no key. A launch without SPLIT (capacity below SPLIT_FROM_KEYS) runs
// the one-block form, whose output the combine of one block reproduces.
//
// K and V are read in place through their strides (a slice of a larger KV
// cache, as mlx-lm's KVCache hands it over), 16 bytes at a time where the
// strides allow; the view itself must start 16-byte aligned, as MLX's buffers
// and slices along the sequence or head axes do.
//
// GATED (the layer's output gate, applied where the output is written: once
// an element, where the output projection's prologue would compute it once a
// threadgroup): without SPLIT each output element is rounded to T, then
// multiplied by sigmoid(gate) computed in T as that prologue computed it
// (exp rounded to T, then 1 / (1 + e) or 1 minus that, rounded to T) and
// rounded again: the prologue's bits. With SPLIT the combine applies it.
//
// Template: T (the activations' dtype: bfloat16 or float16), D (head dim), G
//           (query heads per KV head), NSG (SIMD groups per
//           threadgroup), SPLIT (bool), BLOCK (keys per threadgroup when SPLIT;
//           BATCHED: the largest), BOUNDED (bool: the length input bounds the
//           keys), BATCHED (bool), ROW_ENDS (bool), SPLIT_FROM_KEYS, MIN_BLOCK,
//           SPLIT_TGS (BATCHED: a row's block size, above), PREFETCH (passes
//           fetched ahead, at least 1), GATED (bool).
// Inputs:   queries [B * Hq, D] T (contiguous), keys, values [B, Hkv, S, D] T
//           (strided), scale [1] float (the softmax scale), length [1] or [B]
//           int32 (with BOUNDED: the keys end at row length of the view; left
//           out of unbounded launches), start [B] int32 (BATCHED: where each
//           row's keys begin; left out otherwise), gate [B, 1, Hq, D] T
//           (strided; read with GATED, left out of other launches). B is 1 unless
//           BATCHED or rows of one view.
// Outputs:  out [B * Hq, D] T (without SPLIT), part_o [B * Hq, NB, D] float and
//           part_lse [B * Hq, NB] float (with SPLIT); the unused ones have one element.
// Grid: (NSG * 32 * NB, Hkv, B), threadgroup (NSG * 32, 1, 1).

constexpr int SIMD_WIDTH = 32;
constexpr int CHUNK = 8;                               // T values per 16-byte load
constexpr int LANES_PER_ROW = D / CHUNK;
constexpr int ROWS_PER_PASS = SIMD_WIDTH / LANES_PER_ROW;
constexpr int THREADS = NSG * SIMD_WIDTH;

threadgroup float group_max[NSG * G];
threadgroup float group_sum[NSG * G];
threadgroup float group_acc[NSG * D];

const uint lane = thread_index_in_simdgroup;
const int sg = int(simdgroup_index_in_threadgroup);
const int tid = int(thread_index_in_threadgroup);
const int kv_head = int(threadgroup_position_in_grid.y);
const int block = int(threadgroup_position_in_grid.x);
const int n_blocks = int(threadgroups_per_grid.x);
const int kv_heads = int(threadgroups_per_grid.y);
const int batch_row = int(threadgroup_position_in_grid.z);
// BOUNDED: only the first length[0] rows of the view are keys (a cache of
// fixed capacity, filled to a length known on the device); blocks past it
// see no key.
const int S = BOUNDED ? min(int(keys_shape[2]), int(length[ROW_ENDS ? batch_row : 0])) : int(keys_shape[2]);
const int span_begin = BATCHED ? min(int(start[batch_row]), S) : 0;
const int span = S - span_begin;
// BATCHED: the row's block size, from its span alone (without SPLIT the grid
// has one block, the whole span).
int row_block = span;
if (BATCHED && SPLIT && span >= SPLIT_FROM_KEYS) {
  row_block = MIN_BLOCK;
  while (row_block < BLOCK && (span + row_block - 1) / row_block * kv_heads > SPLIT_TGS) {
    row_block *= 2;
  }
}
const int block_keys = BATCHED ? row_block : BLOCK;
const int k_begin = SPLIT ? min(S, span_begin + block * block_keys) : span_begin;
const int k_end = SPLIT ? min(S, k_begin + block_keys) : S;
const int sub = int(lane) / LANES_PER_ROW;             // this lane's row in a pass
const int col = (int(lane) % LANES_PER_ROW) * CHUNK;   // this lane's first dim
const uint4 nothing = {0u, 0u, 0u, 0u};

const int64_t k_row_stride = keys_strides[2];
const int64_t v_row_stride = values_strides[2];
const int64_t k_dim_stride = keys_strides[3];
const int64_t v_dim_stride = values_strides[3];
const device T* k_head = keys + int64_t(batch_row) * keys_strides[0] + int64_t(kv_head) * keys_strides[1] +
                         col * k_dim_stride;
const device T* v_head = values + int64_t(batch_row) * values_strides[0] +
                         int64_t(kv_head) * values_strides[1] + col * v_dim_stride;
// 16-byte row loads need dims contiguous and every row start a multiple of 8
// elements from the (aligned) start of the view; other layouts (a transposed
// view, say) are read element by element.
const bool rows_aligned = k_dim_stride == 1 && v_dim_stride == 1 && k_row_stride % CHUNK == 0 &&
                          v_row_stride % CHUNK == 0 && keys_strides[1] % CHUNK == 0 &&
                          values_strides[1] % CHUNK == 0 && keys_strides[0] % CHUNK == 0 &&
                          values_strides[0] % CHUNK == 0;

// Query heads of this row: [first_head, first_head + G) of the B * Hq.
const int first_head = (batch_row * kv_heads + kv_head) * G;

// Queries scaled into the log2 domain as they are used (softmax(s) =
// exp2(s * log2(e) - m)): kept as loaded, four words a head, not eight fp32
// values, so that the registers go to keys and values in flight instead.
const float q_scale = scale[0] * M_LOG2E_F;
uint4 q_words[G];
for (int g = 0; g < G; ++g) {
  q_words[g] = lily_tile_load16(&queries[(first_head + g) * D + col]);
}

float run_max[G];
float run_sum[G];
float acc[G][CHUNK];
for (int g = 0; g < G; ++g) {
  run_max[g] = -INFINITY;
  run_sum[g] = 0.0f;
  for (int e = 0; e < CHUNK; ++e) {
    acc[g][e] = 0.0f;
  }
}

// Every lane of a SIMD group runs the same passes (the shuffles need all 32);
// lanes past k_end load nothing and skip the update. A pass's rows are
// fetched PREFETCH passes before it is scored (the launcher's choice: more
// passes in flight hide more of the memory's latency, for registers), so a
// SIMD group always has that many passes' loads in flight while it
// computes. The order of a row's scores and updates is the same whatever
// PREFETCH is, and so are the bits.
const int first = k_begin + sg * ROWS_PER_PASS;
const int step = NSG * ROWS_PER_PASS;
uint4 ahead_kw[PREFETCH];
uint4 ahead_vw[PREFETCH];
for (int a = 0; a < PREFETCH; ++a) {
  ahead_kw[a] = nothing;
  ahead_vw[a] = nothing;
}
// The first PREFETCH iterations only fetch.
for (int base = first - PREFETCH * step; base < k_end; base += step) {
  const int row = base + sub;
  const bool live = base >= first && row < k_end;
  const uint4 kw = ahead_kw[0];
  const uint4 vw = ahead_vw[0];
  // The ring moves down a pass (constant indices: the words stay in
  // registers), and the pass PREFETCH ahead takes its last place.
  for (int a = 0; a + 1 < PREFETCH; ++a) {
    ahead_kw[a] = ahead_kw[a + 1];
    ahead_vw[a] = ahead_vw[a + 1];
  }
  const int fetch = row + PREFETCH * step;
  const device T* k_row = k_head + int64_t(fetch) * k_row_stride;
  const device T* v_row = v_head + int64_t(fetch) * v_row_stride;
  uint4 next_kw = nothing;
  uint4 next_vw = nothing;
  if (fetch < k_end && rows_aligned) {
    next_kw = lily_tile_load16(k_row);
    next_vw = lily_tile_load16(v_row);
  } else if (fetch < k_end) {
    next_kw.x = lily_tile_pack2_as<T>(static_cast<float>(k_row[0]), static_cast<float>(k_row[k_dim_stride]));
    next_kw.y = lily_tile_pack2_as<T>(static_cast<float>(k_row[2 * k_dim_stride]), static_cast<float>(k_row[3 * k_dim_stride]));
    next_kw.z = lily_tile_pack2_as<T>(static_cast<float>(k_row[4 * k_dim_stride]), static_cast<float>(k_row[5 * k_dim_stride]));
    next_kw.w = lily_tile_pack2_as<T>(static_cast<float>(k_row[6 * k_dim_stride]), static_cast<float>(k_row[7 * k_dim_stride]));
    next_vw.x = lily_tile_pack2_as<T>(static_cast<float>(v_row[0]), static_cast<float>(v_row[v_dim_stride]));
    next_vw.y = lily_tile_pack2_as<T>(static_cast<float>(v_row[2 * v_dim_stride]), static_cast<float>(v_row[3 * v_dim_stride]));
    next_vw.z = lily_tile_pack2_as<T>(static_cast<float>(v_row[4 * v_dim_stride]), static_cast<float>(v_row[5 * v_dim_stride]));
    next_vw.w = lily_tile_pack2_as<T>(static_cast<float>(v_row[6 * v_dim_stride]), static_cast<float>(v_row[7 * v_dim_stride]));
  }
  ahead_kw[PREFETCH - 1] = next_kw;
  ahead_vw[PREFETCH - 1] = next_vw;
  if (base < first) {
    continue;
  }
  float k[CHUNK];
  for (int e = 0; e < CHUNK; ++e) {
    k[e] = lily_tile_unpack_as<T>(kw, e);
  }
  float s[G];
  for (int g = 0; g < G; ++g) {
    float dot = 0.0f;
    for (int e = 0; e < CHUNK; ++e) {
      dot = fma(lily_tile_unpack_as<T>(q_words[g], e) * q_scale, k[e], dot);
    }
    for (int offset = LANES_PER_ROW / 2; offset > 0; offset /= 2) {
      dot += simd_shuffle_xor(dot, ushort(offset));
    }
    s[g] = dot;
  }
  if (live) {
    float v[CHUNK];
    for (int e = 0; e < CHUNK; ++e) {
      v[e] = lily_tile_unpack_as<T>(vw, e);
    }
    for (int g = 0; g < G; ++g) {
      const float new_max = max(run_max[g], s[g]);
      const float keep = exp2(run_max[g] - new_max);  // 0 while run_max is -inf
      const float p = exp2(s[g] - new_max);
      run_sum[g] = run_sum[g] * keep + p;
      for (int e = 0; e < CHUNK; ++e) {
        acc[g][e] = fma(p, v[e], acc[g][e] * keep);
      }
      run_max[g] = new_max;
    }
  }
}

// Merge the rows of a pass: lanes holding the same dims, LANES_PER_ROW apart.
// A side that saw no key has max -inf and sum 0, and weighs 0.
for (int offset = LANES_PER_ROW; offset < SIMD_WIDTH; offset *= 2) {
  for (int g = 0; g < G; ++g) {
    const float other_max = simd_shuffle_xor(run_max[g], ushort(offset));
    const float other_sum = simd_shuffle_xor(run_sum[g], ushort(offset));
    const float new_max = max(run_max[g], other_max);
    const float mine = run_max[g] == -INFINITY ? 0.0f : exp2(run_max[g] - new_max);
    const float theirs = other_max == -INFINITY ? 0.0f : exp2(other_max - new_max);
    run_sum[g] = run_sum[g] * mine + other_sum * theirs;
    for (int e = 0; e < CHUNK; ++e) {
      const float other_acc = simd_shuffle_xor(acc[g][e], ushort(offset));
      acc[g][e] = acc[g][e] * mine + other_acc * theirs;
    }
    run_max[g] = new_max;
  }
}

// Merge the SIMD groups: the threadgroup's max and sum per query head, then
// each head's accumulator, summed over SIMD groups one head at a time.
if (lane == 0) {
  for (int g = 0; g < G; ++g) {
    group_max[sg * G + g] = run_max[g];
    group_sum[sg * G + g] = run_sum[g];
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

for (int g = 0; g < G; ++g) {
  float total_max = -INFINITY;
  for (int i = 0; i < NSG; ++i) {
    total_max = max(total_max, group_max[i * G + g]);
  }
  float total_sum = 0.0f;
  for (int i = 0; i < NSG; ++i) {
    const float m = group_max[i * G + g];
    total_sum += m == -INFINITY ? 0.0f : group_sum[i * G + g] * exp2(m - total_max);
  }
  // Head g's registers are always the first: they shift down one head per
  // round (below), since a loop with barriers may stay rolled and indexing
  // registers with its counter would move them to memory.
  const float mine = run_max[0] == -INFINITY ? 0.0f : exp2(run_max[0] - total_max);
  if (sub == 0) {
    for (int e = 0; e < CHUNK; ++e) {
      group_acc[sg * D + col + e] = acc[0][e] * mine;
    }
  }
  for (int h = 0; h + 1 < G; ++h) {
    run_max[h] = run_max[h + 1];
    for (int e = 0; e < CHUNK; ++e) {
      acc[h][e] = acc[h + 1][e];
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  const int head = first_head + g;
  for (int d = tid; d < D; d += THREADS) {
    float total = 0.0f;
    for (int i = 0; i < NSG; ++i) {
      total += group_acc[i * D + d];
    }
    if (SPLIT) {
      // A block that saw no key (past a bounded length) has sum 0: it writes
      // 0, which the combine weighs by exp2(-inf) = 0, not 0 / 0.
      part_o[(head * n_blocks + block) * D + d] = total_sum > 0.0f ? total / total_sum : 0.0f;
    } else if (GATED) {
      const int q_head = kv_head * G + g;  // within the row
      const float gx = static_cast<float>(gate[int64_t(batch_row) * gate_strides[0] +
                                               int64_t(q_head) * gate_strides[2] + int64_t(d) * gate_strides[3]]);
      const float gate_exp = static_cast<float>(static_cast<T>(metal::precise::exp(metal::abs(gx))));
      const float sigmoid_neg = 1.0f / (1.0f + gate_exp);
      const float sig = static_cast<float>(static_cast<T>(gx < 0.0f ? sigmoid_neg : 1.0f - sigmoid_neg));
      out[head * D + d] = static_cast<T>(static_cast<float>(static_cast<T>(total / total_sum)) * sig);
    } else {
      out[head * D + d] = static_cast<T>(total / total_sum);
    }
  }
  if (SPLIT && tid == 0) {
    // -inf, not log2(0), for a block with no key: the combine skips those.
    part_lse[head * n_blocks + block] = total_sum > 0.0f ? total_max + log2(total_sum) : -INFINITY;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}
