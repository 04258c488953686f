"""Lily's ops, one kernel family per module; see registry.py for how each op
chooses between its custom kernel and its pure-MLX reference."""

from .attention import attention, qk_norm_rope
from .conv import conv_qk_norm
from .gated_delta import gated_delta
from .gated_delta_decode import gated_delta_decode
from .gemv import quantized_matvec
from .matmul import matmul_nt
from .moe import moe_combine, moe_experts
from .moe_decode import moe_decode
from .norms import gated_rms_norm
from ..toolchain.registry import OPS, LilyOp, gpu_backend, kernels_enabled
from .router import router_topk

__all__ = [
    "OPS", "LilyOp", "gpu_backend", "kernels_enabled",
    "attention", "qk_norm_rope", "conv_qk_norm", "gated_delta", "gated_delta_decode",
    "moe_combine", "moe_experts", "moe_decode", "gated_rms_norm", "router_topk", "matmul_nt",
    "quantized_matvec",
]
