// Lily's matrix tiles for Metal (and the CPU emulator, which gives Metal's
// simdgroup_matrix the same per-lane layout as Apple GPUs).
//
// One SIMD group multiplies 16x16 tiles with fp32 accumulation; a tile is a
// 2x2 block of 8x8 simdgroup matrices. Operands are bf16 in threadgroup memory
// and held as float matrices (every Apple GPU multiplies those), converted
// element by element on load, as MLX's own GEMMs do for bf16.
// The same names are defined for CUDA in tiles_cuda.h; bodies see only these.

#define LILY_TILE 16
#define LILY_TILE_ACC_ELEMS 8

struct lily_tile_a {
  simdgroup_matrix<float, 8, 8> m[2][2];  // [row half][k half]
};
struct lily_tile_b {
  simdgroup_matrix<float, 8, 8> m[2][2];  // [k half][column half]
};
struct lily_tile_acc {
  simdgroup_matrix<float, 8, 8> m[2][2];  // [row half][column half]
};

// Lane `lane` holds elements (row, col) and (row, col + 1) of each 8x8 matrix.
inline int lily_tile_lane_row(uint lane) {
  return int(((lane >> 2) & 4u) + ((lane >> 1) & 3u));
}
inline int lily_tile_lane_col(uint lane) {
  return int((((lane >> 2) & 2u) << 1) + ((lane & 1u) << 1));
}

inline void lily_tile_acc_zero(thread lily_tile_acc& c) {
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 2; ++j) {
      c.m[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
  }
}

// A[m][k] = p[m * ld + k], m and k in [0, 16).
inline void lily_tile_load_a(thread lily_tile_a& a, const threadgroup bfloat16_t* p, int ld,
                             uint lane) {
  const int r = lily_tile_lane_row(lane);
  const int c = lily_tile_lane_col(lane);
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 2; ++j) {
      const int at = (i * 8 + r) * ld + j * 8 + c;
      a.m[i][j].thread_elements()[0] = static_cast<float>(p[at]);
      a.m[i][j].thread_elements()[1] = static_cast<float>(p[at + 1]);
    }
  }
}

// B[k][n] = p[n * ld + k]: n-major, the layout of a weight matrix [out][in].
inline void lily_tile_load_b(thread lily_tile_b& b, const threadgroup bfloat16_t* p, int ld,
                             uint lane) {
  const int r = lily_tile_lane_row(lane);  // k within the 8x8 matrix
  const int c = lily_tile_lane_col(lane);  // n within the 8x8 matrix
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 2; ++j) {
      const int at = (j * 8 + c) * ld + i * 8 + r;
      b.m[i][j].thread_elements()[0] = static_cast<float>(p[at]);
      b.m[i][j].thread_elements()[1] = static_cast<float>(p[at + ld]);
    }
  }
}

// c += a @ b
inline void lily_tile_mma(thread lily_tile_acc& c, thread const lily_tile_a& a,
                          thread const lily_tile_b& b) {
  for (int i = 0; i < 2; ++i) {
    for (int j = 0; j < 2; ++j) {
      for (int k = 0; k < 2; ++k) {
        simdgroup_multiply_accumulate(c.m[i][j], a.m[i][k], b.m[k][j], c.m[i][j]);
      }
    }
  }
}

// Element e in [0, LILY_TILE_ACC_ELEMS) of this lane's share of the tile.
inline int lily_tile_acc_row(int e, uint lane) {
  return (e >> 2) * 8 + lily_tile_lane_row(lane);
}
inline int lily_tile_acc_col(int e, uint lane) {
  return ((e >> 1) & 1) * 8 + lily_tile_lane_col(lane) + (e & 1);
}
inline float lily_tile_acc_get(thread const lily_tile_acc& c, int e) {
  return c.m[e >> 2][(e >> 1) & 1].thread_elements()[e & 1];
}
inline void lily_tile_acc_set(thread lily_tile_acc& c, int e, float v) {
  c.m[e >> 2][(e >> 1) & 1].thread_elements()[e & 1] = v;
}
