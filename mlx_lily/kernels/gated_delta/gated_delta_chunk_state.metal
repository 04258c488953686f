// Chunked gated delta rule, pass 2 of 3: the sequential pass over chunks that
// carries the state (see gated_delta_chunked.py). One threadgroup per
// (16-row slice of the state's Dv rows, value head, batch entry): the slices
// are independent, so a head's state is carried by Dv / 16 threadgroups at once.
//
// Per chunk, with S the slice [16, Dk] at the chunk's start:
//   D = U - W S^T             [C, 16]   (the values the rule writes)
//   S = gamma_C S + D^T Kd    [16, Dk]  (Kd: k decayed to the chunk's end)
// and S (bf16, for the output pass) and D^T go to device memory.
//
// The state stays in fp32 accumulator tiles for the whole call. As a tile
// operand it is split into bf16 hi + lo parts (S = hi + lo to ~2**-17), and
// W S^T is the two products' sum, so the state's own precision survives the
// bf16 operands; W, D and Kd are bf16 (W and Kd from pass 1, D rounded here
// once, as the output pass reads it too).
//
// The next operand block (Kd^T while D is multiplied, the next chunk's W,
// its U values and its total decay while the state is updated) is fetched
// into registers ahead of its use: a chunk waits on no load of its own.
//
// With CAPTURE the fp32 state at the start of the last chunk (after the
// call's last whole chunk when the call ends inside one) also goes out: a
// prefix-reuse checkpoint at a chunk boundary, with the bits a call cut
// there would have carried (docs/prefix-reuse.md).
//
// Template: Dk (a multiple of 64, <= 128), Dv (a multiple of 16), C (64),
//           HAS_STATE (false: the state starts at zero; state_in is a dummy),
//           CAPTURE (piece_state_out is written; absent otherwise),
//           ROW_LENGTHS (entry b has lengths[b] tokens, the prepare pass's
//           right-padded rows: its captured state is at the start of its own
//           last chunk; false: lengths is a dummy).
// Inputs:   w [B, Hv, Tp, Dk] bf16; u [B, Hv, Tp, Dv] fp32; kd [B, Hv, N, Dk, C]
//           bf16; gcum [B, Hv, Tp] fp32; state_in [B, Hv, Dv, Dk] fp32;
//           lengths [B] int32.
// Outputs:  d_out [B, Hv, N, Dv, C] bf16 (D^T per chunk); s0_out
//           [B, Hv, N, Dv, Dk] bf16 (the state at each chunk's start);
//           state_out [B, Hv, Dv, Dk] fp32; piece_state_out [B, Hv, Dv, Dk]
//           fp32 (CAPTURE only).
// Grid: (Dv / SLICE * THREADS, Hv, B); threadgroup (THREADS, 1, 1).

constexpr int THREADS = 128;
constexpr int GROUPS = THREADS / 32;
constexpr int SLICE = 16;             // state rows per threadgroup: one tile
constexpr int CHUNK8 = 8;             // bf16 values per 16-byte move
constexpr int LDW = Dk + 8;           // staged W: [C][LDW]
constexpr int LDK = C + 8;            // staged Kd^T: [Dk][LDK]; D^T: [SLICE][LDK]
constexpr int LDS = Dk + 8;           // the state's bf16 parts: [SLICE][LDS]
constexpr int STAGED = C * LDW > Dk * LDK ? C * LDW : Dk * LDK;
constexpr int W_MOVES = C * Dk / CHUNK8 / THREADS;   // 16-byte moves per thread
constexpr int K_MOVES = Dk * C / CHUNK8 / THREADS;
constexpr int STATE_TILES = Dk / 16 / GROUPS;        // state tiles per SIMD group

threadgroup bfloat16_t staged[STAGED];
threadgroup bfloat16_t s_hi[SLICE * LDS];
threadgroup bfloat16_t s_lo[SLICE * LDS];
threadgroup bfloat16_t d_t[SLICE * LDK];

const int tid = int(thread_position_in_threadgroup.x);
const uint lane = thread_index_in_simdgroup;
const int group = int(simdgroup_index_in_threadgroup);
const int dv0 = int(threadgroup_position_in_grid.x) * SLICE;
const int head = int(threadgroup_position_in_grid.y);
const int batch = int(threadgroup_position_in_grid.z);
const int padded = int(gcum_shape[2]);
const int n_chunks = padded / C;
// The chunk at whose start CAPTURE takes the state: the entry's last.
const int capture_at = ROW_LENGTHS ? (int(lengths[batch]) + C - 1) / C - 1 : n_chunks - 1;
const uint seq = uint(batch * int(gcum_shape[1]) + head);
const int dv_total = int(u_shape[3]);

// Group g keeps state tiles (rows dv0.., columns (g * STATE_TILES + i) * 16).
lily_tile_acc S[STATE_TILES];
for (int i = 0; i < STATE_TILES; ++i) {
  lily_tile_acc_zero(S[i]);
  if (HAS_STATE) {
    for (int e = 0; e < LILY_TILE_ACC_ELEMS; ++e) {
      const int r = dv0 + lily_tile_acc_row(e, lane);
      const int c = (group * STATE_TILES + i) * 16 + lily_tile_acc_col(e, lane);
      lily_tile_acc_set(S[i], e, state_in[(seq * uint(dv_total) + uint(r)) * uint(Dk) + uint(c)]);
    }
  }
}

// Move m of this thread covers row at / (width / 8), columns (at % (width / 8)) * 8.
uint4 next_w[W_MOVES];
uint4 next_k[K_MOVES];
for (int m = 0; m < W_MOVES; ++m) {
  const int at = tid + m * THREADS;
  const int r = at / (Dk / CHUNK8);
  const int cc = (at % (Dk / CHUNK8)) * CHUNK8;
  next_w[m] = lily_tile_load16(&w[(seq * uint(padded) + uint(r)) * uint(Dk) + uint(cc)]);
}
// This thread's U values of D's tile (rows group * 16.., columns of the
// slice) and the chunk's total decay, for chunk 0; then fetched a chunk ahead.
float next_u[LILY_TILE_ACC_ELEMS];
for (int e = 0; e < LILY_TILE_ACC_ELEMS; ++e) {
  const uint row = seq * uint(padded) + uint(group * 16 + lily_tile_acc_row(e, lane));
  next_u[e] = u[row * uint(dv_total) + uint(dv0 + lily_tile_acc_col(e, lane))];
}
float next_log_decay = gcum[seq * uint(padded) + uint(C - 1)];

for (int n = 0; n < n_chunks; ++n) {
  const uint chunk_at = seq * uint(n_chunks) + uint(n);
  float u_now[LILY_TILE_ACC_ELEMS];
  for (int e = 0; e < LILY_TILE_ACC_ELEMS; ++e) {
    u_now[e] = next_u[e];
  }
  const float log_decay = next_log_decay;
  if (CAPTURE && n == capture_at) {
    for (int i = 0; i < STATE_TILES; ++i) {
      for (int e = 0; e < LILY_TILE_ACC_ELEMS; ++e) {
        const int r = dv0 + lily_tile_acc_row(e, lane);
        const int c = (group * STATE_TILES + i) * 16 + lily_tile_acc_col(e, lane);
        piece_state_out[(seq * uint(dv_total) + uint(r)) * uint(Dk) + uint(c)] = lily_tile_acc_get(S[i], e);
      }
    }
  }
  // The state as bf16 hi + lo operands, and hi for the output pass.
  for (int i = 0; i < STATE_TILES; ++i) {
    for (int e = 0; e < LILY_TILE_ACC_ELEMS; ++e) {
      const int r = lily_tile_acc_row(e, lane);
      const int c = (group * STATE_TILES + i) * 16 + lily_tile_acc_col(e, lane);
      const float s = lily_tile_acc_get(S[i], e);
      const bfloat16_t hi = static_cast<bfloat16_t>(s);
      s_hi[r * LDS + c] = hi;
      s_lo[r * LDS + c] = static_cast<bfloat16_t>(s - static_cast<float>(hi));
      s0_out[(chunk_at * uint(dv_total) + uint(dv0 + r)) * uint(Dk) + uint(c)] = hi;
    }
  }
  for (int m = 0; m < W_MOVES; ++m) {
    const int at = tid + m * THREADS;
    lily_tile_store16(&staged[(at / (Dk / CHUNK8)) * LDW + (at % (Dk / CHUNK8)) * CHUNK8], next_w[m]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // Fetch Kd^T while D is multiplied.
  for (int m = 0; m < K_MOVES; ++m) {
    const int at = tid + m * THREADS;
    const int r = at / (C / CHUNK8);
    const int cc = (at % (C / CHUNK8)) * CHUNK8;
    next_k[m] = lily_tile_load16(&kd[(chunk_at * uint(Dk) + uint(r)) * uint(C) + uint(cc)]);
  }

  // D rows group * 16.. of this chunk: U - W S^T (W S^T = W hi^T + W lo^T).
  {
    lily_tile_acc ws;
    lily_tile_acc_zero(ws);
    for (int kk = 0; kk < Dk; kk += 16) {
      lily_tile_a ta;
      lily_tile_b tb;
      lily_tile_load_a(ta, &staged[group * 16 * LDW + kk], LDW, lane);
      lily_tile_load_b(tb, &s_hi[kk], LDS, lane);
      lily_tile_mma(ws, ta, tb);
      lily_tile_load_b(tb, &s_lo[kk], LDS, lane);
      lily_tile_mma(ws, ta, tb);
    }
    for (int e = 0; e < LILY_TILE_ACC_ELEMS; ++e) {
      const int t = group * 16 + lily_tile_acc_row(e, lane);
      const int c = lily_tile_acc_col(e, lane);
      const float d = u_now[e] - lily_tile_acc_get(ws, e);
      const bfloat16_t d16 = static_cast<bfloat16_t>(d);
      d_t[c * LDK + t] = d16;
      d_out[(chunk_at * uint(dv_total) + uint(dv0 + c)) * uint(C) + uint(t)] = d16;
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int m = 0; m < K_MOVES; ++m) {
    const int at = tid + m * THREADS;
    lily_tile_store16(&staged[(at / (C / CHUNK8)) * LDK + (at % (C / CHUNK8)) * CHUNK8], next_k[m]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // Fetch the next chunk's W while the state is updated.
  if (n + 1 < n_chunks) {
    for (int m = 0; m < W_MOVES; ++m) {
      const int at = tid + m * THREADS;
      const int r = at / (Dk / CHUNK8);
      const int cc = (at % (Dk / CHUNK8)) * CHUNK8;
      next_w[m] = lily_tile_load16(&w[(seq * uint(padded) + uint((n + 1) * C + r)) * uint(Dk) + uint(cc)]);
    }
    for (int e = 0; e < LILY_TILE_ACC_ELEMS; ++e) {
      const uint row = seq * uint(padded) + uint((n + 1) * C + group * 16 + lily_tile_acc_row(e, lane));
      next_u[e] = u[row * uint(dv_total) + uint(dv0 + lily_tile_acc_col(e, lane))];
    }
    next_log_decay = gcum[seq * uint(padded) + uint((n + 1) * C + C - 1)];
  }

  // S = gamma_C S + D^T Kd.
  const float decay_total = metal::precise::exp(log_decay);
  for (int i = 0; i < STATE_TILES; ++i) {
    for (int e = 0; e < LILY_TILE_ACC_ELEMS; ++e) {
      lily_tile_acc_set(S[i], e, lily_tile_acc_get(S[i], e) * decay_total);
    }
    for (int kk = 0; kk < C; kk += 16) {
      lily_tile_a ta;
      lily_tile_b tb;
      lily_tile_load_a(ta, &d_t[kk], LDK, lane);
      lily_tile_load_b(tb, &staged[(group * STATE_TILES + i) * 16 * LDK + kk], LDK, lane);
      lily_tile_mma(S[i], ta, tb);
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

for (int i = 0; i < STATE_TILES; ++i) {
  for (int e = 0; e < LILY_TILE_ACC_ELEMS; ++e) {
    const int r = dv0 + lily_tile_acc_row(e, lane);
    const int c = (group * STATE_TILES + i) * 16 + lily_tile_acc_col(e, lane);
    state_out[(seq * uint(dv_total) + uint(r)) * uint(Dk) + uint(c)] = lily_tile_acc_get(S[i], e);
  }
}
