// C[M][N] = A[M][K] @ B[N][K]^T: bf16 operands, fp32 accumulation, T output.
//
// The tile layer's proof: a threadgroup owns a BM x BN block of C and walks K
// in steps of BK, staging A and B through threadgroup memory; its WM x WN SIMD
// groups each own a (BM / WM) x (BN / WN) sub-block, i.e. TM x TN 16x16 tiles
// multiplied with lily_tile_mma. Rows, columns and K are guarded, so any shape
// works; full tiles are the fast case.
//
// Template: T (output dtype), BM, BN, BK, WM, WN.
// Grid: (ceil(N / BN) * THREADS, ceil(M / BM), 1); threadgroup (THREADS, 1, 1)
// with THREADS = 32 * WM * WN.

constexpr int THREADS = 32 * WM * WN;
constexpr int PAD = 8;           // breaks shared-memory bank conflicts
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
const uint tid = thread_position_in_threadgroup.x;
const int row0 = int(threadgroup_position_in_grid.y) * BM;
const int col0 = int(threadgroup_position_in_grid.x) * BN;
const int sub_row = int(group_index / WN) * (BM / WM);
const int sub_col = int(group_index % WN) * (BN / WN);
const bfloat16_t zero = static_cast<bfloat16_t>(0.0f);

lily_tile_acc acc[TM][TN];
for (int i = 0; i < TM; ++i) {
  for (int j = 0; j < TN; ++j) {
    lily_tile_acc_zero(acc[i][j]);
  }
}

for (int k0 = 0; k0 < K; k0 += BK) {
  for (int at = int(tid); at < BM * BK; at += THREADS) {
    const int r = at / BK, k = at % BK;
    const bool inside = row0 + r < M && k0 + k < K;
    staged_a[r * LDS + k] = inside ? a[(row0 + r) * K + k0 + k] : zero;
  }
  for (int at = int(tid); at < BN * BK; at += THREADS) {
    const int n = at / BK, k = at % BK;
    const bool inside = col0 + n < N && k0 + k < K;
    staged_b[n * LDS + k] = inside ? b[(col0 + n) * K + k0 + k] : zero;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);

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
