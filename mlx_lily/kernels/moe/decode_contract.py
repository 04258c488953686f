"""The MoE decode op's contract: what the kernels of ``decode.py`` must give.

``moe_decode_precise`` is stock's math with fp32 accumulation, the kernels'
choice of experts (``router_topk_ground_truth``) and stock's roundings to the
activations' dtype, row by row, with the magnitudes each output element is
made of; ``moe_decode_agree`` holds the kernels' output to it within
``RELATIVE_TOLERANCE`` of those magnitudes, and ``moe_decode_compare`` holds
it to stock's own output (for doctor). The reasoning:
docs/kernel-notes.md#moe-decode. Kept apart from the launchers so that
neither module grows past a reader's page count.
"""

from __future__ import annotations

import math
from typing import Optional

import mlx.core as mx
import numpy as np

from ..dtypes import step_scale
from .router import router_topk_ground_truth

GROUP_SIZE, BITS = 64, 4

# Per element, relative to the magnitudes it is made of (module docstring).
RELATIVE_TOLERANCE = 2**-7
# Against stock on the same machine, relative to the output's largest value
# (stock's CPU quantized matmuls accumulate in bf16).
STOCK_TOLERANCE = 6e-2


def _parts(module) -> list:
    out = []
    for name in ("gate_proj", "up_proj", "down_proj"):
        layer = getattr(module, name)
        out.append((layer.weight, layer.scales, layer.biases))
    return out


def _rounded(a: mx.array, dtype=mx.bfloat16) -> mx.array:
    return a.astype(dtype).astype(mx.float32)


def _dequantized(weight, scales, biases) -> mx.array:
    """One matrix [out, in] in fp32: scale * q + bias, unrounded (as the kernels use it)."""
    return mx.dequantize(weight, scales.astype(mx.float32), biases.astype(mx.float32),
                         group_size=GROUP_SIZE, bits=BITS)


def moe_decode_precise(
    h, router_logits, shared_gate_logit, norm_weight, eps, top_k, norm_topk_prob, switch_mlp, shared_expert,
    *, residual=True, routed=None,
):
    """(out [B, 1, D] in h's dtype, magnitudes [B * D] fp32): stock's math with
    fp32 accumulation, the kernels' choice of experts (``router_topk_ground_truth``)
    and stock's bf16 roundings, row by row; magnitudes is what the tolerance
    scales with (module docstring). Dequantizes each row's k experts only.
    ``residual=False``: the MoE output without h (nor |h| in the magnitudes).
    ``routed`` (the router launch's picks, those of these logits) changes
    nothing here."""
    B = h.shape[0]
    outs, magnitudes = [], []
    for b in range(B):
        out, magnitude = _precise_row(h[b:b + 1], router_logits[b:b + 1], shared_gate_logit[b:b + 1], norm_weight,
                                      eps, top_k, norm_topk_prob, switch_mlp, shared_expert, residual)
        outs.append(out)
        magnitudes.append(magnitude)
    return mx.concatenate(outs, axis=0), mx.concatenate(magnitudes, axis=0)


def _precise_row(h, router_logits, shared_gate_logit, norm_weight, eps, top_k, norm_topk_prob, switch_mlp,
                 shared_expert, residual=True):
    """``moe_decode_precise`` of one row: h [1, 1, D]."""
    D = h.shape[-1]
    k = int(top_k)

    def rounded(a):  # to the activations' dtype (bf16 or fp16), as the kernels round
        return _rounded(a, h.dtype)

    hf = h.reshape(D).astype(mx.float32)
    xn = mx.fast.rms_norm(h, norm_weight, eps).reshape(D).astype(mx.float32)
    order, weights, _ = router_topk_ground_truth(router_logits.reshape(1, -1), k, bool(norm_topk_prob))
    scores = rounded(mx.array(weights[0].astype(np.float32)))
    gate, up, down = _parts(switch_mlp)
    sgate, sup, sdown = _parts(shared_expert)

    def activations(g_parts, u_parts):
        g = rounded(_dequantized(*g_parts) @ xn)
        u = rounded(_dequantized(*u_parts) @ xn)
        sig = rounded(1.0 / (1.0 + mx.exp(-g)))
        return rounded(rounded(g * sig) * u)

    routed = mx.zeros((D,), mx.float32)
    magnitude = mx.abs(hf) if residual else mx.zeros((D,), mx.float32)
    for j, e in enumerate(order[0].tolist()):
        a = activations(*([p[e] for p in part] for part in (gate, up)))
        wd = _dequantized(*(p[e] for p in down))
        y = rounded(wd @ a)
        routed = routed + rounded(y * scores[j])
        magnitude = magnitude + mx.abs(scores[j]) * (mx.abs(wd) @ mx.abs(a))
    a_s = activations(sgate, sup)
    wsd = _dequantized(*sdown)
    open_ = rounded(mx.sigmoid(shared_gate_logit.reshape(1).astype(mx.float32)))
    gated = rounded(open_ * rounded(wsd @ a_s))
    magnitude = magnitude + open_ * (mx.abs(wsd) @ mx.abs(a_s))
    moe = rounded(rounded(routed) + gated)
    out = rounded(hf + moe) if residual else moe
    return out.astype(h.dtype).reshape(1, 1, D), magnitude


def moe_decode_agree(got, want, *args, **kwargs) -> Optional[str]:
    """None when the kernels' output meets the contract (module docstring)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{tuple(got.shape)} {got.dtype} vs reference {tuple(want.shape)} {want.dtype}"
    precise, magnitude = moe_decode_precise(*args, **kwargs)
    g = np.array(got.astype(mx.float32)).reshape(-1).astype(np.float64)
    p = np.array(precise.astype(mx.float32)).reshape(-1).astype(np.float64)
    m = np.array(magnitude).astype(np.float64)
    if not np.array_equal(np.isnan(g), np.isnan(p)):
        return f"NaN in {int(np.isnan(g).sum())} elements vs the precise result's {int(np.isnan(p).sum())}"
    ok = ~np.isnan(p)
    tolerance = RELATIVE_TOLERANCE * step_scale(got.dtype)
    bound = tolerance * (np.nan_to_num(m[ok], nan=np.inf) + np.abs(p[ok])) + 1e-30
    excess = np.abs(g[ok] - p[ok]) / bound
    if excess.size and not excess.max() <= 1.0:
        worst = int(np.argmax(excess))
        return (f"max |kernel - precise| / ({tolerance:.3g} of its terms' magnitudes) = {excess.max():.3g} "
                f"(element {worst}: {g[ok][worst]:.6g} vs {p[ok][worst]:.6g})")
    return None


def moe_decode_compare(got, want) -> tuple[bool, float]:
    """(acceptable, largest difference relative to the output's largest value), for doctor."""
    g = np.array(got.astype(mx.float32)).astype(np.float64)
    w = np.array(want.astype(mx.float32)).astype(np.float64)
    if g.shape != w.shape or not np.isfinite(g).all():
        return False, math.inf
    err = float(np.abs(g - w).max(initial=0.0)) / max(float(np.abs(w).max(initial=0.0)), 1e-30)
    return err <= STOCK_TOLERANCE, err
