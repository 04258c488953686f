"""Dtypes as kernel source spells them: MLX's own names (its
``get_type_string``: Metal signatures, the emulator, kernel-name suffixes) and
CUDA's, which differ only for the two half types. One table for the
toolchain and the emulator."""

from __future__ import annotations

import mlx.core as mx

MLX_TYPE_NAMES = {
    mx.bool_: "bool",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.float32: "float",
    mx.float64: "double",
    mx.complex64: "complex64_t",
}

# MLX's CUDA kernels' names for the same dtypes (cuda_kernel's signatures).
CUDA_TYPES = {**MLX_TYPE_NAMES, mx.float16: "__half", mx.bfloat16: "__nv_bfloat16"}
