// Memory for emulated kernels: bounds-checked pointers, threadgroup
// storage, atomics and barriers.
//
// The code generator rewrites every `device T*`, `constant T*` and
// `threadgroup T*` in kernel code to lily::ptr<T> (or lily::cptr<T> when
// const). Such a pointer carries the byte range [lo, hi) of the buffer it
// points into; every dereference is compared against it. The index of
// `p[i]` is taken through lily::index_t, whose implicit constructor records
// the caller's source line with __builtin_LINE(), so errors name the line of
// the kernel body. Pointers made from plain addresses (`&x[i]`) are
// unchecked (lo == nullptr).
#pragma once

#include "lily_runtime.h"
#include "lily_vector.h"

namespace lily {

// An array index together with the source line that used it.
struct index_t {
  int64_t v;
  int line;
  const char* file;
  template <class I, std::enable_if_t<std::is_integral<I>::value || std::is_enum<I>::value, int> = 0>
  LILY_INLINE index_t(I i, int l = __builtin_LINE(), const char* f = __builtin_FILE())
      : v(static_cast<int64_t>(i)), line(l), file(f) {}
};

template <class I>
constexpr bool is_index_v = std::is_integral<I>::value || std::is_enum<I>::value;

// Pointer arithmetic through integers, so that pointers may wander outside
// their buffer (only dereferencing is checked) without undefined behaviour.
template <class T>
LILY_INLINE T* offset(T* p, int64_t n) {
  return reinterpret_cast<T*>(reinterpret_cast<intptr_t>(p) +
                              n * static_cast<int64_t>(sizeof(T)));
}

// Read-only view: `const device T*`, `const constant T*`, `const threadgroup T*`.
template <class T>
struct cptr {
  T* p_ = nullptr;
  const char* lo_ = nullptr;  // nullptr: unchecked
  const char* hi_ = nullptr;

  cptr() = default;
  LILY_INLINE cptr(std::nullptr_t) {}
  LILY_INLINE cptr(const T* raw) : p_(const_cast<T*>(raw)) {}
  LILY_INLINE cptr(T* p, const char* lo, const char* hi) : p_(p), lo_(lo), hi_(hi) {}
  // Reinterpreting casts keep the buffer's bounds.
  template <class U, std::enable_if_t<!std::is_same<U, T>::value, int> = 0>
  LILY_INLINE explicit cptr(const cptr<U>& o)
      : p_(reinterpret_cast<T*>(o.p_)), lo_(o.lo_), hi_(o.hi_) {}
  template <class U, std::enable_if_t<!std::is_same<std::remove_cv_t<U>, T>::value, int> = 0>
  LILY_INLINE explicit cptr(U* raw) : p_(reinterpret_cast<T*>(const_cast<std::remove_cv_t<U>*>(raw))) {}

  // The address of element i, after checking it lies inside the buffer.
  LILY_INLINE T* at(int64_t i, bool is_read, int line, const char* file) const {
    T* q = offset(p_, i);
    if (lo_) {
      const char* c = reinterpret_cast<const char*>(q);
      if (__builtin_expect(c < lo_ || c + sizeof(T) > hi_ ||
                               c + sizeof(T) < c, 0)) {
        rt::fail_oob(lo_, hi_, q, sizeof(T), i, is_read, line, file);
      }
    }
    return q;
  }

  LILY_INLINE const T& operator[](index_t i) const { return *at(i.v, true, i.line, i.file); }
  LILY_INLINE const T& operator*() const { return *at(0, true, 0, nullptr); }
  LILY_INLINE const T* operator->() const { return at(0, true, 0, nullptr); }

  template <class I, std::enable_if_t<is_index_v<I>, int> = 0>
  LILY_INLINE cptr operator+(I n) const { return cptr(offset(p_, int64_t(n)), lo_, hi_); }
  template <class I, std::enable_if_t<is_index_v<I>, int> = 0>
  LILY_INLINE cptr operator-(I n) const { return cptr(offset(p_, -int64_t(n)), lo_, hi_); }
  template <class I, std::enable_if_t<is_index_v<I>, int> = 0>
  LILY_INLINE friend cptr operator+(I n, const cptr& p) { return p + n; }
  template <class I, std::enable_if_t<is_index_v<I>, int> = 0>
  LILY_INLINE cptr& operator+=(I n) { p_ = offset(p_, int64_t(n)); return *this; }
  template <class I, std::enable_if_t<is_index_v<I>, int> = 0>
  LILY_INLINE cptr& operator-=(I n) { p_ = offset(p_, -int64_t(n)); return *this; }
  LILY_INLINE cptr& operator++() { p_ = offset(p_, 1); return *this; }
  LILY_INLINE cptr& operator--() { p_ = offset(p_, -1); return *this; }
  LILY_INLINE cptr operator++(int) { cptr o = *this; ++*this; return o; }
  LILY_INLINE cptr operator--(int) { cptr o = *this; --*this; return o; }

  LILY_INLINE ptrdiff_t operator-(const cptr& o) const {
    return (reinterpret_cast<intptr_t>(p_) - reinterpret_cast<intptr_t>(o.p_)) /
           static_cast<intptr_t>(sizeof(T));
  }
  LILY_INLINE bool operator==(const cptr& o) const { return p_ == o.p_; }
  LILY_INLINE bool operator!=(const cptr& o) const { return p_ != o.p_; }
  LILY_INLINE bool operator<(const cptr& o) const { return p_ < o.p_; }
  LILY_INLINE bool operator>(const cptr& o) const { return p_ > o.p_; }
  LILY_INLINE bool operator<=(const cptr& o) const { return p_ <= o.p_; }
  LILY_INLINE bool operator>=(const cptr& o) const { return p_ >= o.p_; }
  LILY_INLINE bool operator==(std::nullptr_t) const { return p_ == nullptr; }
  LILY_INLINE bool operator!=(std::nullptr_t) const { return p_ != nullptr; }
  LILY_INLINE explicit operator bool() const { return p_ != nullptr; }
};

// Writable pointer: `device T*`, `threadgroup T*`. Derives from cptr<T> so
// that it converts to a const pointer and deduces `const device T*`
// template parameters, like a raw pointer does.
template <class T>
struct ptr : cptr<T> {
  using base = cptr<T>;

  ptr() = default;
  LILY_INLINE ptr(std::nullptr_t) {}
  LILY_INLINE ptr(T* raw) : base(raw) {}
  LILY_INLINE ptr(T* p, const char* lo, const char* hi) : base(p, lo, hi) {}
  // Casts, including casting const away, keep the bounds.
  template <class U>
  LILY_INLINE explicit ptr(const cptr<U>& o)
      : base(reinterpret_cast<T*>(o.p_), o.lo_, o.hi_) {}
  template <class U, std::enable_if_t<!std::is_same<U, T>::value, int> = 0>
  LILY_INLINE explicit ptr(U* raw) : base(reinterpret_cast<T*>(const_cast<std::remove_cv_t<U>*>(raw))) {}

  LILY_INLINE T& operator[](index_t i) const { return *this->at(i.v, false, i.line, i.file); }
  LILY_INLINE T& operator*() const { return *this->at(0, false, 0, nullptr); }
  LILY_INLINE T* operator->() const { return this->at(0, false, 0, nullptr); }

  template <class I, std::enable_if_t<is_index_v<I>, int> = 0>
  LILY_INLINE ptr operator+(I n) const { return ptr(offset(this->p_, int64_t(n)), this->lo_, this->hi_); }
  template <class I, std::enable_if_t<is_index_v<I>, int> = 0>
  LILY_INLINE ptr operator-(I n) const { return ptr(offset(this->p_, -int64_t(n)), this->lo_, this->hi_); }
  template <class I, std::enable_if_t<is_index_v<I>, int> = 0>
  LILY_INLINE friend ptr operator+(I n, const ptr& p) { return p + n; }
  template <class I, std::enable_if_t<is_index_v<I>, int> = 0>
  LILY_INLINE ptr& operator+=(I n) { this->p_ = offset(this->p_, int64_t(n)); return *this; }
  template <class I, std::enable_if_t<is_index_v<I>, int> = 0>
  LILY_INLINE ptr& operator-=(I n) { this->p_ = offset(this->p_, -int64_t(n)); return *this; }
  LILY_INLINE ptr& operator++() { this->p_ = offset(this->p_, 1); return *this; }
  LILY_INLINE ptr& operator--() { this->p_ = offset(this->p_, -1); return *this; }
  LILY_INLINE ptr operator++(int) { ptr o = *this; ++*this; return o; }
  LILY_INLINE ptr operator--(int) { ptr o = *this; --*this; return o; }
  using base::operator-;
};

// Thread-private or threadgroup storage of N elements with checked
// indexing: the inner dimensions of a multi-dimensional threadgroup array.
template <class T, size_t N>
struct arr {
  T data_[N];

  LILY_INLINE T* at(int64_t i, int line, const char* file) {
    if (__builtin_expect(i < 0 || i >= int64_t(N), 0)) {
      rt::fail_oob(data_, data_ + N, offset(data_, i), sizeof(T), i, false, line, file);
    }
    return data_ + i;
  }
  LILY_INLINE T& operator[](index_t i) { return *at(i.v, i.line, i.file); }
  LILY_INLINE const T& operator[](index_t i) const {
    return *const_cast<arr*>(this)->at(i.v, i.line, i.file);
  }
  // Array-to-pointer decay.
  LILY_INLINE operator ptr<T>() {
    return ptr<T>(data_, reinterpret_cast<const char*>(data_),
                  reinterpret_cast<const char*>(data_ + N));
  }
  LILY_INLINE operator cptr<T>() const {
    return cptr<T>(const_cast<T*>(data_), reinterpret_cast<const char*>(data_),
                   reinterpret_cast<const char*>(data_ + N));
  }
  template <class I, std::enable_if_t<is_index_v<I>, int> = 0>
  LILY_INLINE ptr<T> operator+(I n) { return ptr<T>(*this) + n; }
};

// Builds arr<arr<T, B>, A> for T[A][B], and so on.
template <class T, size_t... Dims>
struct nested_arr;
template <class T>
struct nested_arr<T> { using type = T; };
template <class T, size_t D, size_t... Rest>
struct nested_arr<T, D, Rest...> {
  using type = arr<typename nested_arr<T, Rest...>::type, D>;
};

// A threadgroup array `threadgroup T name[N]...` as seen by one thread: a
// checked pointer to the threadgroup's shared storage for that declaration.
template <class T, size_t N>
struct tg_array : ptr<T> {
  LILY_INLINE tg_array(T* data)
      : ptr<T>(data, reinterpret_cast<const char*>(data),
               reinterpret_cast<const char*>(data + N)) {}
};

template <class T, size_t... Dims>
struct tg_array_of;
template <class T, size_t D, size_t... Rest>
struct tg_array_of<T, D, Rest...> {
  using elem = typename nested_arr<T, Rest...>::type;
  using type = tg_array<elem, D>;
};

// `threadgroup T name[D0][D1]...;` -> `auto name = lily::tg_alloc<T, D0, D1>(slot, "name");`
template <class T, size_t... Dims>
LILY_INLINE typename tg_array_of<T, Dims...>::type tg_alloc(
    int slot, const char* name, int line = __builtin_LINE(),
    const char* file = __builtin_FILE()) {
  using A = tg_array_of<T, Dims...>;
  constexpr size_t count = (Dims * ...);
  void* p = rt::tg_var(slot, sizeof(T) * count, alignof(T), name, line, file);
  return typename A::type(static_cast<typename A::elem*>(p));
}

// `threadgroup T name;` -> `T& name = lily::tg_scalar<T>(slot, "name");`
template <class T>
LILY_INLINE T& tg_scalar(int slot, const char* name, int line = __builtin_LINE(),
                         const char* file = __builtin_FILE()) {
  return *static_cast<T*>(rt::tg_var(slot, sizeof(T), alignof(T), name, line, file));
}

// The element address a pointer-like argument denotes, checked when
// possible (used by atomics and simdgroup matrix loads).
template <class T>
LILY_INLINE T* element(T* p, int64_t i, bool, int, const char*) { return p + i; }
template <class T>
LILY_INLINE T* element(const cptr<T>& p, int64_t i, bool is_read, int line, const char* file) {
  return p.at(i, is_read, line, file);
}

}  // namespace lily

// ---------------------------------------------------------------------------
// Atomics. The threads of a launch run on one OS thread, so an atomic is a
// plain value; what matters is Metal's API and that a spin-wait lets other
// threads run (lily::rt::yield).
// ---------------------------------------------------------------------------
namespace metal {

enum memory_order {
  memory_order_relaxed,
  memory_order_acquire,
  memory_order_release,
  memory_order_acq_rel,
  memory_order_seq_cst,
};

enum class thread_scope { thread_scope_thread, thread_scope_simdgroup, thread_scope_threadgroup, thread_scope_device };

template <class T>
struct atomic {
  T v_;
};
using atomic_int = atomic<int>;
using atomic_uint = atomic<unsigned int>;
using atomic_bool = atomic<bool>;
using atomic_float = atomic<float>;
using atomic_ulong = atomic<uint64_t>;
using atomic_long = atomic<int64_t>;

template <class T, class U>
LILY_INLINE void atomic_store_explicit(volatile atomic<T>* a, U v, memory_order = memory_order_relaxed) {
  const_cast<atomic<T>*>(a)->v_ = T(v);
}
template <class T>
LILY_INLINE T atomic_load_explicit(volatile atomic<T>* a, memory_order = memory_order_relaxed) {
  lily::rt::yield();  // a load may be a spin-wait
  return const_cast<atomic<T>*>(a)->v_;
}
template <class T, class U>
LILY_INLINE T atomic_exchange_explicit(volatile atomic<T>* a, U v, memory_order = memory_order_relaxed) {
  atomic<T>* o = const_cast<atomic<T>*>(a);
  T old = o->v_;
  o->v_ = T(v);
  return old;
}
template <class T, class U>
LILY_INLINE bool atomic_compare_exchange_weak_explicit(volatile atomic<T>* a, T* expected, U desired,
                                                       memory_order = memory_order_relaxed,
                                                       memory_order = memory_order_relaxed) {
  atomic<T>* o = const_cast<atomic<T>*>(a);
  if (o->v_ == *expected) {
    o->v_ = T(desired);
    return true;
  }
  *expected = o->v_;
  lily::rt::yield();  // a failed exchange may be a spin-wait
  return false;
}
template <class T, class U>
LILY_INLINE bool atomic_compare_exchange_strong_explicit(volatile atomic<T>* a, T* expected, U desired,
                                                         memory_order s = memory_order_relaxed,
                                                         memory_order f = memory_order_relaxed) {
  return atomic_compare_exchange_weak_explicit(a, expected, desired, s, f);
}

#define LILY_ATOMIC_FETCH(name, expr)                                                   \
  template <class T, class U>                                                           \
  LILY_INLINE T name(volatile atomic<T>* a, U operand, memory_order = memory_order_relaxed) { \
    atomic<T>* o = const_cast<atomic<T>*>(a);                                           \
    T old = o->v_;                                                                      \
    T v = T(operand);                                                                   \
    o->v_ = T(expr);                                                                    \
    return old;                                                                         \
  }
LILY_ATOMIC_FETCH(atomic_fetch_add_explicit, old + v)
LILY_ATOMIC_FETCH(atomic_fetch_sub_explicit, old - v)
LILY_ATOMIC_FETCH(atomic_fetch_and_explicit, old & v)
LILY_ATOMIC_FETCH(atomic_fetch_or_explicit, old | v)
LILY_ATOMIC_FETCH(atomic_fetch_xor_explicit, old ^ v)
LILY_ATOMIC_FETCH(atomic_fetch_max_explicit, old < v ? v : old)
LILY_ATOMIC_FETCH(atomic_fetch_min_explicit, v < old ? v : old)
#undef LILY_ATOMIC_FETCH

// The same operations given a checked pointer (`out + i`) instead of an
// address (`&out[i]`): the element is bounds-checked first.
#define LILY_ATOMIC_VIA_PTR(name)                                               \
  template <class T, class... Rest>                                             \
  LILY_INLINE auto name(const lily::cptr<atomic<T>>& p, Rest... rest) {         \
    return name(lily::element(p, 0, false, 0, nullptr), rest...);               \
  }
LILY_ATOMIC_VIA_PTR(atomic_store_explicit)
LILY_ATOMIC_VIA_PTR(atomic_load_explicit)
LILY_ATOMIC_VIA_PTR(atomic_exchange_explicit)
LILY_ATOMIC_VIA_PTR(atomic_compare_exchange_weak_explicit)
LILY_ATOMIC_VIA_PTR(atomic_compare_exchange_strong_explicit)
LILY_ATOMIC_VIA_PTR(atomic_fetch_add_explicit)
LILY_ATOMIC_VIA_PTR(atomic_fetch_sub_explicit)
LILY_ATOMIC_VIA_PTR(atomic_fetch_and_explicit)
LILY_ATOMIC_VIA_PTR(atomic_fetch_or_explicit)
LILY_ATOMIC_VIA_PTR(atomic_fetch_xor_explicit)
LILY_ATOMIC_VIA_PTR(atomic_fetch_max_explicit)
LILY_ATOMIC_VIA_PTR(atomic_fetch_min_explicit)
#undef LILY_ATOMIC_VIA_PTR

LILY_INLINE void atomic_thread_fence(int, memory_order = memory_order_relaxed, thread_scope = thread_scope::thread_scope_device) {}

// ---------------------------------------------------------------------------
// Barriers
// ---------------------------------------------------------------------------
enum class mem_flags : unsigned {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16,
};
constexpr mem_flags operator|(mem_flags a, mem_flags b) {
  return mem_flags(unsigned(a) | unsigned(b));
}

// Every thread of the threadgroup must arrive, at the same barrier.
LILY_INLINE void threadgroup_barrier(mem_flags, int line = __builtin_LINE(),
                                     const char* file = __builtin_FILE()) {
  lily::rt::barrier(false, line, file);
}
// Every lane of the SIMD-group must arrive, at the same barrier.
LILY_INLINE void simdgroup_barrier(mem_flags, int line = __builtin_LINE(),
                                   const char* file = __builtin_FILE()) {
  lily::rt::barrier(true, line, file);
}

}  // namespace metal
