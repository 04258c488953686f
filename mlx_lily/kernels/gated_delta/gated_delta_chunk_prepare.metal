// Chunked gated delta rule, pass 1 of 3: everything inside a chunk that does
// not need the state (see gated_delta_chunked.py for the math). One
// threadgroup per (chunk, value head, batch entry), all chunks in parallel.
//
//   gates    log g_t and beta_t, as the sequential kernel rounds them; G_t the
//            cumulative log decay inside the chunk (gcum_out)
//   P        (Q K^T)[t, j] exp(G_t - G_j) for j <= t, else 0 (p_out, bf16)
//   L        beta_t (K K^T)[t, j] exp(G_t - G_j) for j < t
//   A        (I + L)^-1 by forward substitution, in fp32
//   W        A diag(beta gamma) K   (w_out, bf16)    gamma_j = exp(G_j)
//   U        A diag(beta) V         (u_out, fp32)
//   Kd^T     k_j exp(G_last - G_j), transposed [Dk][C] (kd_out, bf16): the
//            state pass's operand for S += D^T Kd
//
// Matrix products run on lily's tiles (bf16 operands, fp32 accumulators). The
// bf16 roundings: q, k and v arrive in bf16 (exact); A diag(beta gamma) and
// A diag(beta) are rounded to bf16 as operands (relative 2**-9), which is
// where W and U lose precision; the solve and U stay fp32.
//
// Threadgroup memory (C = 64, 256 threads): the solve's fp32 square, lower
// triangle A and upper triangle L^T (16.3 KiB with its padded rows), and two bf16 staging blocks
// reused across phases: under Metal's 32 KiB.
//
// Template: SumT, BetaT (the gates' rounding, as gated_delta.metal), Dk, Dv
//           (multiples of 32), Hk, Hv, C (the chunk, 64), ROW_LENGTHS (each
//           batch entry has its own length, lengths[b] <= T: the entries of
//           a right-padded batch; false: every entry has T tokens and
//           lengths is a dummy).
// Inputs:   q, k [B, T, Hk, Dk] bf16; v [B, T, Hv, Dv] bf16; a, b [B, T, Hv];
//           A_log, dt_bias [Hv]; lengths [B] int32.
// Outputs:  w_out [B, Hv, Tp, Dk] bf16; u_out [B, Hv, Tp, Dv] fp32;
//           kd_out [B, Hv, N, Dk, C] bf16; p_out [B, Hv, N, C, C] bf16;
//           gcum_out [B, Hv, Tp] fp32, with N = ceil(T / C), Tp = N C.
//           Tokens past T (past lengths[b]) count as k = v = q = 0, log g = 0,
//           beta = 0: an entry's chunks, and its state after them, are those
//           of the entry alone (a chunk wholly past its length leaves the
//           state as it was).
// Grid: (N * THREADS, Hv, B); threadgroup (THREADS, 1, 1).

constexpr int THREADS = 256;
constexpr int GROUPS = THREADS / 32;
constexpr int CHUNK8 = 8;          // bf16 values per 16-byte move
constexpr int KS = 32;             // feature columns per staged q/k block
constexpr int LDS = KS + 8;        // row stride of a staged q/k block
constexpr int LDT = C + 8;         // row stride of A' and of the transposed k/v blocks
// Row stride of the solve's square: odd, so that the lanes of one step, each
// reading L[t][j] = solve[j][t] for its own j, hit different banks (with a
// stride of C = 64 they all hit bank t % 32, one lane at a time).
constexpr int LDA = C + 1;
constexpr int QK_STEP = Hk * Dk;   // elements between tokens of q/k
constexpr int V_STEP = Hv * Dv;
constexpr int VALUE_HEADS_PER_KEY_HEAD = Hv / Hk;

threadgroup bfloat16_t tile_x[C * LDT];  // q block [C][LDS], then A' [C][LDT]
threadgroup bfloat16_t tile_y[C * LDS];  // k block [C][LDS], then k^T / v^T block [KS][LDT]
threadgroup float solve[C * LDA];        // lower: A (unit diagonal implied); upper: L^T
threadgroup float cum[C];                // G_t
threadgroup float beta_s[C];

const int tid = int(thread_position_in_threadgroup.x);
const uint lane = thread_index_in_simdgroup;
const int group = int(simdgroup_index_in_threadgroup);
const int chunk = int(threadgroup_position_in_grid.x);
const int head = int(threadgroup_position_in_grid.y);
const int batch = int(threadgroup_position_in_grid.z);
const int n_tokens = int(q_shape[1]);
// Tokens of this entry: the rest are padding, read as tokens past the end.
const int n_live = ROW_LENGTHS ? int(lengths[batch]) : n_tokens;
const int n_chunks = (n_tokens + C - 1) / C;
const int padded = n_chunks * C;
const int t0 = chunk * C;
const int key_head = head / VALUE_HEADS_PER_KEY_HEAD;
const uint seq = uint(batch * Hv + head);
const uint qk_base = uint(batch * n_tokens) * QK_STEP + uint(key_head * Dk);
const uint v_base = uint(batch * n_tokens) * V_STEP + uint(head * Dv);
const uint gate_base = uint(batch * n_tokens * Hv + head);
const uint4 nothing = {0u, 0u, 0u, 0u};

// -- gates: every SIMD group computes its 32 tokens' (groups 2.. repeat 0, 1)
{
  const int r = tid % C;
  const int t = t0 + r;
  const bool live = t < n_live;
  const uint at = gate_base + uint(live ? t : 0) * Hv;
  const float decay_rate = metal::precise::exp(static_cast<float>(A_log[head]));
  const float bias = static_cast<float>(dt_bias[head]);
  float x = static_cast<float>(static_cast<SumT>(static_cast<float>(a[at]) + bias));
  float e = static_cast<float>(static_cast<SumT>(metal::precise::exp(-metal::abs(x))));
  float w1 = 1.0f + e;
  float log1p_e = w1 == 1.0f ? e : metal::precise::log(w1) * (e / (w1 - 1.0f));
  log1p_e = static_cast<float>(static_cast<SumT>(log1p_e));
  float softplus = static_cast<float>(static_cast<SumT>(max(x, 0.0f) + log1p_e));
  float bx = static_cast<float>(b[at]);
  float exp_b = static_cast<float>(static_cast<BetaT>(metal::precise::exp(metal::abs(bx))));
  float sigmoid_neg = 1.0f / (1.0f + exp_b);
  float beta = bx < 0.0f ? sigmoid_neg : 1.0f - sigmoid_neg;
  beta = static_cast<float>(static_cast<BetaT>(beta));
  const float log_g = live ? -decay_rate * softplus : 0.0f;
  const float running = simd_prefix_inclusive_sum(log_g);
  if (tid < C) {
    cum[tid] = running;
    beta_s[tid] = live ? beta : 0.0f;
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (tid >= 32 && tid < C) {
  cum[tid] += cum[31];
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (tid < C) {
  gcum_out[seq * uint(padded) + uint(t0 + tid)] = cum[tid];
}

// -- Q K^T and K K^T: group g owns tile row g / 2, tile columns 2 (g % 2) + {0, 1}
const int tile_row = (group / 2) * 16;
const int tile_col = (group % 2) * 32;
lily_tile_acc acc_qk[2];
lily_tile_acc acc_kk[2];
for (int j = 0; j < 2; ++j) {
  lily_tile_acc_zero(acc_qk[j]);
  lily_tile_acc_zero(acc_kk[j]);
}
for (int k0 = 0; k0 < Dk; k0 += KS) {
  {
    // One 16-byte chunk of q and of k per thread: C rows x KS columns.
    const int r = tid / (KS / CHUNK8);
    const int cc = (tid % (KS / CHUNK8)) * CHUNK8;
    const bool live = t0 + r < n_live;
    const uint at = qk_base + uint(t0 + r) * QK_STEP + uint(k0 + cc);
    lily_tile_store16(&tile_x[r * LDS + cc], live ? lily_tile_load16(&q[at]) : nothing);
    lily_tile_store16(&tile_y[r * LDS + cc], live ? lily_tile_load16(&k[at]) : nothing);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int kk = 0; kk < KS; kk += 16) {
    lily_tile_a tq;
    lily_tile_a tk;
    lily_tile_load_a(tq, &tile_x[tile_row * LDS + kk], LDS, lane);
    lily_tile_load_a(tk, &tile_y[tile_row * LDS + kk], LDS, lane);
    for (int j = 0; j < 2; ++j) {
      lily_tile_b tb;
      lily_tile_load_b(tb, &tile_y[(tile_col + j * 16) * LDS + kk], LDS, lane);
      lily_tile_mma(acc_qk[j], tq, tb);
      lily_tile_mma(acc_kk[j], tk, tb);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// P to device; L^T into the solve's upper triangle.
const uint p_base = (seq * uint(n_chunks) + uint(chunk)) * uint(C * C);
for (int j = 0; j < 2; ++j) {
  for (int e = 0; e < LILY_TILE_ACC_ELEMS; ++e) {
    const int r = tile_row + lily_tile_acc_row(e, lane);
    const int c = tile_col + j * 16 + lily_tile_acc_col(e, lane);
    const float decay = c <= r ? metal::precise::exp(cum[r] - cum[c]) : 0.0f;
    p_out[p_base + uint(r * C + c)] = static_cast<bfloat16_t>(lily_tile_acc_get(acc_qk[j], e) * decay);
    if (c < r) {
      solve[c * LDA + r] = beta_s[r] * decay * lily_tile_acc_get(acc_kk[j], e);
    }
  }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// -- A = (I + L)^-1, row by row: A[t][c] = -(L[t][c] + sum_{c<j<t} L[t][j] A[j][c]).
// Four threads per column c split the sum over j and meet by shuffles.
{
  const int col = tid / 4;
  const int part = tid % 4;
  for (int t = 1; t < C; ++t) {
    float s = 0.0f;
    if (col < t) {
      for (int j = col + 1 + part; j < t; j += 4) {
        s += solve[j * LDA + t] * solve[j * LDA + col];
      }
    }
    s += simd_shuffle_xor(s, 1);
    s += simd_shuffle_xor(s, 2);
    if (col < t && part == 0) {
      solve[t * LDA + col] = -(solve[col * LDA + t] + s);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}

// -- W = A diag(beta gamma) K, then U = A diag(beta) V, in column blocks of KS.
// Group g owns the output tile (row g / 2, column g % 2) of each block.
const int out_row = (group / 2) * 16;
const int out_col = (group % 2) * 16;
const uint kd_base = (seq * uint(n_chunks) + uint(chunk)) * uint(Dk * C);
for (int pass = 0; pass < 2; ++pass) {
  const bool for_w = pass == 0;
  // A' = A diag(beta gamma) (pass 0) or A diag(beta) (pass 1), in bf16.
  for (int i = tid; i < C * C; i += THREADS) {
    const int r = i / C;
    const int c = i % C;
    const float a_rc = c < r ? solve[r * LDA + c] : (c == r ? 1.0f : 0.0f);
    const float scale = for_w ? beta_s[c] * metal::precise::exp(cum[c]) : beta_s[c];
    tile_x[r * LDT + c] = static_cast<bfloat16_t>(a_rc * scale);
  }
  const int width = for_w ? Dk : Dv;
  for (int d0 = 0; d0 < width; d0 += KS) {
    // The block's k (or v) transposed: [KS features][C tokens]. Lanes read
    // one token's features side by side (a SIMD group reads whole rows).
    for (int i = tid; i < KS * C; i += THREADS) {
      const int d = i % KS;
      const int r = i / KS;
      const bool live = t0 + r < n_live;
      float x = 0.0f;
      if (live) {
        x = for_w ? static_cast<float>(k[qk_base + uint(t0 + r) * QK_STEP + uint(d0 + d)])
                  : static_cast<float>(v[v_base + uint(t0 + r) * V_STEP + uint(d0 + d)]);
      }
      tile_y[d * LDT + r] = static_cast<bfloat16_t>(x);
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (for_w) {
      // Kd^T from the staged block (k exactly, as bf16), lanes along tokens:
      // whole rows of kd_out per SIMD group.
      for (int i = tid; i < KS * C; i += THREADS) {
        const int r = i % C;
        const int d = i / C;
        kd_out[kd_base + uint((d0 + d) * C + r)] = static_cast<bfloat16_t>(
            static_cast<float>(tile_y[d * LDT + r]) * metal::precise::exp(cum[C - 1] - cum[r]));
      }
    }
    lily_tile_acc acc;
    lily_tile_acc_zero(acc);
    for (int kk = 0; kk < C; kk += 16) {
      lily_tile_a ta;
      lily_tile_b tb;
      lily_tile_load_a(ta, &tile_x[out_row * LDT + kk], LDT, lane);
      lily_tile_load_b(tb, &tile_y[out_col * LDT + kk], LDT, lane);
      lily_tile_mma(acc, ta, tb);
    }
    for (int e = 0; e < LILY_TILE_ACC_ELEMS; ++e) {
      const int r = out_row + lily_tile_acc_row(e, lane);
      const int c = d0 + out_col + lily_tile_acc_col(e, lane);
      const uint row = seq * uint(padded) + uint(t0 + r);
      if (for_w) {
        w_out[row * uint(Dk) + uint(c)] = static_cast<bfloat16_t>(lily_tile_acc_get(acc, e));
      } else {
        u_out[row * uint(Dv) + uint(c)] = lily_tile_acc_get(acc, e);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
}
