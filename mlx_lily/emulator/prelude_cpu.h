// The CPU prelude: Metal's names for C++, included (as a precompiled
// header) at the top of every kernel the emulator compiles.
//
// The address-space keywords become empty macros once the code generator has
// rewritten the places where they matter (pointer types and threadgroup
// declarations); Metal's standard library lives in namespace metal and is
// imported into the global namespace, as MLX's kernel prelude does.
#pragma once

#include "lily_scalar.h"
#include "lily_vector.h"
#include "lily_math.h"
#include "lily_memory.h"
#include "lily_simd.h"
#include "lily_mlx_utils.h"

namespace lily {
LILY_INLINE uint3 to_uint3(const rt::U3& u) { return uint3(u.x, u.y, u.z); }
}  // namespace lily

#define device
#define constant
#define thread
#define threadgroup
#define kernel
#define METAL_FUNC inline
#define METAL_CONST constexpr

using namespace metal;
