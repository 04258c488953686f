// Chunked gated delta rule, pass 3 of 3: the outputs, all chunks in parallel
// (see gated_delta_chunked.py). One threadgroup per (chunk, value head, batch
// entry):
//
//   Y = diag(gamma) Q S_0^T + P D        [C, Dv]
//
// with S_0 the state at the chunk's start and D the values the rule wrote
// (both from pass 2, bf16), P the decayed causal Q K^T (pass 1, bf16) and
// gamma_t = exp(G_t). Products on lily's tiles, fp32 accumulation, y rounded
// once to its dtype.
//
// Template: InT (y's dtype), Dk (a multiple of 64), Dv (a multiple of 32,
//           <= 128), Hk, Hv, C (64).
// Inputs:   q [B, T, Hk, Dk] bf16; s0 [B, Hv, N, Dv, Dk] bf16; d [B, Hv, N,
//           Dv, C] bf16 (D^T); p [B, Hv, N, C, C] bf16; gcum [B, Hv, Tp] fp32.
// Outputs:  y [B, T, Hv, Dv] InT.
// Grid: (N * THREADS, Hv, B); threadgroup (THREADS, 1, 1).

constexpr int THREADS = 256;
constexpr int CHUNK8 = 8;              // bf16 values per 16-byte move
constexpr int KS = 64;                 // features per staged block of q and S_0
constexpr int LDS = KS + 8;            // row stride of every staged block (C == KS)
constexpr int TN = Dv / 32;            // output tiles per SIMD group
constexpr int QK_STEP = Hk * Dk;
constexpr int VALUE_HEADS_PER_KEY_HEAD = Hv / Hk;

threadgroup bfloat16_t tile_a[C * LDS];   // q block [C][KS], then P [C][C]
threadgroup bfloat16_t tile_b[Dv * LDS];  // S_0 block [Dv][KS], then D^T [Dv][C]

const int tid = int(thread_position_in_threadgroup.x);
const uint lane = thread_index_in_simdgroup;
const int group = int(simdgroup_index_in_threadgroup);
const int chunk = int(threadgroup_position_in_grid.x);
const int head = int(threadgroup_position_in_grid.y);
const int batch = int(threadgroup_position_in_grid.z);
const int n_tokens = int(q_shape[1]);
const int n_chunks = (n_tokens + C - 1) / C;
const int padded = n_chunks * C;
const int t0 = chunk * C;
const int key_head = head / VALUE_HEADS_PER_KEY_HEAD;
const uint seq = uint(batch * Hv + head);
const uint chunk_at = seq * uint(n_chunks) + uint(chunk);
const uint qk_base = uint(batch * n_tokens) * QK_STEP + uint(key_head * Dk);
const uint4 nothing = {0u, 0u, 0u, 0u};

// Group g owns tile row g % 4 and tile columns (g / 4) * TN + j.
const int out_row = (group % 4) * 16;
const int out_col = (group / 4) * TN * 16;
lily_tile_acc acc[TN];
for (int j = 0; j < TN; ++j) {
  lily_tile_acc_zero(acc[j]);
}

// Q S_0^T
for (int k0 = 0; k0 < Dk; k0 += KS) {
  for (int at = tid; at < C * KS / CHUNK8; at += THREADS) {
    const int r = at / (KS / CHUNK8);
    const int cc = (at % (KS / CHUNK8)) * CHUNK8;
    const bool live = t0 + r < n_tokens;
    lily_tile_store16(&tile_a[r * LDS + cc],
                      live ? lily_tile_load16(&q[qk_base + uint(t0 + r) * QK_STEP + uint(k0 + cc)]) : nothing);
  }
  for (int at = tid; at < Dv * KS / CHUNK8; at += THREADS) {
    const int r = at / (KS / CHUNK8);
    const int cc = (at % (KS / CHUNK8)) * CHUNK8;
    lily_tile_store16(&tile_b[r * LDS + cc], lily_tile_load16(&s0[(chunk_at * uint(Dv) + uint(r)) * uint(Dk) + uint(k0 + cc)]));
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int kk = 0; kk < KS; kk += 16) {
    lily_tile_a ta;
    lily_tile_load_a(ta, &tile_a[out_row * LDS + kk], LDS, lane);
    for (int j = 0; j < TN; ++j) {
      lily_tile_b tb;
      lily_tile_load_b(tb, &tile_b[(out_col + j * 16) * LDS + kk], LDS, lane);
      lily_tile_mma(acc[j], ta, tb);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// Rows scaled by gamma_t, then + P D.
for (int j = 0; j < TN; ++j) {
  for (int e = 0; e < LILY_TILE_ACC_ELEMS; ++e) {
    const int r = out_row + lily_tile_acc_row(e, lane);
    const float gamma = metal::precise::exp(gcum[seq * uint(padded) + uint(t0 + r)]);
    lily_tile_acc_set(acc[j], e, lily_tile_acc_get(acc[j], e) * gamma);
  }
}
for (int at = tid; at < C * C / CHUNK8; at += THREADS) {
  const int r = at / (C / CHUNK8);
  const int cc = (at % (C / CHUNK8)) * CHUNK8;
  lily_tile_store16(&tile_a[r * LDS + cc], lily_tile_load16(&p[chunk_at * uint(C * C) + uint(r * C + cc)]));
}
for (int at = tid; at < Dv * C / CHUNK8; at += THREADS) {
  const int r = at / (C / CHUNK8);
  const int cc = (at % (C / CHUNK8)) * CHUNK8;
  lily_tile_store16(&tile_b[r * LDS + cc], lily_tile_load16(&d[(chunk_at * uint(Dv) + uint(r)) * uint(C) + uint(cc)]));
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (int kk = 0; kk < C; kk += 16) {
  lily_tile_a ta;
  lily_tile_load_a(ta, &tile_a[out_row * LDS + kk], LDS, lane);
  for (int j = 0; j < TN; ++j) {
    lily_tile_b tb;
    lily_tile_load_b(tb, &tile_b[(out_col + j * 16) * LDS + kk], LDS, lane);
    lily_tile_mma(acc[j], ta, tb);
  }
}

for (int j = 0; j < TN; ++j) {
  for (int e = 0; e < LILY_TILE_ACC_ELEMS; ++e) {
    const int r = out_row + lily_tile_acc_row(e, lane);
    const int c = out_col + j * 16 + lily_tile_acc_col(e, lane);
    if (t0 + r < n_tokens) {
      y[(uint(batch * n_tokens + t0 + r) * Hv + uint(head)) * Dv + uint(c)] =
          static_cast<InT>(lily_tile_acc_get(acc[j], e));
    }
  }
}
