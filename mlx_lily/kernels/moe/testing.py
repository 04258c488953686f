"""Inputs for the moe ops' self-checks, fuzz, tests and bench:
random arrays at given shapes, as the model would pass them."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.qwen3_next import Qwen3NextMLP
from mlx_lm.models.switch_layers import SwitchGLU

from .decode import BITS, GROUP_SIZE


def quantized_moe(hidden: int, inter: int, shared_inter: int, experts: int, seed: int = 0, dtype=mx.bfloat16):
    """(switch_mlp, shared_expert): 4-bit group-64 modules in ``dtype``, as the checkpoints have them."""
    mx.random.seed(seed)
    glu = SwitchGLU(hidden, inter, experts)
    shared = Qwen3NextMLP(hidden, shared_inter)
    for module in (glu, shared):
        module.set_dtype(dtype)
        nn.quantize(module, group_size=GROUP_SIZE, bits=BITS)
    mx.eval(glu.parameters(), shared.parameters())
    return glu, shared


def moe_decode_inputs(D, E, k, I, IS, normalize=True, rng=None, seed=0, logits=None, dtype=mx.bfloat16, rows=1):
    """A decode call of ``rows`` rows (tokens) at these shapes: random h, norm
    weight and gate logits in ``dtype``; ``logits``: E values, or [rows, E]."""
    rng = np.random.default_rng(seed) if rng is None else rng
    normal = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32))  # noqa: E731
    glu, shared = quantized_moe(D, I, IS, E, seed=int(rng.integers(1 << 30)), dtype=dtype)
    h = (4.0 * normal(rows, 1, D)).astype(dtype)
    norm_weight = (1.0 + 0.1 * normal(D)).astype(dtype)
    if logits is None:
        logits = 2.0 * rng.standard_normal((rows, 1, E))
    router_logits = mx.array(np.asarray(logits, dtype=np.float32)).reshape(rows, 1, E).astype(dtype)
    shared_gate_logit = normal(rows, 1, 1).astype(dtype)
    return (h, router_logits, shared_gate_logit, norm_weight, 1e-6, k, normalize, glu, shared), {}


def moe_router_inputs(D, E, k, normalize=True, rng=None, seed=0, dtype=mx.bfloat16, rows=1, bits=(8, 8)):
    """A router call of ``rows`` rows (tokens): random h and norm weight in
    ``dtype``, the router's E rows and the shared gate's one row quantized
    (group 64) at ``bits`` (router, shared gate), as the checkpoints have them."""
    rng = np.random.default_rng(seed) if rng is None else rng
    normal = lambda *shape: mx.array(rng.standard_normal(shape).astype(np.float32))  # noqa: E731

    def quantized(n, b):
        w = (normal(n, D) / np.sqrt(D)).astype(dtype)
        return tuple(mx.quantize(w, group_size=GROUP_SIZE, bits=b))

    h = (4.0 * normal(rows, 1, D)).astype(dtype)
    norm_weight = (1.0 + 0.1 * normal(D)).astype(dtype)
    gate, shared_gate = quantized(E, bits[0]), quantized(1, bits[1])
    mx.eval(h, norm_weight, gate, shared_gate)
    return (h, norm_weight, 1e-6, gate, shared_gate, k, normalize), {}
