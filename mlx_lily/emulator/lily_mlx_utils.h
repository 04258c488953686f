// The names MLX prepends to every custom kernel (its Metal `utils.h` and
// `defines.h`), so that bodies written against them compile here too:
// elem_to_loc and its fixed-rank variants, ceildiv, Limits<T>, cast_to,
// ConditionalType, WorkPerThread, MLX_MTL_PRAGMA_UNROLL, the N_READS
// constants. (float16_t and log1p come from the scalar and math headers.)
#pragma once

#include "lily_memory.h"

// Offset of element `elem` (row-major index) of an array with the given
// shape and strides.
template <typename IdxT = int64_t>
LILY_INLINE IdxT elem_to_loc(IdxT elem, lily::cptr<int> shape,
                             lily::cptr<int64_t> strides, int ndim) {
  IdxT loc = 0;
  for (int i = ndim - 1; i >= 0 && elem > 0; --i) {
    loc += IdxT(elem % shape[i]) * IdxT(strides[i]);
    elem /= shape[i];
  }
  return loc;
}

// Same for a 3-D thread position: x and y index the last two axes, z the rest.
template <typename IdxT = int64_t>
LILY_INLINE IdxT elem_to_loc(uint3 elem, lily::cptr<int> shape,
                             lily::cptr<int64_t> strides, int ndim) {
  IdxT loc = IdxT(elem.x) * IdxT(strides[ndim - 1]) +
             IdxT(elem.y) * IdxT(strides[ndim - 2]);
  for (int d = ndim - 3; d >= 0; --d) {
    loc += IdxT(elem.z % shape[d]) * IdxT(strides[d]);
    elem.z /= shape[d];
  }
  return loc;
}

template <typename IdxT = int64_t>
LILY_INLINE IdxT elem_to_loc_1(uint elem, const int64_t& stride) {
  return IdxT(elem) * IdxT(stride);
}
template <typename IdxT = int64_t>
LILY_INLINE IdxT elem_to_loc_2(uint2 elem, lily::cptr<int64_t> strides) {
  return IdxT(elem.x) * IdxT(strides[1]) + IdxT(elem.y) * IdxT(strides[0]);
}
template <typename IdxT = int64_t>
LILY_INLINE IdxT elem_to_loc_3(uint3 elem, lily::cptr<int64_t> strides) {
  return IdxT(elem.x) * IdxT(strides[2]) + IdxT(elem.y) * IdxT(strides[1]) +
         IdxT(elem.z) * IdxT(strides[0]);
}

template <typename T, typename U>
LILY_INLINE T ceildiv(T n, U m) {
  return (n + m - 1) / m;
}

// Limits<T>: max/min are +-infinity for floats and the range for integers;
// finite_max/finite_min are always finite.
template <typename T, bool Float = lily::is_float_v<T>>
struct Limits {
  static constexpr T max = metal::numeric_limits<T>::max();
  static constexpr T min = metal::numeric_limits<T>::min();
  static constexpr T finite_max = metal::numeric_limits<T>::max();
  static constexpr T finite_min = metal::numeric_limits<T>::min();
};
template <typename T>
struct Limits<T, true> {
  static constexpr T max = metal::numeric_limits<T>::infinity();
  static constexpr T min = -metal::numeric_limits<T>::infinity();
  static constexpr T finite_max = metal::numeric_limits<T>::max();
  static constexpr T finite_min = -metal::numeric_limits<T>::max();
};
template <>
struct Limits<bool, false> {
  static constexpr bool max = true;
  static constexpr bool min = false;
};

template <bool Condition, typename T, typename U>
struct ConditionalType {
  using type = U;
};
template <typename T, typename U>
struct ConditionalType<true, T, U> {
  using type = T;
};

// static_cast, except that floats convert to bool by ignoring the sign
// (-0.0 is false), as MLX's cast_to does.
template <typename U, typename T>
LILY_INLINE U cast_to(T val) {
  if constexpr (std::is_same<U, bool>::value && lily::is_float_v<T>) {
    return val != T(0);
  } else {
    return static_cast<U>(val);
  }
}

template <typename U>
struct WorkPerThread {
  static_assert(sizeof(U) <= 8, "Type too large");
  static constexpr int n = 8 / sizeof(U);
};

#define MLX_MTL_PRAGMA_UNROLL _Pragma("GCC unroll 16")
#define MTL_CONST
static constexpr int MAX_REDUCE_SPECIALIZED_DIMS = 4;
static constexpr int REDUCE_N_READS = 4;
static constexpr int REDUCE_N_WRITES = 4;
static constexpr int SOFTMAX_N_READS = 4;
static constexpr int RMS_N_READS = 4;
static constexpr int RMS_LOOPED_LIMIT = 4096;
