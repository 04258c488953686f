// Metal's math library (metal::, metal::fast::, metal::precise::) for C++.
//
// Float functions call the C library through GCC builtins, so no <cmath> is
// included and unqualified calls in kernel code resolve to these overloads
// only. half and bfloat compute in float and round once.
#pragma once

#include "lily_vector.h"

namespace lily {
namespace m {

#define LILY_F1(name, fb, db)                                       \
  LILY_INLINE float name(float x) { return fb(x); }                 \
  LILY_INLINE double name(double x) { return db(x); }
LILY_F1(exp, __builtin_expf, __builtin_exp)
LILY_F1(exp2, __builtin_exp2f, __builtin_exp2)
LILY_F1(expm1, __builtin_expm1f, __builtin_expm1)
LILY_F1(log, __builtin_logf, __builtin_log)
LILY_F1(log2, __builtin_log2f, __builtin_log2)
LILY_F1(log10, __builtin_log10f, __builtin_log10)
LILY_F1(log1p, __builtin_log1pf, __builtin_log1p)
LILY_F1(sqrt, __builtin_sqrtf, __builtin_sqrt)
LILY_F1(cbrt, __builtin_cbrtf, __builtin_cbrt)
LILY_F1(sin, __builtin_sinf, __builtin_sin)
LILY_F1(cos, __builtin_cosf, __builtin_cos)
LILY_F1(tan, __builtin_tanf, __builtin_tan)
LILY_F1(asin, __builtin_asinf, __builtin_asin)
LILY_F1(acos, __builtin_acosf, __builtin_acos)
LILY_F1(atan, __builtin_atanf, __builtin_atan)
LILY_F1(sinh, __builtin_sinhf, __builtin_sinh)
LILY_F1(cosh, __builtin_coshf, __builtin_cosh)
LILY_F1(tanh, __builtin_tanhf, __builtin_tanh)
LILY_F1(asinh, __builtin_asinhf, __builtin_asinh)
LILY_F1(acosh, __builtin_acoshf, __builtin_acosh)
LILY_F1(atanh, __builtin_atanhf, __builtin_atanh)
LILY_F1(erf, __builtin_erff, __builtin_erf)
LILY_F1(floor, __builtin_floorf, __builtin_floor)
LILY_F1(ceil, __builtin_ceilf, __builtin_ceil)
LILY_F1(round, __builtin_roundf, __builtin_round)  // halfway away from zero
LILY_F1(rint, __builtin_rintf, __builtin_rint)     // halfway to even
LILY_F1(trunc, __builtin_truncf, __builtin_trunc)
LILY_F1(fabs, __builtin_fabsf, __builtin_fabs)
#undef LILY_F1

LILY_INLINE float exp10(float x) { return __builtin_powf(10.0f, x); }
LILY_INLINE double exp10(double x) { return __builtin_pow(10.0, x); }
LILY_INLINE float rsqrt(float x) { return 1.0f / __builtin_sqrtf(x); }
LILY_INLINE double rsqrt(double x) { return 1.0 / __builtin_sqrt(x); }
LILY_INLINE float fract(float x) {
  float f = x - __builtin_floorf(x);
  return f < 0x1.fffffep-1f ? f : 0x1.fffffep-1f;
}
LILY_INLINE double fract(double x) { return x - __builtin_floor(x); }
LILY_INLINE float sinpi(float x) { return __builtin_sinf(3.14159265358979323846f * x); }
LILY_INLINE float cospi(float x) { return __builtin_cosf(3.14159265358979323846f * x); }
LILY_INLINE float tanpi(float x) { return __builtin_tanf(3.14159265358979323846f * x); }
LILY_INLINE double sinpi(double x) { return __builtin_sin(3.141592653589793 * x); }
LILY_INLINE double cospi(double x) { return __builtin_cos(3.141592653589793 * x); }
LILY_INLINE double tanpi(double x) { return __builtin_tan(3.141592653589793 * x); }
LILY_INLINE float sign(float x) {
  return x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : (x != x ? 0.0f : x));
}
LILY_INLINE double sign(double x) { return x > 0 ? 1.0 : (x < 0 ? -1.0 : (x != x ? 0.0 : x)); }
LILY_INLINE float saturate(float x) { return __builtin_fminf(__builtin_fmaxf(x, 0.0f), 1.0f); }
LILY_INLINE double saturate(double x) { return __builtin_fmin(__builtin_fmax(x, 0.0), 1.0); }

#define LILY_F2(name, fb, db)                                         \
  LILY_INLINE float name(float x, float y) { return fb(x, y); }       \
  LILY_INLINE double name(double x, double y) { return db(x, y); }
LILY_F2(pow, __builtin_powf, __builtin_pow)
LILY_F2(powr, __builtin_powf, __builtin_pow)
LILY_F2(atan2, __builtin_atan2f, __builtin_atan2)
LILY_F2(fmod, __builtin_fmodf, __builtin_fmod)
LILY_F2(fmax, __builtin_fmaxf, __builtin_fmax)
LILY_F2(fmin, __builtin_fminf, __builtin_fmin)
LILY_F2(copysign, __builtin_copysignf, __builtin_copysign)
LILY_F2(fdim, __builtin_fdimf, __builtin_fdim)
LILY_F2(remainder, __builtin_remainderf, __builtin_remainder)
#undef LILY_F2
LILY_INLINE float step(float edge, float x) { return x < edge ? 0.0f : 1.0f; }
LILY_INLINE double step(double edge, double x) { return x < edge ? 0.0 : 1.0; }

LILY_INLINE float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
LILY_INLINE double fma(double a, double b, double c) { return __builtin_fma(a, b, c); }

}  // namespace m

// The floating type a function computes in: float for 16-bit types.
template <class T>
using compute_t = std::conditional_t<std::is_same<T, double>::value, double, float>;

template <class T>
constexpr bool is_float_v = std::is_floating_point<T>::value || is_lowp<T>::value;

// Common type of two scalars for max/min/clamp/select, permissive like the
// usual arithmetic conversions (with Metal's rules for 16-bit floats).
template <class A, class B, class = void>
struct common_scalar {
  using type = std::common_type_t<A, B>;
};
template <class A, class B>
struct common_scalar<A, B, std::enable_if_t<is_lowp<A>::value || is_lowp<B>::value>> {
  using type = lowp_mix_t<A, B>;
};
template <class A, class B>
using common_scalar_t = typename common_scalar<std::decay_t<A>, std::decay_t<B>>::type;

}  // namespace lily

namespace metal {

using lily::vec;

// ---- float functions of one argument (scalars and vectors) ----
#define LILY_UNARY(name)                                                      \
  LILY_INLINE float name(float x) { return lily::m::name(x); }                \
  LILY_INLINE double name(double x) { return lily::m::name(x); }              \
  LILY_INLINE half name(half x) { return half(lily::m::name(float(x))); }     \
  LILY_INLINE bfloat name(bfloat x) { return bfloat(lily::m::name(float(x))); } \
  template <class T, int N>                                                   \
  LILY_INLINE vec<T, N> name(const vec<T, N>& v) {                            \
    vec<T, N> r;                                                              \
    for (int i = 0; i < N; ++i) r[i] = name(v[i]);                            \
    return r;                                                                 \
  }
LILY_UNARY(exp)
LILY_UNARY(exp2)
LILY_UNARY(exp10)
LILY_UNARY(expm1)
LILY_UNARY(log)
LILY_UNARY(log2)
LILY_UNARY(log10)
LILY_UNARY(log1p)
LILY_UNARY(sqrt)
LILY_UNARY(rsqrt)
LILY_UNARY(cbrt)
LILY_UNARY(sin)
LILY_UNARY(cos)
LILY_UNARY(tan)
LILY_UNARY(asin)
LILY_UNARY(acos)
LILY_UNARY(atan)
LILY_UNARY(sinh)
LILY_UNARY(cosh)
LILY_UNARY(tanh)
LILY_UNARY(asinh)
LILY_UNARY(acosh)
LILY_UNARY(atanh)
LILY_UNARY(sinpi)
LILY_UNARY(cospi)
LILY_UNARY(tanpi)
LILY_UNARY(erf)
LILY_UNARY(floor)
LILY_UNARY(ceil)
LILY_UNARY(round)
LILY_UNARY(rint)
LILY_UNARY(trunc)
LILY_UNARY(fabs)
LILY_UNARY(fract)
LILY_UNARY(sign)
LILY_UNARY(saturate)
#undef LILY_UNARY

// ---- float functions of two arguments ----
#define LILY_BINARY(name)                                                        \
  template <class A, class B,                                                    \
            std::enable_if_t<lily::is_scalar_v<A> && lily::is_scalar_v<B>, int> = 0> \
  LILY_INLINE lily::common_scalar_t<A, B> name(A a, B b) {                       \
    using R = lily::common_scalar_t<A, B>;                                       \
    using C = lily::compute_t<R>;                                                \
    return R(lily::m::name(C(a), C(b)));                                         \
  }                                                                              \
  template <class T, int N>                                                      \
  LILY_INLINE vec<T, N> name(const vec<T, N>& a, const vec<T, N>& b) {           \
    vec<T, N> r;                                                                 \
    for (int i = 0; i < N; ++i) r[i] = name(a[i], b[i]);                         \
    return r;                                                                    \
  }                                                                              \
  template <class T, int N, class S, std::enable_if_t<lily::is_scalar_v<S>, int> = 0> \
  LILY_INLINE vec<T, N> name(const vec<T, N>& a, S b) {                          \
    return name(a, vec<T, N>(b));                                                \
  }
LILY_BINARY(pow)
LILY_BINARY(powr)
LILY_BINARY(atan2)
LILY_BINARY(fmod)
LILY_BINARY(fmax)
LILY_BINARY(fmin)
LILY_BINARY(copysign)
LILY_BINARY(fdim)
LILY_BINARY(remainder)
LILY_BINARY(step)
#undef LILY_BINARY

template <class A, class B, class C,
          std::enable_if_t<lily::is_scalar_v<A> && lily::is_scalar_v<B> &&
                               lily::is_scalar_v<C>, int> = 0>
LILY_INLINE auto fma(A a, B b, C c) {
  using R = lily::common_scalar_t<lily::common_scalar_t<A, B>, C>;
  using K = lily::compute_t<R>;
  return R(lily::m::fma(K(a), K(b), K(c)));
}
template <class T, int N>
LILY_INLINE vec<T, N> fma(const vec<T, N>& a, const vec<T, N>& b, const vec<T, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = fma(a[i], b[i], c[i]);
  return r;
}

// ---- abs, max, min, clamp: floats and integers ----
LILY_INLINE float abs(float x) { return __builtin_fabsf(x); }
LILY_INLINE double abs(double x) { return __builtin_fabs(x); }
LILY_INLINE half abs(half x) { return half::from_bits(x.bits & 0x7fff); }
LILY_INLINE bfloat abs(bfloat x) { return bfloat::from_bits(x.bits & 0x7fff); }
template <class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>
LILY_INLINE I abs(I x) {
  return std::is_signed<I>::value && x < 0 ? I(-x) : x;
}
template <class T, int N>
LILY_INLINE vec<T, N> abs(const vec<T, N>& v) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = abs(v[i]);
  return r;
}

// Float max/min ignore a NaN operand (fmax semantics), as Metal's do.
template <class A, class B,
          std::enable_if_t<lily::is_scalar_v<A> && lily::is_scalar_v<B>, int> = 0>
LILY_INLINE lily::common_scalar_t<A, B> max(A a, B b) {
  using R = lily::common_scalar_t<A, B>;
  if constexpr (lily::is_float_v<R>) {
    using C = lily::compute_t<R>;
    return R(lily::m::fmax(C(a), C(b)));
  } else {
    return R(a) > R(b) ? R(a) : R(b);
  }
}
template <class A, class B,
          std::enable_if_t<lily::is_scalar_v<A> && lily::is_scalar_v<B>, int> = 0>
LILY_INLINE lily::common_scalar_t<A, B> min(A a, B b) {
  using R = lily::common_scalar_t<A, B>;
  if constexpr (lily::is_float_v<R>) {
    using C = lily::compute_t<R>;
    return R(lily::m::fmin(C(a), C(b)));
  } else {
    return R(a) < R(b) ? R(a) : R(b);
  }
}
template <class A, class B, class C,
          std::enable_if_t<lily::is_scalar_v<A> && lily::is_scalar_v<B> &&
                               lily::is_scalar_v<C>, int> = 0>
LILY_INLINE auto clamp(A x, B lo, C hi) {
  return min(max(x, lo), hi);
}
#define LILY_VEC_MINMAX(name)                                                 \
  template <class T, int N>                                                   \
  LILY_INLINE vec<T, N> name(const vec<T, N>& a, const vec<T, N>& b) {        \
    vec<T, N> r;                                                              \
    for (int i = 0; i < N; ++i) r[i] = T(name(a[i], b[i]));                   \
    return r;                                                                 \
  }                                                                           \
  template <class T, int N, class S, std::enable_if_t<lily::is_scalar_v<S>, int> = 0> \
  LILY_INLINE vec<T, N> name(const vec<T, N>& a, S b) {                       \
    return name(a, vec<T, N>(b));                                             \
  }
LILY_VEC_MINMAX(max)
LILY_VEC_MINMAX(min)
#undef LILY_VEC_MINMAX
template <class T, int N, class L, class H>
LILY_INLINE vec<T, N> clamp(const vec<T, N>& x, const L& lo, const H& hi) {
  return min(max(x, lo), hi);
}

template <class A, class B, class C>
LILY_INLINE auto mix(A x, B y, C a) {
  return x + (y - x) * a;
}
template <class A, class B, class C>
LILY_INLINE auto smoothstep(A e0, B e1, C x) {
  auto t = clamp((x - e0) / (e1 - e0), 0.0f, 1.0f);
  return t * t * (3.0f - 2.0f * t);
}

// select(a, b, c): b where c is true, else a.
template <class A, class B,
          std::enable_if_t<lily::is_scalar_v<A> && lily::is_scalar_v<B>, int> = 0>
LILY_INLINE lily::common_scalar_t<A, B> select(A a, B b, bool c) {
  using R = lily::common_scalar_t<A, B>;
  return c ? R(b) : R(a);
}
template <class T, int N>
LILY_INLINE vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, const vec<bool, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; ++i) r[i] = c[i] ? b[i] : a[i];
  return r;
}
template <class T, int N>
LILY_INLINE vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, bool c) {
  return c ? b : a;
}

// ---- classification ----
template <class T, std::enable_if_t<lily::is_scalar_v<T>, int> = 0>
LILY_INLINE bool isnan(T x) { auto f = lily::compute_t<T>(x); return f != f; }
template <class T, std::enable_if_t<lily::is_scalar_v<T>, int> = 0>
LILY_INLINE bool isinf(T x) {
  auto f = lily::compute_t<T>(x);
  return f == __builtin_inff() || f == -__builtin_inff();
}
template <class T, std::enable_if_t<lily::is_scalar_v<T>, int> = 0>
LILY_INLINE bool isfinite(T x) { return !isnan(x) && !isinf(x); }
template <class T, std::enable_if_t<lily::is_scalar_v<T>, int> = 0>
LILY_INLINE bool signbit(T x) { return __builtin_signbit(lily::compute_t<T>(x)); }
#define LILY_VEC_PREDICATE(name)                           \
  template <class T, int N>                                \
  LILY_INLINE vec<bool, N> name(const vec<T, N>& v) {      \
    vec<bool, N> r;                                        \
    for (int i = 0; i < N; ++i) r[i] = name(v[i]);         \
    return r;                                              \
  }
LILY_VEC_PREDICATE(isnan)
LILY_VEC_PREDICATE(isinf)
LILY_VEC_PREDICATE(isfinite)
LILY_VEC_PREDICATE(signbit)
#undef LILY_VEC_PREDICATE

template <int N>
LILY_INLINE bool all(const vec<bool, N>& v) {
  for (int i = 0; i < N; ++i) if (!v[i]) return false;
  return true;
}
template <int N>
LILY_INLINE bool any(const vec<bool, N>& v) {
  for (int i = 0; i < N; ++i) if (v[i]) return true;
  return false;
}
LILY_INLINE bool all(bool b) { return b; }
LILY_INLINE bool any(bool b) { return b; }

// ---- geometric ----
template <class T, int N>
LILY_INLINE T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T s = a[0] * b[0];
  for (int i = 1; i < N; ++i) s = T(s + a[i] * b[i]);
  return s;
}
template <class T, int N>
LILY_INLINE T length_squared(const vec<T, N>& a) { return dot(a, a); }
template <class T, int N>
LILY_INLINE T length(const vec<T, N>& a) { return sqrt(dot(a, a)); }
template <class T, int N>
LILY_INLINE T distance(const vec<T, N>& a, const vec<T, N>& b) { return length(a - b); }
template <class T, int N>
LILY_INLINE vec<T, N> normalize(const vec<T, N>& a) { return a * rsqrt(dot(a, a)); }
template <class T>
LILY_INLINE vec<T, 3> cross(const vec<T, 3>& a, const vec<T, 3>& b) {
  return vec<T, 3>(a.y * b.z - a.z * b.y, a.z * b.x - a.x * b.z, a.x * b.y - a.y * b.x);
}

// ---- integer functions ----
template <class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>
LILY_INLINE I popcount(I x) {
  return I(__builtin_popcountll(static_cast<unsigned long long>(
      static_cast<std::make_unsigned_t<I>>(x))));
}
template <class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>
LILY_INLINE I clz(I x) {
  using U = std::make_unsigned_t<I>;
  U u = static_cast<U>(x);
  return u == 0 ? I(sizeof(I) * 8)
                : I(__builtin_clzll(u) - (64 - int(sizeof(I) * 8)));
}
template <class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>
LILY_INLINE I ctz(I x) {
  using U = std::make_unsigned_t<I>;
  U u = static_cast<U>(x);
  return u == 0 ? I(sizeof(I) * 8) : I(__builtin_ctzll(u));
}
template <class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>
LILY_INLINE I mulhi(I a, I b) {
  if constexpr (sizeof(I) == 8) {
    using W = std::conditional_t<std::is_signed<I>::value, __int128, unsigned __int128>;
    return I((W(a) * W(b)) >> 64);
  } else {
    using W = std::conditional_t<std::is_signed<I>::value, int64_t, uint64_t>;
    return I((W(a) * W(b)) >> (8 * sizeof(I)));
  }
}
template <class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>
LILY_INLINE I reverse_bits(I x) {
  using U = std::make_unsigned_t<I>;
  U u = static_cast<U>(x), r = 0;
  for (size_t i = 0; i < sizeof(I) * 8; ++i) { r = U((r << 1) | (u & 1)); u = U(u >> 1); }
  return I(r);
}

// divide(x, y) exists in fast:: and precise::; here it is plain division.
template <class A, class B>
LILY_INLINE auto divide(A a, B b) { return a / b; }

// Same functions under Metal's precision namespaces.
namespace fast { using namespace ::metal; }
namespace precise { using namespace ::metal; }

}  // namespace metal
