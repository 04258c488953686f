"""Lily's ops, one package per kernel family (``attention``, ``gated_delta``,
``moe``, ``linear``), each op defined in the module that registers it, its
``.metal`` bodies beside it; see toolchain/registry.py for how each op chooses
between its custom kernel and its pure-MLX reference."""

from ..toolchain.registry import OPS, LilyOp, gpu_backend, kernels_enabled
from .attention.qk_norm_rope import qk_norm_rope
from .attention.sdpa import attention
from .gated_delta.conv import conv_qk_norm
from .gated_delta.decode import gated_delta_decode, gated_delta_decode_steps
from .gated_delta.norm import gated_rms_norm
from .gated_delta.recurrence import gated_delta
from .gated_delta.rows import gated_delta_rows
from .linear.gemv import quantized_matvec
from .linear.gemv_tiles import decode_matvec, quantized_matvec_tiles
from .linear.matmul import matmul_nt
from .moe.combine import moe_combine
from .moe.decode import moe_decode
from .moe.decode_router import moe_decode_router
from .moe.experts import moe_experts
from .moe.router import router_topk

__all__ = [
    "OPS", "LilyOp", "gpu_backend", "kernels_enabled",
    "attention", "qk_norm_rope", "conv_qk_norm", "gated_delta", "gated_delta_decode",
    "gated_delta_decode_steps", "gated_delta_rows",
    "moe_combine", "moe_experts", "moe_decode", "moe_decode_router", "gated_rms_norm", "router_topk", "matmul_nt",
    "quantized_matvec", "quantized_matvec_tiles", "decode_matvec",
]
