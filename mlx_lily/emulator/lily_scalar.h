// Metal's scalar types for C++: half and bfloat with round-to-nearest-even
// conversions, Metal's promotion rules, the short type names (uint, ushort,
// ...), metal::numeric_limits and as_type.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

#define LILY_INLINE inline __attribute__((always_inline))

namespace lily {

constexpr uint32_t float_bits(float f) { return __builtin_bit_cast(uint32_t, f); }
constexpr float bits_float(uint32_t u) { return __builtin_bit_cast(float, u); }

// Shift right by s (1..31) rounding to nearest, ties to even.
constexpr uint32_t shift_round_even(uint32_t m, int s) {
  uint32_t q = m >> s;
  uint32_t rem = m & ((1u << s) - 1);
  uint32_t halfway = 1u << (s - 1);
  return (rem > halfway || (rem == halfway && (q & 1))) ? q + 1 : q;
}

struct HalfFormat {
  static constexpr uint16_t from_float(float f) {
    uint32_t x = float_bits(f);
    uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000);
    uint32_t a = x & 0x7fffffffu;
    if (a >= 0x7f800000u) {  // inf, nan (keep a quiet payload)
      return a == 0x7f800000u ? (sign | 0x7c00)
                              : (sign | 0x7e00 | ((a >> 13) & 0x1ff));
    }
    if (a < 0x38800000u) {  // below 2^-14: half subnormal or zero
      int e = static_cast<int>(a >> 23);
      int shift = 126 - e;  // value in units of 2^-24 is m * 2^-shift
      if (e == 0 || shift > 24) return sign;
      uint32_t m = (a & 0x7fffffu) | 0x800000u;
      return sign | static_cast<uint16_t>(shift_round_even(m, shift));
    }
    uint32_t r = shift_round_even(a - (112u << 23), 13);  // rebias 127 -> 15
    return r >= 0x7c00u ? (sign | 0x7c00) : static_cast<uint16_t>(sign | r);
  }
  static constexpr float to_float(uint16_t h) {
    uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
    uint32_t e = (h >> 10) & 0x1f;
    uint32_t m = h & 0x3ff;
    if (e == 0) {
      float v = static_cast<float>(m) * 5.9604644775390625e-8f;  // 2^-24
      return sign ? -v : v;
    }
    if (e == 31) return bits_float(sign | 0x7f800000u | (m << 13));
    return bits_float(sign | ((e + 112) << 23) | (m << 13));
  }
};

struct BFloatFormat {
  static constexpr uint16_t from_float(float f) {
    uint32_t x = float_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
      return static_cast<uint16_t>((x >> 16) | 0x40);  // quiet nan
    }
    return static_cast<uint16_t>((x + 0x7fffu + ((x >> 16) & 1)) >> 16);
  }
  static constexpr float to_float(uint16_t b) {
    return bits_float(static_cast<uint32_t>(b) << 16);
  }
};

// A 16-bit float stored as bits. Arithmetic happens in float and is rounded
// back once, which is exact for + - * / (float has more than 2p+2 bits).
template <class Format>
struct lowp {
  uint16_t bits;

  lowp() = default;
  constexpr lowp(float f) : bits(Format::from_float(f)) {}
  constexpr lowp(double d) : bits(Format::from_float(static_cast<float>(d))) {}
  template <class I, std::enable_if_t<std::is_integral<I>::value, int> = 0>
  constexpr lowp(I i) : bits(Format::from_float(static_cast<float>(i))) {}
  template <class F2, std::enable_if_t<!std::is_same<F2, Format>::value, int> = 0>
  constexpr explicit lowp(lowp<F2> o) : lowp(static_cast<float>(o)) {}

  constexpr operator float() const { return Format::to_float(bits); }

  static constexpr lowp from_bits(uint16_t b) {
    lowp r{};
    r.bits = b;
    return r;
  }

  constexpr lowp operator-() const { return from_bits(bits ^ 0x8000); }
  constexpr lowp operator+() const { return *this; }
  lowp& operator++() { return *this = lowp(static_cast<float>(*this) + 1.0f); }
  lowp& operator--() { return *this = lowp(static_cast<float>(*this) - 1.0f); }
  lowp operator++(int) { lowp o = *this; ++*this; return o; }
  lowp operator--(int) { lowp o = *this; --*this; return o; }
};

template <class T> struct is_lowp : std::false_type {};
template <class F> struct is_lowp<lowp<F>> : std::true_type {};

// Scalars in Metal's sense: C++ arithmetic types plus half and bfloat.
template <class T>
constexpr bool is_scalar_v =
    std::is_arithmetic<std::decay_t<T>>::value || is_lowp<std::decay_t<T>>::value;

// Result of mixing a 16-bit float with another scalar, as Metal does it:
// same 16-bit type -> that type; with an integer -> the 16-bit type;
// with float (or half with bfloat) -> float.
template <class A, class B>
using lowp_mix_t = std::conditional_t<
    is_lowp<A>::value && is_lowp<B>::value,
    std::conditional_t<std::is_same<A, B>::value, A, float>,
    std::conditional_t<
        is_lowp<A>::value,
        std::conditional_t<std::is_integral<B>::value, A, float>,
        std::conditional_t<std::is_integral<A>::value, B, float>>>;

template <class A, class B>
constexpr bool lowp_operands_v =
    (is_lowp<A>::value || is_lowp<B>::value) && is_scalar_v<A> && is_scalar_v<B>;

#define LILY_LOWP_ARITH(op)                                                 \
  template <class A, class B,                                               \
            std::enable_if_t<lowp_operands_v<A, B>, int> = 0>               \
  constexpr lowp_mix_t<A, B> operator op(A a, B b) {                        \
    return lowp_mix_t<A, B>(static_cast<float>(a) op static_cast<float>(b)); \
  }
LILY_LOWP_ARITH(+)
LILY_LOWP_ARITH(-)
LILY_LOWP_ARITH(*)
LILY_LOWP_ARITH(/)
#undef LILY_LOWP_ARITH

#define LILY_LOWP_COMPARE(op)                                  \
  template <class A, class B,                                  \
            std::enable_if_t<lowp_operands_v<A, B>, int> = 0>  \
  constexpr bool operator op(A a, B b) {                       \
    return static_cast<float>(a) op static_cast<float>(b);     \
  }
LILY_LOWP_COMPARE(==)
LILY_LOWP_COMPARE(!=)
LILY_LOWP_COMPARE(<)
LILY_LOWP_COMPARE(>)
LILY_LOWP_COMPARE(<=)
LILY_LOWP_COMPARE(>=)
#undef LILY_LOWP_COMPARE

#define LILY_LOWP_ASSIGN(op)                                                \
  template <class F, class B, std::enable_if_t<is_scalar_v<B>, int> = 0>    \
  lowp<F>& operator op##=(lowp<F>& a, B b) {                                \
    return a = lowp<F>(static_cast<float>(a) op static_cast<float>(b));    \
  }
LILY_LOWP_ASSIGN(+)
LILY_LOWP_ASSIGN(-)
LILY_LOWP_ASSIGN(*)
LILY_LOWP_ASSIGN(/)
#undef LILY_LOWP_ASSIGN

}  // namespace lily

using half = lily::lowp<lily::HalfFormat>;
using bfloat = lily::lowp<lily::BFloatFormat>;
using bfloat16_t = bfloat;
using float16_t = half;

using uint = unsigned int;
using ushort = unsigned short;
using uchar = unsigned char;
using ulong = uint64_t;
using size_t = std::size_t;
using ptrdiff_t = std::ptrdiff_t;

namespace metal {

using ::bfloat;
using ::half;

// metal::numeric_limits: std's for the C++ types, hand-written for 16-bit.
template <class T>
struct numeric_limits : std::numeric_limits<T> {};

template <class T, uint16_t Min, uint16_t Max, uint16_t Lowest, uint16_t Eps,
          uint16_t Inf, uint16_t NaN, int Digits>
struct lowp_limits {
  static constexpr bool is_specialized = true;
  static constexpr bool is_signed = true;
  static constexpr bool is_integer = false;
  static constexpr bool is_exact = false;
  static constexpr bool has_infinity = true;
  static constexpr bool has_quiet_NaN = true;
  static constexpr int digits = Digits;
  static constexpr T min() { return T::from_bits(Min); }
  static constexpr T max() { return T::from_bits(Max); }
  static constexpr T lowest() { return T::from_bits(Lowest); }
  static constexpr T epsilon() { return T::from_bits(Eps); }
  static constexpr T infinity() { return T::from_bits(Inf); }
  static constexpr T quiet_NaN() { return T::from_bits(NaN); }
  static constexpr T signaling_NaN() { return T::from_bits(NaN); }
  static constexpr T denorm_min() { return T::from_bits(1); }
};
template <>
struct numeric_limits<half>
    : lowp_limits<half, 0x0400, 0x7bff, 0xfbff, 0x1400, 0x7c00, 0x7e00, 11> {};
template <>
struct numeric_limits<bfloat>
    : lowp_limits<bfloat, 0x0080, 0x7f7f, 0xff7f, 0x3c00, 0x7f80, 0x7fc0, 8> {};

// Reinterprets the bits of x (same size required, as in Metal).
template <class To, class From>
constexpr To as_type(const From& x) {
  static_assert(sizeof(To) == sizeof(From), "as_type: sizes differ");
  return __builtin_bit_cast(To, x);
}

}  // namespace metal

// Metal's float constants.
#define INFINITY (__builtin_inff())
#define NAN (__builtin_nanf(""))
#define HUGE_VALF (__builtin_huge_valf())
#define MAXFLOAT 0x1.fffffep+127f
#define FLT_MAX 0x1.fffffep+127f
#define FLT_MIN 0x1p-126f
#define FLT_EPSILON 0x1p-23f
#define HALF_MAX 65504.0f
#define HALF_MIN 0x1p-14f
#define HALF_EPSILON 0x1p-10f
#define M_E_F 2.71828182845904523536f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LOG10E_F 0.434294481903251827651f
#define M_LN2_F 0.693147180559945309417f
#define M_LN10_F 2.30258509299404568402f
#define M_PI_F 3.14159265358979323846f
#define M_PI_2_F 1.57079632679489661923f
#define M_PI_4_F 0.785398163397448309616f
#define M_1_PI_F 0.318309886183790671538f
#define M_2_PI_F 0.636619772367581343076f
#define M_2_SQRTPI_F 1.12837916709551257390f
#define M_SQRT2_F 1.41421356237309504880f
#define M_SQRT1_2_F 0.707106781186547524401f
#define M_PI_H M_PI_F
