// Lily's matrix tiles for CUDA: tensor-core mma.sync m16n8k16, bf16 operands,
// fp32 accumulators (sm_80 and later). Same names and meaning as tiles_metal.h;
// a 16x16 output tile is two m16n8 products. Operands sit in shared memory as
// bf16 and are read in 32-bit pairs straight into the fragment layout PTX
// documents for m16n8k16 (lane = 4 * group + thread_in_group).

#define LILY_TILE 16
#define LILY_TILE_ACC_ELEMS 8

// The prelude defines Metal's `device` address space away (an empty macro),
// which would also empty CUDA's __device__ (an attribute spelled with
// `device`): undefined here, defined again as the prelude has it at the end.
// (NVRTC, which MLX compiles with, ignores push_macro / pop_macro.)
#undef device

struct lily_tile_a {
  uint32_t r[4];  // rows g and g+8, k pairs 2t and 2t+8
};
struct lily_tile_b {
  uint32_t r[2][2];  // [column half][k pair 2t, 2t+8]
};
struct lily_tile_acc {
  float v[8];  // [column half][row g / g+8][column pair]
};

__device__ __forceinline__ uint32_t lily_tile_pair(const bfloat16_t* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}

__device__ __forceinline__ void lily_tile_acc_zero(lily_tile_acc& c) {
#pragma unroll
  for (int i = 0; i < LILY_TILE_ACC_ELEMS; ++i) c.v[i] = 0.0f;
}

// A[m][k] = p[m * ld + k], m and k in [0, 16).
__device__ __forceinline__ void lily_tile_load_a(lily_tile_a& a, const bfloat16_t* p, int ld,
                                                 uint lane) {
  const int g = int(lane >> 2), t = int(lane & 3u);
  a.r[0] = lily_tile_pair(p + g * ld + 2 * t);
  a.r[1] = lily_tile_pair(p + (g + 8) * ld + 2 * t);
  a.r[2] = lily_tile_pair(p + g * ld + 2 * t + 8);
  a.r[3] = lily_tile_pair(p + (g + 8) * ld + 2 * t + 8);
}

// B[k][n] = p[n * ld + k]: n-major, the layout of a weight matrix [out][in].
__device__ __forceinline__ void lily_tile_load_b(lily_tile_b& b, const bfloat16_t* p, int ld,
                                                 uint lane) {
  const int g = int(lane >> 2), t = int(lane & 3u);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const bfloat16_t* row = p + (h * 8 + g) * ld + 2 * t;
    b.r[h][0] = lily_tile_pair(row);
    b.r[h][1] = lily_tile_pair(row + 8);
  }
}

// c += a @ b
__device__ __forceinline__ void lily_tile_mma(lily_tile_acc& c, const lily_tile_a& a,
                                              const lily_tile_b& b) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float* d = c.v + 4 * h;
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a.r[0]), "r"(a.r[1]), "r"(a.r[2]), "r"(a.r[3]), "r"(b.r[h][0]), "r"(b.r[h][1]));
  }
}

// Element e in [0, LILY_TILE_ACC_ELEMS) of this lane's share of the tile.
__device__ __forceinline__ int lily_tile_acc_row(int e, uint lane) {
  return int(lane >> 2) + 8 * ((e >> 1) & 1);
}
__device__ __forceinline__ int lily_tile_acc_col(int e, uint lane) {
  return 8 * (e >> 2) + 2 * int(lane & 3u) + (e & 1);
}
__device__ __forceinline__ float lily_tile_acc_get(const lily_tile_acc& c, int e) {
  return c.v[e];
}
__device__ __forceinline__ void lily_tile_acc_set(lily_tile_acc& c, int e, float v) {
  c.v[e] = v;
}

// Staging: 16-byte moves of eight bf16 values between global memory,
// registers (a uint4) and shared memory. Both addresses 16-byte aligned.
__device__ __forceinline__ uint4 lily_tile_load16(const bfloat16_t* src) {
  return *reinterpret_cast<const uint4*>(src);
}
__device__ __forceinline__ void lily_tile_store16(bfloat16_t* dst, uint4 v) {
  *reinterpret_cast<uint4*>(dst) = v;
}

// Two floats rounded to bf16 (to nearest even) in one word, `lo` in the low half.
__device__ __forceinline__ uint lily_tile_pack2(float lo, float hi) {
  __nv_bfloat162 pair = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint*>(&pair);
}

// Element i in [0, 8) of eight bf16 values moved as a uint4 (the inverse of
// lily_tile_pack2's packing: element 2j in the low half of word j), as a float.
__device__ __forceinline__ float lily_tile_unpack(uint4 w, int i) {
  const uint word = i < 2 ? w.x : (i < 4 ? w.y : (i < 6 ? w.z : w.w));
  return __uint_as_float((i & 1) ? (word & 0xffff0000u) : (word << 16));
}

// The same staging for fp16 operands, and pack / unpack by element type:
// lily_tile_pack2_as<T> and lily_tile_unpack_as<T> for T = bfloat16_t (the
// functions above) or half, so that a body generic over its activation type T
// moves either in 16-byte words.
__device__ __forceinline__ uint4 lily_tile_load16(const half* src) {
  return *reinterpret_cast<const uint4*>(src);
}
__device__ __forceinline__ void lily_tile_store16(half* dst, uint4 v) {
  *reinterpret_cast<uint4*>(dst) = v;
}
template <typename T>
__device__ __forceinline__ uint lily_tile_pack2_as(float lo, float hi);
template <>
__device__ __forceinline__ uint lily_tile_pack2_as<__nv_bfloat16>(float lo, float hi) {
  return lily_tile_pack2(lo, hi);
}
template <>
__device__ __forceinline__ uint lily_tile_pack2_as<__half>(float lo, float hi) {
  __half2 pair = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint*>(&pair);
}
template <typename T>
__device__ __forceinline__ float lily_tile_unpack_as(uint4 w, int i);
template <>
__device__ __forceinline__ float lily_tile_unpack_as<__nv_bfloat16>(uint4 w, int i) {
  return lily_tile_unpack(w, i);
}
template <>
__device__ __forceinline__ float lily_tile_unpack_as<__half>(uint4 w, int i) {
  const uint word = i < 2 ? w.x : (i < 4 ? w.y : (i < 6 ? w.z : w.w));
  return __half2float(__ushort_as_half((unsigned short)((i & 1) ? (word >> 16) : (word & 0xffffu))));
}

#define device
