// Metal's vector types (float2, half4, uint3, bool2, ...) for C++:
// components .x/.y/.z/.w (and .r/.g/.b/.a), v[i], component-wise operators
// with scalar broadcast, comparisons yielding bool vectors. Sizes and
// alignments follow Metal (a 3-vector occupies 4 elements).
// Swizzles with several components (v.xy) are not supported.
#pragma once

#include "lily_scalar.h"

namespace lily {

template <class T, int N>
struct vec_storage;

template <class T>
struct alignas(2 * sizeof(T)) vec_storage<T, 2> {
  union {
    struct { T x, y; };
    struct { T r, g; };
    T v_[2];
  };
};

template <class T>
struct alignas(4 * sizeof(T)) vec_storage<T, 3> {
  union {
    struct { T x, y, z; };
    struct { T r, g, b; };
    T v_[4];  // the fourth element is padding, as in Metal
  };
};

template <class T>
struct alignas(4 * sizeof(T)) vec_storage<T, 4> {
  union {
    struct { T x, y, z, w; };
    struct { T r, g, b, a; };
    T v_[4];
  };
};

template <class T, int N>
struct vec : vec_storage<T, N> {
  using value_type = T;
  static constexpr int size = N;

  vec() = default;

  // A scalar converts implicitly to a vector by replication.
  template <class S, std::enable_if_t<is_scalar_v<S>, int> = 0>
  vec(S s) {
    for (int i = 0; i < N; ++i) this->v_[i] = T(s);
  }

  template <int M = N, std::enable_if_t<M == 2, int> = 0>
  vec(T a, T b) { set(a, b); }
  template <int M = N, std::enable_if_t<M == 3, int> = 0>
  vec(T a, T b, T c) { set(a, b, c); }
  template <int M = N, std::enable_if_t<M == 4, int> = 0>
  vec(T a, T b, T c, T d) { set(a, b, c, d); }

  template <int M = N, std::enable_if_t<M == 3, int> = 0>
  vec(const vec<T, 2>& a, T c) { set(a.x, a.y, c); }
  template <int M = N, std::enable_if_t<M == 3, int> = 0>
  vec(T a, const vec<T, 2>& b) { set(a, b.x, b.y); }
  template <int M = N, std::enable_if_t<M == 4, int> = 0>
  vec(const vec<T, 2>& a, const vec<T, 2>& b) { set(a.x, a.y, b.x, b.y); }
  template <int M = N, std::enable_if_t<M == 4, int> = 0>
  vec(const vec<T, 3>& a, T d) { set(a.x, a.y, a.z, d); }
  template <int M = N, std::enable_if_t<M == 4, int> = 0>
  vec(T a, const vec<T, 3>& b) { set(a, b.x, b.y, b.z); }
  template <int M = N, std::enable_if_t<M == 4, int> = 0>
  vec(const vec<T, 2>& a, T c, T d) { set(a.x, a.y, c, d); }
  template <int M = N, std::enable_if_t<M == 4, int> = 0>
  vec(T a, const vec<T, 2>& b, T d) { set(a, b.x, b.y, d); }
  template <int M = N, std::enable_if_t<M == 4, int> = 0>
  vec(T a, T b, const vec<T, 2>& c) { set(a, b, c.x, c.y); }

  // Conversions between element types are explicit, as in Metal.
  template <class U, std::enable_if_t<!std::is_same<U, T>::value, int> = 0>
  explicit vec(const vec<U, N>& o) {
    for (int i = 0; i < N; ++i) this->v_[i] = static_cast<T>(o.v_[i]);
  }

  T& operator[](int i) { return this->v_[i]; }
  const T& operator[](int i) const { return this->v_[i]; }

  template <class... Args>
  void set(Args... args) {
    T vals[] = {T(args)...};
    for (int i = 0; i < N; ++i) this->v_[i] = vals[i];
  }
};

template <class T> struct is_vec : std::false_type {};
template <class T, int N> struct is_vec<vec<T, N>> : std::true_type {};

#define LILY_VEC_BINARY(op)                                                 \
  template <class T, int N>                                                 \
  vec<T, N> operator op(const vec<T, N>& a, const vec<T, N>& b) {           \
    vec<T, N> r;                                                            \
    for (int i = 0; i < N; ++i) r.v_[i] = T(a.v_[i] op b.v_[i]);            \
    return r;                                                               \
  }                                                                         \
  template <class T, int N, class S, std::enable_if_t<is_scalar_v<S>, int> = 0> \
  vec<T, N> operator op(const vec<T, N>& a, S s) {                          \
    vec<T, N> r;                                                            \
    for (int i = 0; i < N; ++i) r.v_[i] = T(a.v_[i] op T(s));               \
    return r;                                                               \
  }                                                                         \
  template <class T, int N, class S, std::enable_if_t<is_scalar_v<S>, int> = 0> \
  vec<T, N> operator op(S s, const vec<T, N>& b) {                          \
    vec<T, N> r;                                                            \
    for (int i = 0; i < N; ++i) r.v_[i] = T(T(s) op b.v_[i]);               \
    return r;                                                               \
  }                                                                         \
  template <class T, int N, class O>                                        \
  vec<T, N>& operator op##=(vec<T, N>& a, const O& o) {                     \
    return a = a op o;                                                      \
  }
LILY_VEC_BINARY(+)
LILY_VEC_BINARY(-)
LILY_VEC_BINARY(*)
LILY_VEC_BINARY(/)
LILY_VEC_BINARY(%)
LILY_VEC_BINARY(&)
LILY_VEC_BINARY(|)
LILY_VEC_BINARY(^)
LILY_VEC_BINARY(<<)
LILY_VEC_BINARY(>>)
#undef LILY_VEC_BINARY

#define LILY_VEC_COMPARE(op)                                                \
  template <class T, int N>                                                 \
  vec<bool, N> operator op(const vec<T, N>& a, const vec<T, N>& b) {        \
    vec<bool, N> r;                                                         \
    for (int i = 0; i < N; ++i) r.v_[i] = a.v_[i] op b.v_[i];               \
    return r;                                                               \
  }                                                                         \
  template <class T, int N, class S, std::enable_if_t<is_scalar_v<S>, int> = 0> \
  vec<bool, N> operator op(const vec<T, N>& a, S s) {                       \
    vec<bool, N> r;                                                         \
    for (int i = 0; i < N; ++i) r.v_[i] = a.v_[i] op T(s);                  \
    return r;                                                               \
  }                                                                         \
  template <class T, int N, class S, std::enable_if_t<is_scalar_v<S>, int> = 0> \
  vec<bool, N> operator op(S s, const vec<T, N>& b) {                       \
    vec<bool, N> r;                                                         \
    for (int i = 0; i < N; ++i) r.v_[i] = T(s) op b.v_[i];                  \
    return r;                                                               \
  }
LILY_VEC_COMPARE(==)
LILY_VEC_COMPARE(!=)
LILY_VEC_COMPARE(<)
LILY_VEC_COMPARE(>)
LILY_VEC_COMPARE(<=)
LILY_VEC_COMPARE(>=)
LILY_VEC_COMPARE(&&)
LILY_VEC_COMPARE(||)
#undef LILY_VEC_COMPARE

template <class T, int N>
vec<T, N> operator-(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r.v_[i] = T(-a.v_[i]);
  return r;
}
template <class T, int N>
vec<T, N> operator+(const vec<T, N>& a) { return a; }
template <class T, int N>
vec<T, N> operator~(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r.v_[i] = T(~a.v_[i]);
  return r;
}
template <class T, int N>
vec<bool, N> operator!(const vec<T, N>& a) {
  vec<bool, N> r;
  for (int i = 0; i < N; ++i) r.v_[i] = !a.v_[i];
  return r;
}
template <class T, int N>
vec<T, N>& operator++(vec<T, N>& a) { return a += T(1); }
template <class T, int N>
vec<T, N>& operator--(vec<T, N>& a) { return a -= T(1); }

}  // namespace lily

#define LILY_VEC_TYPES(T, name)            \
  using name##2 = lily::vec<T, 2>;         \
  using name##3 = lily::vec<T, 3>;         \
  using name##4 = lily::vec<T, 4>;         \
  using packed_##name##2 = lily::vec<T, 2>; \
  using packed_##name##4 = lily::vec<T, 4>;
LILY_VEC_TYPES(float, float)
LILY_VEC_TYPES(half, half)
LILY_VEC_TYPES(bfloat, bfloat)
LILY_VEC_TYPES(int, int)
LILY_VEC_TYPES(unsigned int, uint)
LILY_VEC_TYPES(short, short)
LILY_VEC_TYPES(unsigned short, ushort)
LILY_VEC_TYPES(char, char)
LILY_VEC_TYPES(unsigned char, uchar)
LILY_VEC_TYPES(int64_t, long)
LILY_VEC_TYPES(uint64_t, ulong)
LILY_VEC_TYPES(bool, bool)
#undef LILY_VEC_TYPES

namespace metal {
template <class T, int N>
using vec = lily::vec<T, N>;
}
