// C[M][N] = A[M][K] @ B[N][K]^T: bf16 operands, fp32 accumulation, T output.
//
// The tile layer's proof: a threadgroup owns a BM x BN block of C and walks K
// in steps of BK, staging A and B through threadgroup memory in 16-byte
// chunks; its WM x WN SIMD groups each own a (BM / WM) x (BN / WN) sub-block,
// i.e. TM x TN 16x16 tiles multiplied with lily_tile_mma. The next K step's
// chunks are fetched into registers while the current one is multiplied, so
// global-memory latency hides behind the tensor work. Rows and columns are
// guarded; K must be a multiple of 8 (one chunk).
//
// Template: T (output dtype), BM, BN, BK, WM, WN.
// Grid: (ceil(N / BN) * THREADS, ceil(M / BM), 1); threadgroup (THREADS, 1, 1)
// with THREADS = 32 * WM * WN.

constexpr int THREADS = 32 * WM * WN;
constexpr int CHUNK = 8;                      // bf16 values per 16-byte move
constexpr int CHUNKS_PER_ROW = BK / CHUNK;
constexpr int CHUNKS_A = BM * CHUNKS_PER_ROW / THREADS;  // per thread
constexpr int CHUNKS_B = BN * CHUNKS_PER_ROW / THREADS;
constexpr int PAD = 8;           // breaks shared-memory bank conflicts, keeps 16-byte rows
constexpr int LDS = BK + PAD;    // row stride of both staged blocks
constexpr int TM = BM / WM / 16;
constexpr int TN = BN / WN / 16;

threadgroup bfloat16_t staged_a[BM * LDS];
threadgroup bfloat16_t staged_b[BN * LDS];

const int M = a_shape[0];
const int K = a_shape[1];
const int N = b_shape[0];
const uint lane = thread_index_in_simdgroup;
const uint group_index = simdgroup_index_in_threadgroup;
const int tid = int(thread_position_in_threadgroup.x);
const int row0 = int(threadgroup_position_in_grid.y) * BM;
const int col0 = int(threadgroup_position_in_grid.x) * BN;
const int sub_row = int(group_index / WN) * (BM / WM);
const int sub_col = int(group_index % WN) * (BN / WN);
const uint4 nothing = {0u, 0u, 0u, 0u};

lily_tile_acc acc[TM][TN];
for (int i = 0; i < TM; ++i) {
  for (int j = 0; j < TN; ++j) {
    lily_tile_acc_zero(acc[i][j]);
  }
}

// Chunk c of this thread covers row at / CHUNKS_PER_ROW, columns from
// (at % CHUNKS_PER_ROW) * CHUNK, with at = tid + c * THREADS.
uint4 next_a[CHUNKS_A];
uint4 next_b[CHUNKS_B];
for (int c = 0; c < CHUNKS_A; ++c) {
  const int at = tid + c * THREADS;
  const int r = row0 + at / CHUNKS_PER_ROW, k = (at % CHUNKS_PER_ROW) * CHUNK;
  next_a[c] = (r < M && k < K) ? lily_tile_load16(&a[r * K + k]) : nothing;
}
for (int c = 0; c < CHUNKS_B; ++c) {
  const int at = tid + c * THREADS;
  const int n = col0 + at / CHUNKS_PER_ROW, k = (at % CHUNKS_PER_ROW) * CHUNK;
  next_b[c] = (n < N && k < K) ? lily_tile_load16(&b[n * K + k]) : nothing;
}

for (int k0 = 0; k0 < K; k0 += BK) {
  for (int c = 0; c < CHUNKS_A; ++c) {
    const int at = tid + c * THREADS;
    lily_tile_store16(&staged_a[(at / CHUNKS_PER_ROW) * LDS + (at % CHUNKS_PER_ROW) * CHUNK], next_a[c]);
  }
  for (int c = 0; c < CHUNKS_B; ++c) {
    const int at = tid + c * THREADS;
    lily_tile_store16(&staged_b[(at / CHUNKS_PER_ROW) * LDS + (at % CHUNKS_PER_ROW) * CHUNK], next_b[c]);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

  // Fetch the next K step while this one is multiplied.
  const int k1 = k0 + BK;
  for (int c = 0; c < CHUNKS_A; ++c) {
    const int at = tid + c * THREADS;
    const int r = row0 + at / CHUNKS_PER_ROW, k = k1 + (at % CHUNKS_PER_ROW) * CHUNK;
    next_a[c] = (r < M && k < K) ? lily_tile_load16(&a[r * K + k]) : nothing;
  }
  for (int c = 0; c < CHUNKS_B; ++c) {
    const int at = tid + c * THREADS;
    const int n = col0 + at / CHUNKS_PER_ROW, k = k1 + (at % CHUNKS_PER_ROW) * CHUNK;
    next_b[c] = (n < N && k < K) ? lily_tile_load16(&b[n * K + k]) : nothing;
  }

  for (int kk = 0; kk < BK; kk += 16) {
    lily_tile_a tile_a[TM];
    lily_tile_b tile_b[TN];
    for (int i = 0; i < TM; ++i) {
      lily_tile_load_a(tile_a[i], &staged_a[(sub_row + i * 16) * LDS + kk], LDS, lane);
    }
    for (int j = 0; j < TN; ++j) {
      lily_tile_load_b(tile_b[j], &staged_b[(sub_col + j * 16) * LDS + kk], LDS, lane);
    }
    for (int i = 0; i < TM; ++i) {
      for (int j = 0; j < TN; ++j) {
        lily_tile_mma(acc[i][j], tile_a[i], tile_b[j]);
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

for (int i = 0; i < TM; ++i) {
  for (int j = 0; j < TN; ++j) {
    for (int e = 0; e < LILY_TILE_ACC_ELEMS; ++e) {
      const int r = row0 + sub_row + i * 16 + lily_tile_acc_row(e, lane);
      const int n = col0 + sub_col + j * 16 + lily_tile_acc_col(e, lane);
      if (r < M && n < N) {
        c[r * N + n] = static_cast<T>(lily_tile_acc_get(acc[i][j], e));
      }
    }
  }
}
