// SIMD-group functions (simd_sum, simd_shuffle_xor, simd_ballot, ...),
// their quad-group counterparts, and simdgroup_matrix.
//
// Each is a collective: the lane writes its operand to its payload slot and
// waits; when every lane of the SIMD-group that has not exited is waiting at
// the same call, the runtime runs the operation once for all of them (the
// `op_*` functions below) and the lanes resume with their results. Reading
// a lane that has exited (or does not exist, in a partial SIMD-group)
// yields a poison value: all bits set (NaN for floats, -1 for integers).
#pragma once

#include "lily_math.h"
#include "lily_memory.h"

namespace lily {
namespace simd {

using rt::CollArgs;
constexpr int W32 = rt::kSimdWidth;

template <class T>
LILY_INLINE T load(const unsigned char* s) {
  T v;
  __builtin_memcpy(static_cast<void*>(&v), s, sizeof(T));
  return v;
}
template <class T>
LILY_INLINE void store(unsigned char* s, const T& v) {
  __builtin_memcpy(s, static_cast<const void*>(&v), sizeof(T));
}
template <class T>
LILY_INLINE T poison() {
  T v;
  __builtin_memset(static_cast<void*>(&v), 0xFF, sizeof(T));
  return v;
}
LILY_INLINE bool on(const CollArgs& a, int lane) {
  return lane >= 0 && lane < W32 && ((a.active >> lane) & 1);
}

// Posts this lane's payload, waits for the SIMD-group, returns the result.
template <class Out, class In>
LILY_INLINE Out exchange(const In& in, rt::CollectiveFn fn, const char* what,
                         int line, const char* file) {
  static_assert(sizeof(In) <= rt::kLaneSlotBytes && sizeof(Out) <= rt::kLaneSlotBytes,
                "SIMD payload too large");
  store(rt::lane_in(), in);
  rt::collective(fn, what, line, file);
  return load<Out>(rt::lane_out());
}

// ---- reductions ----

struct Add { template <class T> T operator()(T a, T b) const { return T(a + b); } };
struct Mul { template <class T> T operator()(T a, T b) const { return T(a * b); } };
struct Max { template <class T> T operator()(T a, T b) const { return T(metal::max(a, b)); } };
struct Min { template <class T> T operator()(T a, T b) const { return T(metal::min(a, b)); } };
struct And { template <class T> T operator()(T a, T b) const { return T(a & b); } };
struct Or { template <class T> T operator()(T a, T b) const { return T(a | b); } };
struct Xor { template <class T> T operator()(T a, T b) const { return T(a ^ b); } };

// Sum and product round at every step, so the order matters: an ascending
// butterfly (xor 1, 2, 4, ...) over groups of W lanes, exited lanes
// contributing the identity. Every lane of a group gets the same bits.
template <class T, int W, class Op, int Identity>
bool op_tree(const CollArgs& a) {
  T v[W32];
  for (int l = 0; l < W32; ++l) v[l] = on(a, l) ? load<T>(a.in[l]) : T(Identity);
  for (int m = 1; m < W; m <<= 1) {
    T next[W32];
    for (int l = 0; l < W32; ++l) next[l] = Op()(v[l], v[l ^ m]);
    for (int l = 0; l < W32; ++l) v[l] = next[l];
  }
  for (int l = 0; l < W32; ++l) if (on(a, l)) store(a.out[l], v[l]);
  return true;
}

// Exact, order-free reductions: fold the active lanes of each group.
template <class T, int W, class Op>
bool op_fold(const CollArgs& a) {
  for (int base = 0; base < W32; base += W) {
    bool any = false;
    T acc{};
    for (int l = base; l < base + W; ++l) {
      if (!on(a, l)) continue;
      T x = load<T>(a.in[l]);
      acc = any ? Op()(acc, x) : x;
      any = true;
    }
    for (int l = base; l < base + W; ++l) if (on(a, l)) store(a.out[l], acc);
  }
  return true;
}

// Prefix scans in lane order over the active lanes of each group.
template <class T, int W, class Op, int Identity, bool Inclusive>
bool op_scan(const CollArgs& a) {
  for (int base = 0; base < W32; base += W) {
    bool any = false;
    T acc = T(Identity);
    for (int l = base; l < base + W; ++l) {
      if (!on(a, l)) continue;
      T x = load<T>(a.in[l]);
      if (!Inclusive) store(a.out[l], acc);
      acc = any ? Op()(acc, x) : x;
      any = true;
      if (Inclusive) store(a.out[l], acc);
    }
  }
  return true;
}

// ---- data movement ----

template <class T>
struct ValueArg {
  T value;
  int32_t arg;
};

enum ShuffleMode { kIndex, kXor, kUp, kDown, kRotateUp, kRotateDown, kFirst };

// The lane that lane l reads (or l itself where Metal keeps the own value).
template <int W>
LILY_INLINE int shuffle_source(const CollArgs& a, int l, int mode, int32_t arg) {
  const int base = l - l % W, i = l % W;
  switch (mode) {
    case kIndex: return (arg >= 0 && arg < W) ? base + arg : -1;
    case kXor: return ((i ^ arg) >= 0 && (i ^ arg) < W) ? base + (i ^ arg) : -1;
    case kUp: return i >= arg ? l - arg : l;
    case kDown: return i + arg < W ? l + arg : l;
    case kRotateUp: return base + (((i - arg) % W) + W) % W;
    case kRotateDown: return base + ((i + arg) % W);
    case kFirst:
      for (int s = base; s < base + W; ++s) if (on(a, s)) return s;
      return -1;
  }
  return -1;
}

template <class T, int W, int Mode>
bool op_shuffle(const CollArgs& a) {
  for (int l = 0; l < W32; ++l) {
    if (!on(a, l)) continue;
    int src = shuffle_source<W>(a, l, Mode, load<ValueArg<T>>(a.in[l]).arg);
    T v = on(a, src) ? load<ValueArg<T>>(a.in[src]).value : poison<T>();
    store(a.out[l], v);
  }
  return true;
}

template <class T>
struct FillArgs {
  T data;
  T fill;
  int32_t delta;
  int32_t modulo;
};

// simd_shuffle_and_fill_up/down: within segments of `modulo` lanes, lanes
// shifted out are replaced by the other operand's lanes.
template <class T, bool Up>
bool op_fill(const CollArgs& a) {
  for (int l = 0; l < W32; ++l) {
    if (!on(a, l)) continue;
    FillArgs<T> me = load<FillArgs<T>>(a.in[l]);
    const int mod = me.modulo > 0 ? me.modulo : W32;
    const int base = l - l % mod, i = l % mod;
    int src = Up ? i - me.delta : i + me.delta;
    bool from_fill = Up ? src < 0 : src >= mod;
    if (from_fill) src += Up ? mod : -mod;
    src += base;
    T v = poison<T>();
    if (on(a, src)) {
      FillArgs<T> other = load<FillArgs<T>>(a.in[src]);
      v = from_fill ? other.fill : other.data;
    }
    store(a.out[l], v);
  }
  return true;
}

// ---- votes ----

template <int W>
LILY_INLINE uint64_t group_mask(int l) {
  const int base = l - l % W;
  return W == 32 ? 0xffffffffull : (((1ull << W) - 1) << base);
}

struct VoteResult {
  uint64_t bits;
  uint64_t active;
};

template <int W>
bool op_ballot(const CollArgs& a) {
  uint64_t bits = 0;
  for (int l = 0; l < W32; ++l) if (on(a, l) && load<bool>(a.in[l])) bits |= 1ull << l;
  for (int l = 0; l < W32; ++l) {
    if (!on(a, l)) continue;
    uint64_t g = group_mask<W>(l);
    store(a.out[l], VoteResult{bits & g, uint64_t(a.active) & g});
  }
  return true;
}

template <int W>
bool op_is_first(const CollArgs& a) {
  for (int l = 0; l < W32; ++l) {
    if (!on(a, l)) continue;
    store(a.out[l], shuffle_source<W>(a, l, kFirst, 0) == l);
  }
  return true;
}

// ---- simdgroup_matrix ----

// Which elements of an 8x8 matrix lane l holds: row `row`, columns
// `col` and `col + 1` (Apple's layout, as MLX's steel kernels assume).
LILY_INLINE void frag_coords(int lane, int& row, int& col) {
  const int q = lane >> 2;
  row = (q & 4) + ((lane >> 1) & 3);
  col = ((q & 2) << 1) + ((lane & 1) << 1);
}

struct MatAccess {
  char* p;
  const char* lo;
  const char* hi;
  uint64_t elements_per_row;
  uint64_t origin_x;  // column
  uint64_t origin_y;  // row
  int32_t transpose;
};

template <class T>
struct MatStore {
  MatAccess at;
  vec<T, 2> frag;
};

// Address of matrix element (r, c) for an access; faults when unchecked
// memory bounds are violated.
template <class E>
LILY_INLINE E* mat_element(const MatAccess& m, int r, int c, int lane, bool is_read,
                           rt::OpFault* fault) {
  const int rr = m.transpose ? c : r;
  const int cc = m.transpose ? r : c;
  int64_t idx = int64_t((m.origin_y + rr) * m.elements_per_row + m.origin_x + cc);
  E* addr = offset(reinterpret_cast<E*>(m.p), idx);
  const char* b = reinterpret_cast<const char*>(addr);
  if (m.lo && (b < m.lo || b + sizeof(E) > m.hi)) {
    *fault = rt::OpFault{lane, m.lo, m.hi, addr, sizeof(E), idx, is_read};
    return nullptr;
  }
  return addr;
}

template <class T, class E>
bool op_mat_load(const CollArgs& a) {
  for (int l = 0; l < W32; ++l) {
    if (!on(a, l)) continue;
    MatAccess m = load<MatAccess>(a.in[l]);
    int r, c;
    frag_coords(l, r, c);
    vec<T, 2> v;
    for (int j = 0; j < 2; ++j) {
      E* e = mat_element<E>(m, r, c + j, l, true, a.fault);
      if (!e) return false;
      v[j] = static_cast<T>(*e);
    }
    store(a.out[l], v);
  }
  return true;
}

template <class T, class E>
bool op_mat_store(const CollArgs& a) {
  for (int l = 0; l < W32; ++l) {
    if (!on(a, l)) continue;
    MatStore<T> s = load<MatStore<T>>(a.in[l]);
    int r, c;
    frag_coords(l, r, c);
    for (int j = 0; j < 2; ++j) {
      E* e = mat_element<E>(s.at, r, c + j, l, false, a.fault);
      if (!e) return false;
      *e = static_cast<E>(s.frag[j]);
    }
  }
  return true;
}

struct MatProduct {
  float a[2], b[2], c[2];
};

// D = A * B + C over the fragments of all lanes, in float.
inline bool op_mat_mad(const CollArgs& args) {
  float A[8][8], B[8][8], C[8][8];
  const float nan = __builtin_nanf("");
  for (int l = 0; l < W32; ++l) {
    int r, c;
    frag_coords(l, r, c);
    MatProduct p = on(args, l) ? load<MatProduct>(args.in[l])
                               : MatProduct{{nan, nan}, {nan, nan}, {nan, nan}};
    for (int j = 0; j < 2; ++j) {
      A[r][c + j] = p.a[j];
      B[r][c + j] = p.b[j];
      C[r][c + j] = p.c[j];
    }
  }
  for (int l = 0; l < W32; ++l) {
    if (!on(args, l)) continue;
    int r, c;
    frag_coords(l, r, c);
    float d[2];
    for (int j = 0; j < 2; ++j) {
      float acc = C[r][c + j];
      for (int k = 0; k < 8; ++k) acc += A[r][k] * B[k][c + j];
      d[j] = acc;
    }
    store(args.out[l], d);
  }
  return true;
}

template <class E>
LILY_INLINE cptr<E> as_cptr(const cptr<E>& p) { return p; }
template <class E>
LILY_INLINE cptr<E> as_cptr(E* p) { return cptr<E>(p); }
template <class E>
LILY_INLINE cptr<E> as_cptr(const E* p) { return cptr<E>(p); }
template <class E, size_t N>
LILY_INLINE cptr<E> as_cptr(const arr<E, N>& a) { return a; }

template <class E>
LILY_INLINE MatAccess mat_access(const cptr<E>& p, uint64_t epr, vec<uint64_t, 2> origin,
                                 bool transpose) {
  return MatAccess{reinterpret_cast<char*>(p.p_), p.lo_, p.hi_, epr, origin.x, origin.y,
                   transpose ? 1 : 0};
}

}  // namespace simd
}  // namespace lily

namespace metal {

#define LILY_SITE int line = __builtin_LINE(), const char *file = __builtin_FILE()

// ---- reductions and scans (simd_* over 32 lanes, quad_* over 4) ----
#define LILY_COLLECTIVE_1(name, W, op)                                          \
  template <class T>                                                            \
  LILY_INLINE T name(T x, LILY_SITE) {                                          \
    return lily::simd::exchange<T>(x, &op, #name, line, file);                  \
  }
#define LILY_REDUCTIONS(prefix, W)                                                          \
  LILY_COLLECTIVE_1(prefix##_sum, W, (lily::simd::op_tree<T, W, lily::simd::Add, 0>))       \
  LILY_COLLECTIVE_1(prefix##_product, W, (lily::simd::op_tree<T, W, lily::simd::Mul, 1>))   \
  LILY_COLLECTIVE_1(prefix##_max, W, (lily::simd::op_fold<T, W, lily::simd::Max>))          \
  LILY_COLLECTIVE_1(prefix##_min, W, (lily::simd::op_fold<T, W, lily::simd::Min>))          \
  LILY_COLLECTIVE_1(prefix##_and, W, (lily::simd::op_fold<T, W, lily::simd::And>))          \
  LILY_COLLECTIVE_1(prefix##_or, W, (lily::simd::op_fold<T, W, lily::simd::Or>))            \
  LILY_COLLECTIVE_1(prefix##_xor, W, (lily::simd::op_fold<T, W, lily::simd::Xor>))          \
  LILY_COLLECTIVE_1(prefix##_prefix_inclusive_sum, W,                                       \
                    (lily::simd::op_scan<T, W, lily::simd::Add, 0, true>))                  \
  LILY_COLLECTIVE_1(prefix##_prefix_exclusive_sum, W,                                       \
                    (lily::simd::op_scan<T, W, lily::simd::Add, 0, false>))                 \
  LILY_COLLECTIVE_1(prefix##_prefix_inclusive_product, W,                                   \
                    (lily::simd::op_scan<T, W, lily::simd::Mul, 1, true>))                  \
  LILY_COLLECTIVE_1(prefix##_prefix_exclusive_product, W,                                   \
                    (lily::simd::op_scan<T, W, lily::simd::Mul, 1, false>))
LILY_REDUCTIONS(simd, 32)
LILY_REDUCTIONS(quad, 4)
#undef LILY_REDUCTIONS
#undef LILY_COLLECTIVE_1

// ---- shuffles ----
#define LILY_SHUFFLE(name, W, mode)                                              \
  template <class T>                                                             \
  LILY_INLINE T name(T x, uint16_t arg, LILY_SITE) {                             \
    return lily::simd::exchange<T>(lily::simd::ValueArg<T>{x, int32_t(arg)},     \
                                   &lily::simd::op_shuffle<T, W, lily::simd::mode>, \
                                   #name, line, file);                           \
  }
LILY_SHUFFLE(simd_shuffle, 32, kIndex)
LILY_SHUFFLE(simd_broadcast, 32, kIndex)
LILY_SHUFFLE(simd_shuffle_xor, 32, kXor)
LILY_SHUFFLE(simd_shuffle_up, 32, kUp)
LILY_SHUFFLE(simd_shuffle_down, 32, kDown)
LILY_SHUFFLE(simd_shuffle_rotate_up, 32, kRotateUp)
LILY_SHUFFLE(simd_shuffle_rotate_down, 32, kRotateDown)
LILY_SHUFFLE(quad_shuffle, 4, kIndex)
LILY_SHUFFLE(quad_broadcast, 4, kIndex)
LILY_SHUFFLE(quad_shuffle_xor, 4, kXor)
LILY_SHUFFLE(quad_shuffle_up, 4, kUp)
LILY_SHUFFLE(quad_shuffle_down, 4, kDown)
LILY_SHUFFLE(quad_shuffle_rotate_up, 4, kRotateUp)
LILY_SHUFFLE(quad_shuffle_rotate_down, 4, kRotateDown)
#undef LILY_SHUFFLE

// The value of the first active lane (of the SIMD-group / quad).
template <class T>
LILY_INLINE T simd_broadcast_first(T x, LILY_SITE) {
  return lily::simd::exchange<T>(lily::simd::ValueArg<T>{x, 0},
                                 &lily::simd::op_shuffle<T, 32, lily::simd::kFirst>,
                                 "simd_broadcast_first", line, file);
}
template <class T>
LILY_INLINE T quad_broadcast_first(T x, LILY_SITE) {
  return lily::simd::exchange<T>(lily::simd::ValueArg<T>{x, 0},
                                 &lily::simd::op_shuffle<T, 4, lily::simd::kFirst>,
                                 "quad_broadcast_first", line, file);
}

template <class T>
LILY_INLINE T simd_shuffle_and_fill_up(T data, T filling, uint16_t delta, uint16_t modulo = 32,
                                       LILY_SITE) {
  return lily::simd::exchange<T>(lily::simd::FillArgs<T>{data, filling, delta, modulo},
                                 &lily::simd::op_fill<T, true>, "simd_shuffle_and_fill_up",
                                 line, file);
}
template <class T>
LILY_INLINE T simd_shuffle_and_fill_down(T data, T filling, uint16_t delta, uint16_t modulo = 32,
                                         LILY_SITE) {
  return lily::simd::exchange<T>(lily::simd::FillArgs<T>{data, filling, delta, modulo},
                                 &lily::simd::op_fill<T, false>, "simd_shuffle_and_fill_down",
                                 line, file);
}

// ---- votes ----
struct simd_vote {
  using vote_t = uint64_t;
  vote_t bits_ = 0;
  vote_t active_ = 0xffffffffull;
  constexpr simd_vote() = default;
  constexpr explicit simd_vote(vote_t v) : bits_(v) {}
  constexpr simd_vote(vote_t v, vote_t active) : bits_(v), active_(active) {}
  constexpr explicit operator vote_t() const { return bits_; }
  constexpr bool all() const { return (bits_ & active_) == active_; }
  constexpr bool any() const { return bits_ != 0; }
};
using quad_vote = simd_vote;

#define LILY_VOTES(prefix, W)                                                          \
  LILY_INLINE simd_vote prefix##_ballot(bool b, LILY_SITE) {                          \
    auto r = lily::simd::exchange<lily::simd::VoteResult>(b, &lily::simd::op_ballot<W>, \
                                                          #prefix "_ballot", line, file); \
    return simd_vote(r.bits, r.active);                                               \
  }                                                                                   \
  LILY_INLINE simd_vote prefix##_active_threads_mask(LILY_SITE) {                     \
    auto r = lily::simd::exchange<lily::simd::VoteResult>(                            \
        true, &lily::simd::op_ballot<W>, #prefix "_active_threads_mask", line, file); \
    return simd_vote(r.bits, r.active);                                               \
  }                                                                                   \
  LILY_INLINE bool prefix##_all(bool b, LILY_SITE) {                                  \
    return prefix##_ballot(b, line, file).all();                                      \
  }                                                                                   \
  LILY_INLINE bool prefix##_any(bool b, LILY_SITE) {                                  \
    return prefix##_ballot(b, line, file).any();                                      \
  }                                                                                   \
  LILY_INLINE bool prefix##_is_first(LILY_SITE) {                                     \
    return lily::simd::exchange<bool>(true, &lily::simd::op_is_first<W>,              \
                                      #prefix "_is_first", line, file);               \
  }
LILY_VOTES(simd, 32)
LILY_VOTES(quad, 4)
#undef LILY_VOTES

// ---- simdgroup_matrix ----
template <class T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "simdgroup_matrix: only 8x8 is supported");
  lily::vec<T, 2> frag_;  // this lane's two elements (see frag_coords)

  simdgroup_matrix() = default;
  // A diagonal matrix with `d` on the diagonal.
  template <class S, std::enable_if_t<lily::is_scalar_v<S>, int> = 0>
  simdgroup_matrix(S d) {
    int r, c;
    lily::simd::frag_coords(int(lily::rt::lane_id()), r, c);
    frag_[0] = r == c ? T(d) : T(0);
    frag_[1] = r == c + 1 ? T(d) : T(0);
  }
  lily::vec<T, 2>& thread_elements() { return frag_; }
  const lily::vec<T, 2>& thread_elements() const { return frag_; }
};
using simdgroup_float8x8 = simdgroup_matrix<float, 8, 8>;
using simdgroup_half8x8 = simdgroup_matrix<half, 8, 8>;
using simdgroup_bfloat8x8 = simdgroup_matrix<bfloat, 8, 8>;

template <class T, int C, int R>
LILY_INLINE simdgroup_matrix<T, C, R> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, C, R> m;
  m.frag_ = lily::vec<T, 2>(value);
  return m;
}

template <class T, int C, int R, class P>
LILY_INLINE void simdgroup_load(simdgroup_matrix<T, C, R>& d, const P& src,
                                uint64_t elements_per_row = C,
                                lily::vec<uint64_t, 2> matrix_origin = lily::vec<uint64_t, 2>(0),
                                bool transpose_matrix = false, LILY_SITE) {
  auto p = lily::simd::as_cptr(src);
  using E = std::remove_cv_t<std::remove_reference_t<decltype(*p.p_)>>;
  d.frag_ = lily::simd::exchange<lily::vec<T, 2>>(
      lily::simd::mat_access(p, elements_per_row, matrix_origin, transpose_matrix),
      &lily::simd::op_mat_load<T, E>, "simdgroup_load", line, file);
}

template <class T, int C, int R, class P>
LILY_INLINE void simdgroup_store(const simdgroup_matrix<T, C, R>& a, const P& dst,
                                 uint64_t elements_per_row = C,
                                 lily::vec<uint64_t, 2> matrix_origin = lily::vec<uint64_t, 2>(0),
                                 bool transpose_matrix = false, LILY_SITE) {
  auto p = lily::simd::as_cptr(dst);
  using E = std::remove_cv_t<std::remove_reference_t<decltype(*p.p_)>>;
  lily::simd::exchange<bool>(
      lily::simd::MatStore<T>{
          lily::simd::mat_access(p, elements_per_row, matrix_origin, transpose_matrix), a.frag_},
      &lily::simd::op_mat_store<T, E>, "simdgroup_store", line, file);
}

template <class TD, class TA, class TB, class TC, int C, int R>
LILY_INLINE void simdgroup_multiply_accumulate(simdgroup_matrix<TD, C, R>& d,
                                               const simdgroup_matrix<TA, C, R>& a,
                                               const simdgroup_matrix<TB, C, R>& b,
                                               const simdgroup_matrix<TC, C, R>& c, LILY_SITE) {
  lily::simd::MatProduct p{{float(a.frag_[0]), float(a.frag_[1])},
                           {float(b.frag_[0]), float(b.frag_[1])},
                           {float(c.frag_[0]), float(c.frag_[1])}};
  auto r = lily::simd::exchange<lily::vec<float, 2>>(
      p, &lily::simd::op_mat_mad, "simdgroup_multiply_accumulate", line, file);
  d.frag_ = lily::vec<TD, 2>(TD(r[0]), TD(r[1]));
}

template <class TD, class TA, class TB, int C, int R>
LILY_INLINE void simdgroup_multiply(simdgroup_matrix<TD, C, R>& d,
                                    const simdgroup_matrix<TA, C, R>& a,
                                    const simdgroup_matrix<TB, C, R>& b, LILY_SITE) {
  simdgroup_matrix<float, C, R> zero;
  zero.frag_ = lily::vec<float, 2>(0.0f);
  simdgroup_multiply_accumulate(d, a, b, zero, line, file);
}

#undef LILY_SITE

}  // namespace metal
