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

// Staging: 16-byte moves of eight bf16 values between device memory,
// registers (a uint4) and threadgroup memory. Both addresses 16-byte aligned.
inline uint4 lily_tile_load16(const device bfloat16_t* src) {
  return *reinterpret_cast<const device uint4*>(src);
}
inline void lily_tile_store16(threadgroup bfloat16_t* dst, uint4 v) {
  *reinterpret_cast<threadgroup uint4*>(dst) = v;
}

// Two floats rounded to bf16 (to nearest even) in one word, `lo` in the low half.
inline uint lily_tile_bf16_bits(float x) {
  const uint bits = as_type<uint>(x);
  return (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
}
inline uint lily_tile_pack2(float lo, float hi) {
  return lily_tile_bf16_bits(lo) | (lily_tile_bf16_bits(hi) << 16);
}

// Element i in [0, 8) of eight bf16 values moved as a uint4 (the inverse of
// lily_tile_pack2's packing: element 2j in the low half of word j), as a float.
inline float lily_tile_unpack(uint4 w, int i) {
  const uint word = i < 2 ? w.x : (i < 4 ? w.y : (i < 6 ? w.z : w.w));
  return as_type<float>((i & 1) ? (word & 0xffff0000u) : (word << 16));
}

// The same staging for fp16 operands, and pack / unpack by element type:
// lily_tile_pack2_as<T> and lily_tile_unpack_as<T> for T = bfloat16_t (the
// functions above) or half, so that a body generic over its activation type T
// moves either in 16-byte words.
inline uint4 lily_tile_load16(const device half* src) {
  return *reinterpret_cast<const device uint4*>(src);
}
inline void lily_tile_store16(threadgroup half* dst, uint4 v) {
  *reinterpret_cast<threadgroup uint4*>(dst) = v;
}
template <typename T>
inline uint lily_tile_pack2_as(float lo, float hi);
template <>
inline uint lily_tile_pack2_as<bfloat16_t>(float lo, float hi) {
  return lily_tile_pack2(lo, hi);
}
template <>
inline uint lily_tile_pack2_as<half>(float lo, float hi) {
  return uint(as_type<ushort>(static_cast<half>(lo))) | (uint(as_type<ushort>(static_cast<half>(hi))) << 16);
}
template <typename T>
inline float lily_tile_unpack_as(uint4 w, int i);
template <>
inline float lily_tile_unpack_as<bfloat16_t>(uint4 w, int i) {
  return lily_tile_unpack(w, i);
}
template <>
inline float lily_tile_unpack_as<half>(uint4 w, int i) {
  const uint word = i < 2 ? w.x : (i < 4 ? w.y : (i < 6 ? w.z : w.w));
  return static_cast<float>(as_type<half>(ushort((i & 1) ? (word >> 16) : (word & 0xffffu))));
}
