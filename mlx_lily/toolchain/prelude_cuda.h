// mlx-lily CUDA prelude: the Metal names of lily's portable kernel subset, for CUDA.
//
// lily writes each kernel once, as a Metal Shading Language body (the form
// mx.fast.metal_kernel takes). On NVIDIA GPUs the toolchain hands the same body
// to mx.fast.cuda_kernel with this file as its `header`. MLX places the header
// after its own includes (mlx/backend/cuda/device/utils.cuh, which brings
// cuda_bf16.h, cuda_fp16.h and cuda/std) and before
//
//     namespace mlx::core::cu { __global__ void custom_kernel_<name>(...) { <body> } }
//
// so everything here lives at global scope and is found from the body by
// ordinary lookup. MLX compiles with NVRTC and --device-as-default-execution-space;
// every function is still marked __device__ so that nvcc can compile-check
// the same translation unit (tests/test_toolchain.py).
//
// The subset itself (what a body may use) is documented in mlx_lily/kernels/lint.py.
// Semantics that differ from Metal and that bodies rely on:
//  * SIMD groups are CUDA warps (32 lanes). Every SIMD collective below uses the
//    full-warp mask, so all 32 lanes of a SIMD group must reach it (the subset's
//    rule on every backend; lily's toolchain makes each threadgroup a whole number
//    of SIMD groups and each grid a whole number of threadgroups).
//  * CUDA does not clip the last block: bodies guard the tail themselves.
//  * Barriers are __syncthreads whatever the mem_flags: it orders both shared
//    and global memory within the block, a superset of every Metal flag.

// ---------------------------------------------------------------------------
// Types and address spaces
// ---------------------------------------------------------------------------

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef __half half;
typedef __half float16_t;
typedef __nv_bfloat16 bfloat16_t;


#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
#ifndef NAN
#define NAN __int_as_float(0x7fffffff)
#endif
#ifndef FLT_MAX
#define FLT_MAX 3.402823466e+38F
#endif
#ifndef FLT_MIN
#define FLT_MIN 1.175494351e-38F
#endif
#ifndef M_PI_F
#define M_PI_F 3.14159265358979323846F
#endif
#ifndef M_LN2_F
#define M_LN2_F 0.69314718055994530942F
#endif
#ifndef M_LOG2E_F
#define M_LOG2E_F 1.44269504088896340736F
#endif

// ---------------------------------------------------------------------------
// Thread-position builtins (Metal kernel attributes), from threadIdx/blockIdx
// ---------------------------------------------------------------------------

#define LILY_SIMD_WIDTH 32u
#define LILY_FULL_MASK 0xffffffffu

// The helpers carry names of their own: the builtins below are macros, and a
// helper sharing a builtin's name would be rewritten by them.
namespace lily_cuda {

__device__ __forceinline__ uint3 position_in_grid() {
  return make_uint3(
      blockIdx.x * blockDim.x + threadIdx.x,
      blockIdx.y * blockDim.y + threadIdx.y,
      blockIdx.z * blockDim.z + threadIdx.z);
}

__device__ __forceinline__ uint3 grid_threads() {
  return make_uint3(
      gridDim.x * blockDim.x, gridDim.y * blockDim.y, gridDim.z * blockDim.z);
}

// Metal numbers the threads of a threadgroup x fastest, then y, then z; SIMD
// groups are consecutive runs of 32 in that order, as CUDA warps are.
__device__ __forceinline__ uint index_in_group() {
  return threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
}

__device__ __forceinline__ uint simd_groups_in_group() {
  uint threads = blockDim.x * blockDim.y * blockDim.z;
  return (threads + LILY_SIMD_WIDTH - 1) / LILY_SIMD_WIDTH;
}

__device__ __forceinline__ uint lane() {
  return index_in_group() % LILY_SIMD_WIDTH;
}

} // namespace lily_cuda

#define thread_position_in_grid (lily_cuda::position_in_grid())
#define thread_position_in_threadgroup (threadIdx)
#define threadgroup_position_in_grid (blockIdx)
#define threads_per_threadgroup (blockDim)
#define threadgroups_per_grid (gridDim)
#define threads_per_grid (lily_cuda::grid_threads())
#define thread_index_in_threadgroup (lily_cuda::index_in_group())
#define thread_index_in_simdgroup (lily_cuda::lane())
#define simdgroup_index_in_threadgroup \
  (lily_cuda::index_in_group() / LILY_SIMD_WIDTH)
#define simdgroups_per_threadgroup (lily_cuda::simd_groups_in_group())
#define threads_per_simdgroup (LILY_SIMD_WIDTH)
#define thread_execution_width (LILY_SIMD_WIDTH)

// ---------------------------------------------------------------------------
// Barriers
// ---------------------------------------------------------------------------

namespace mem_flags {
enum : int { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
} // namespace mem_flags

__device__ __forceinline__ void threadgroup_barrier(int) {
  __syncthreads();
}

__device__ __forceinline__ void simdgroup_barrier(int) {
  __syncwarp(LILY_FULL_MASK);
}

// ---------------------------------------------------------------------------
// SIMD-group functions (all 32 lanes take part; see the top of this file)
// ---------------------------------------------------------------------------

namespace lily_cuda {

template <typename T>
__device__ __forceinline__ T larger(T a, T b) {
  return b > a ? b : a;
}

template <typename T>
__device__ __forceinline__ T smaller(T a, T b) {
  return b < a ? b : a;
}

// The xor butterfly leaves the same value on every lane: at each step lanes i
// and i^o add the same two operands (in swapped order, which is exact), so
// floating-point reductions agree bit for bit across the SIMD group, as on Metal.
#define LILY_SIMD_REDUCE(NAME, COMBINE)                                   \
  template <typename T>                                                   \
  __device__ __forceinline__ T NAME(T x) {                                \
    for (int offset = LILY_SIMD_WIDTH / 2; offset > 0; offset >>= 1) {    \
      T other = __shfl_xor_sync(LILY_FULL_MASK, x, offset);               \
      x = COMBINE;                                                        \
    }                                                                     \
    return x;                                                             \
  }

LILY_SIMD_REDUCE(reduce_sum, x + other)
LILY_SIMD_REDUCE(reduce_product, x * other)
LILY_SIMD_REDUCE(reduce_max, larger(x, other))
LILY_SIMD_REDUCE(reduce_min, smaller(x, other))
LILY_SIMD_REDUCE(reduce_and, x & other)
LILY_SIMD_REDUCE(reduce_or, x | other)
LILY_SIMD_REDUCE(reduce_xor, x ^ other)
#undef LILY_SIMD_REDUCE

} // namespace lily_cuda

template <typename T>
__device__ __forceinline__ T simd_sum(T x) {
  return lily_cuda::reduce_sum(x);
}
template <typename T>
__device__ __forceinline__ T simd_product(T x) {
  return lily_cuda::reduce_product(x);
}
template <typename T>
__device__ __forceinline__ T simd_max(T x) {
  return lily_cuda::reduce_max(x);
}
template <typename T>
__device__ __forceinline__ T simd_min(T x) {
  return lily_cuda::reduce_min(x);
}
template <typename T>
__device__ __forceinline__ T simd_and(T x) {
  return lily_cuda::reduce_and(x);
}
template <typename T>
__device__ __forceinline__ T simd_or(T x) {
  return lily_cuda::reduce_or(x);
}
template <typename T>
__device__ __forceinline__ T simd_xor(T x) {
  return lily_cuda::reduce_xor(x);
}

template <typename T>
__device__ __forceinline__ T simd_shuffle(T x, uint lane) {
  return __shfl_sync(LILY_FULL_MASK, x, lane);
}
template <typename T>
__device__ __forceinline__ T simd_broadcast(T x, uint lane) {
  return __shfl_sync(LILY_FULL_MASK, x, lane);
}
// Metal broadcasts from the first active lane; under the subset's rule every
// lane is active, so that is lane 0.
template <typename T>
__device__ __forceinline__ T simd_broadcast_first(T x) {
  return __shfl_sync(LILY_FULL_MASK, x, 0);
}
template <typename T>
__device__ __forceinline__ T simd_shuffle_xor(T x, uint mask) {
  return __shfl_xor_sync(LILY_FULL_MASK, x, mask);
}
// Lanes whose source lies outside the SIMD group keep their own value, as on Metal.
template <typename T>
__device__ __forceinline__ T simd_shuffle_down(T x, uint delta) {
  return __shfl_down_sync(LILY_FULL_MASK, x, delta);
}
template <typename T>
__device__ __forceinline__ T simd_shuffle_up(T x, uint delta) {
  return __shfl_up_sync(LILY_FULL_MASK, x, delta);
}
template <typename T>
__device__ __forceinline__ T simd_shuffle_rotate_down(T x, uint delta) {
  return __shfl_sync(
      LILY_FULL_MASK, x, (lily_cuda::lane() + delta) % LILY_SIMD_WIDTH);
}
template <typename T>
__device__ __forceinline__ T simd_shuffle_rotate_up(T x, uint delta) {
  return __shfl_sync(
      LILY_FULL_MASK,
      x,
      (lily_cuda::lane() + LILY_SIMD_WIDTH - delta % LILY_SIMD_WIDTH) %
          LILY_SIMD_WIDTH);
}

template <typename T>
__device__ __forceinline__ T simd_prefix_inclusive_sum(T x) {
  uint lane = lily_cuda::lane();
  for (uint offset = 1; offset < LILY_SIMD_WIDTH; offset <<= 1) {
    T below = __shfl_up_sync(LILY_FULL_MASK, x, offset);
    if (lane >= offset) {
      x = x + below;
    }
  }
  return x;
}
// Shifting the inclusive scan by one lane (rather than subtracting x) keeps the
// exclusive sums exact copies of the inclusive ones.
template <typename T>
__device__ __forceinline__ T simd_prefix_exclusive_sum(T x) {
  T inclusive = simd_prefix_inclusive_sum(x);
  T below = __shfl_up_sync(LILY_FULL_MASK, inclusive, 1);
  return lily_cuda::lane() == 0 ? T(0) : below;
}

__device__ __forceinline__ bool simd_all(bool predicate) {
  return __all_sync(LILY_FULL_MASK, predicate);
}
__device__ __forceinline__ bool simd_any(bool predicate) {
  return __any_sync(LILY_FULL_MASK, predicate);
}
// Metal returns a simd_vote; bodies convert it with static_cast<uint64_t>(...).
__device__ __forceinline__ uint64_t simd_ballot(bool predicate) {
  return static_cast<uint64_t>(__ballot_sync(LILY_FULL_MASK, predicate));
}
__device__ __forceinline__ bool simd_is_first() {
  return lily_cuda::lane() == 0;
}

// ---------------------------------------------------------------------------
// Atomics (Metal's explicit-order functions; only relaxed order exists on Metal)
// ---------------------------------------------------------------------------

// Metal outputs built with atomic_outputs=True are `device atomic<T>*`, and
// threadgroup atomics are declared `threadgroup atomic<T> x[...]`; on CUDA both
// are plain T, updated with the atomic* intrinsics.
template <typename T>
using atomic = T;
typedef int atomic_int;
typedef unsigned int atomic_uint;
typedef float atomic_float;

enum memory_order { memory_order_relaxed };

namespace lily_cuda {
// Keeps a value argument from taking part in template deduction, so that
// atomic_fetch_add_explicit(uint_ptr, 1, ...) deduces T from the pointer alone.
template <typename T>
struct same {
  typedef T type;
};
} // namespace lily_cuda

template <typename T>
__device__ __forceinline__ T atomic_fetch_add_explicit(
    T* object, typename lily_cuda::same<T>::type value, memory_order) {
  return atomicAdd(object, value);
}
template <typename T>
__device__ __forceinline__ T atomic_fetch_sub_explicit(
    T* object, typename lily_cuda::same<T>::type value, memory_order) {
  return atomicSub(object, value);
}
__device__ __forceinline__ float
atomic_fetch_sub_explicit(float* object, float value, memory_order) {
  return atomicAdd(object, -value);
}
template <typename T>
__device__ __forceinline__ T atomic_fetch_max_explicit(
    T* object, typename lily_cuda::same<T>::type value, memory_order) {
  return atomicMax(object, value);
}
template <typename T>
__device__ __forceinline__ T atomic_fetch_min_explicit(
    T* object, typename lily_cuda::same<T>::type value, memory_order) {
  return atomicMin(object, value);
}
template <typename T>
__device__ __forceinline__ T atomic_fetch_and_explicit(
    T* object, typename lily_cuda::same<T>::type value, memory_order) {
  return atomicAnd(object, value);
}
template <typename T>
__device__ __forceinline__ T atomic_fetch_or_explicit(
    T* object, typename lily_cuda::same<T>::type value, memory_order) {
  return atomicOr(object, value);
}
template <typename T>
__device__ __forceinline__ T atomic_fetch_xor_explicit(
    T* object, typename lily_cuda::same<T>::type value, memory_order) {
  return atomicXor(object, value);
}
template <typename T>
__device__ __forceinline__ T atomic_exchange_explicit(
    T* object, typename lily_cuda::same<T>::type value, memory_order) {
  return atomicExch(object, value);
}
template <typename T>
__device__ __forceinline__ T atomic_load_explicit(T* object, memory_order) {
  return *static_cast<volatile T*>(object);
}
template <typename T>
__device__ __forceinline__ void atomic_store_explicit(
    T* object, typename lily_cuda::same<T>::type value, memory_order) {
  *static_cast<volatile T*>(object) = value;
}
// int and uint only, as atomicCAS.
template <typename T>
__device__ __forceinline__ bool atomic_compare_exchange_weak_explicit(
    T* object,
    T* expected,
    typename lily_cuda::same<T>::type desired,
    memory_order,
    memory_order) {
  T seen = atomicCAS(object, *expected, desired);
  if (seen == *expected) {
    return true;
  }
  *expected = seen;
  return false;
}

// ---------------------------------------------------------------------------
// Math: Metal's metal::, metal::fast:: and metal::precise:: names in use
// ---------------------------------------------------------------------------

// Unqualified exp, log, sqrt, max, min, fma, ... on float resolve to CUDA's
// own float overloads; only the Metal-only names need defining globally.
template <typename T>
__device__ __forceinline__ T clamp(T x, T lo, T hi) {
  return x < lo ? lo : (hi < x ? hi : x);
}
// Metal's select(a, b, c) is c ? b : a.
template <typename T>
__device__ __forceinline__ T select(T a, T b, bool c) {
  return c ? b : a;
}

#define LILY_UNARY(NS_NAME, CUDA_FN) \
  __device__ __forceinline__ float NS_NAME(float x) { return CUDA_FN(x); }

namespace metal {
namespace precise {
LILY_UNARY(exp, ::expf)
LILY_UNARY(exp2, ::exp2f)
LILY_UNARY(log, ::logf)
LILY_UNARY(log2, ::log2f)
LILY_UNARY(sqrt, ::sqrtf)
LILY_UNARY(rsqrt, ::rsqrtf)
LILY_UNARY(tanh, ::tanhf)
LILY_UNARY(sin, ::sinf)
LILY_UNARY(cos, ::cosf)
__device__ __forceinline__ float pow(float x, float y) {
  return ::powf(x, y);
}
} // namespace precise

// Metal's default math is its fast-math flavour; CUDA's intrinsics are the
// closest equivalent where one exists.
namespace fast {
LILY_UNARY(exp, ::__expf)
LILY_UNARY(exp2, ::exp2f)
LILY_UNARY(log, ::__logf)
LILY_UNARY(log2, ::__log2f)
LILY_UNARY(sqrt, ::sqrtf)
LILY_UNARY(rsqrt, ::rsqrtf)
LILY_UNARY(tanh, ::tanhf)
LILY_UNARY(sin, ::__sinf)
LILY_UNARY(cos, ::__cosf)
__device__ __forceinline__ float pow(float x, float y) {
  return ::__powf(x, y);
}
} // namespace fast

// metal::exp and friends: the precise flavour, so that CUDA results stay close
// to the references (which run MLX's own, precise kernels).
LILY_UNARY(exp, ::expf)
LILY_UNARY(exp2, ::exp2f)
LILY_UNARY(log, ::logf)
LILY_UNARY(log2, ::log2f)
LILY_UNARY(sqrt, ::sqrtf)
LILY_UNARY(rsqrt, ::rsqrtf)
LILY_UNARY(tanh, ::tanhf)
LILY_UNARY(sin, ::sinf)
LILY_UNARY(cos, ::cosf)
LILY_UNARY(abs, ::fabsf)
LILY_UNARY(fabs, ::fabsf)
LILY_UNARY(floor, ::floorf)
LILY_UNARY(ceil, ::ceilf)
LILY_UNARY(round, ::roundf)
LILY_UNARY(trunc, ::truncf)
__device__ __forceinline__ float pow(float x, float y) {
  return ::powf(x, y);
}
__device__ __forceinline__ float fma(float a, float b, float c) {
  return ::fmaf(a, b, c);
}
__device__ __forceinline__ float fmax(float a, float b) {
  return ::fmaxf(a, b);
}
__device__ __forceinline__ float fmin(float a, float b) {
  return ::fminf(a, b);
}
template <typename T>
__device__ __forceinline__ T max(T a, T b) {
  return lily_cuda::larger(a, b);
}
template <typename T>
__device__ __forceinline__ T min(T a, T b) {
  return lily_cuda::smaller(a, b);
}
template <typename T>
__device__ __forceinline__ T clamp(T x, T lo, T hi) {
  return ::clamp(x, lo, hi);
}
template <typename T>
__device__ __forceinline__ T select(T a, T b, bool c) {
  return c ? b : a;
}
} // namespace metal

#undef LILY_UNARY

// ---------------------------------------------------------------------------
// Vector types: CUDA's float2..uint4 structs, with Metal's elementwise operators
// ---------------------------------------------------------------------------

// Bodies use components (.x .y .z .w), brace initialisation and these
// operators; swizzles and vector constructors are outside the subset.
#define LILY_VEC_OP2(V, S, OP)                                            \
  __device__ __forceinline__ V operator OP(V a, V b) {                    \
    return {a.x OP b.x, a.y OP b.y};                                      \
  }                                                                       \
  __device__ __forceinline__ V operator OP(V a, S s) {                    \
    return {a.x OP s, a.y OP s};                                          \
  }                                                                       \
  __device__ __forceinline__ V operator OP(S s, V a) {                    \
    return {s OP a.x, s OP a.y};                                          \
  }
#define LILY_VEC_OP3(V, S, OP)                                            \
  __device__ __forceinline__ V operator OP(V a, V b) {                    \
    return {a.x OP b.x, a.y OP b.y, a.z OP b.z};                          \
  }                                                                       \
  __device__ __forceinline__ V operator OP(V a, S s) {                    \
    return {a.x OP s, a.y OP s, a.z OP s};                                \
  }                                                                       \
  __device__ __forceinline__ V operator OP(S s, V a) {                    \
    return {s OP a.x, s OP a.y, s OP a.z};                                \
  }
#define LILY_VEC_OP4(V, S, OP)                                            \
  __device__ __forceinline__ V operator OP(V a, V b) {                    \
    return {a.x OP b.x, a.y OP b.y, a.z OP b.z, a.w OP b.w};              \
  }                                                                       \
  __device__ __forceinline__ V operator OP(V a, S s) {                    \
    return {a.x OP s, a.y OP s, a.z OP s, a.w OP s};                      \
  }                                                                       \
  __device__ __forceinline__ V operator OP(S s, V a) {                    \
    return {s OP a.x, s OP a.y, s OP a.z, s OP a.w};                      \
  }
#define LILY_VEC_OPS(N, V, S) \
  LILY_VEC_OP##N(V, S, +)     \
  LILY_VEC_OP##N(V, S, -)     \
  LILY_VEC_OP##N(V, S, *)     \
  LILY_VEC_OP##N(V, S, /)

LILY_VEC_OPS(2, float2, float)
LILY_VEC_OPS(3, float3, float)
LILY_VEC_OPS(4, float4, float)
LILY_VEC_OPS(2, int2, int)
LILY_VEC_OPS(3, int3, int)
LILY_VEC_OPS(4, int4, int)
LILY_VEC_OPS(2, uint2, uint)
LILY_VEC_OPS(3, uint3, uint)
LILY_VEC_OPS(4, uint4, uint)

#undef LILY_VEC_OPS
#undef LILY_VEC_OP2
#undef LILY_VEC_OP3
#undef LILY_VEC_OP4

// ---------------------------------------------------------------------------
// Address spaces: last, because CUDA spells __device__ and __constant__ as
// __attribute__((device)) and __attribute__((constant)), which these macros
// would empty if they came first.
// ---------------------------------------------------------------------------

// Metal spells memory spaces on pointers and variables. On CUDA, buffers are
// plain pointers and threadgroup memory is __shared__ (declared at body scope,
// which is where the lint allows `threadgroup`).
#define device
#define constant
#define thread
#define threadgroup __shared__
