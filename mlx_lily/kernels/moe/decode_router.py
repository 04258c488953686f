"""MoE decode, the router's launch: for B rows (one token each, B <=
``MAX_BATCH``) everything before the experts in one launch, a threadgroup
per row::

    moe_decode_router(h, norm_weight, eps, gate, shared_gate, top_k, norm_topk_prob)
        -> (logits [B, 1, E], shared_logit [B, 1, 1], xn [B, D], inds [B, k], scores [B, k])

The router GEMV with its RMSNorm prologue (``gate`` and ``shared_gate`` are
(w, scales, biases) triples, 4- or 8-bit, group 64), route's RMSNorm and
the top-k (``moe_decode_route``'s outputs, which ``moe_decode`` takes as
``routed=`` instead of routing again). The launch gives the bits of the two
launches it replaces, the row GEMV (gemv.metal's B = 1 order) and
``moe_decode_route``, so a token decodes to the same bits either way
(moe_decode_router.metal says how; tests compare them). Why: the picks are
made once a layer, in the launch that makes the logits, so one stream's
gate/up no longer redoes them in every threadgroup (the routed launch) and
batches take a launch a layer fewer. One threadgroup per row is slower than
the two launches on the H200 below 16 rows, so it is off by default
(``MIN_ROWS``).

The reference is stock's ops (``rms_norm``, the two quantized matmuls, the
softmax top-k); the contract: the logits and the shared gate's logit meet
the GEMV's (``quantized_matvec_agree``), xn is ``rms_norm(h)`` to a rounding
step, and the picks and weights are the router's top-k of the launch's own
logits (``router_outputs_agree``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from ...toolchain.kernel import Kernel, Launch, SIMD_WIDTH
from ...toolchain.registry import LilyOp, gpu_backend, register
from ..dtypes import ACTIVATION_DTYPES, STEP, activation_dtype_reason
from ..linear.gemv import (
    quantized_matvec_agree,
    quantized_matvec_reference,
    quantized_matvec_supports,
    single_row_simdgroups,
)
from .decode import MAX_BATCH, MAX_EXPERTS, MAX_K, ROUTE_NORM_SG, _eps_array
from .router import TOPK_HEADER, router_outputs_agree, router_topk_ground_truth, router_topk_reference

# The model's MoE decode steps of at least this many rows take this launch
# (the layer's ``_moe_step``); smaller ones the router GEMV, then moe_decode
# routes (the same bits either way). One threadgroup reading a row's 257
# router rows is latency-bound: on the H200 the launch took 60 µs of device
# time at every B against 16.5 / 19.0 / 22.7 / 33.2 / 65.1 for the two
# launches at B = 1 / 2 / 4 / 8 / 16 (moe_router_launch, weights from
# memory, bench/results/2026-12-04-nvidia-h200-38188be), and in one-stream
# decode 6.14 against 5.01 device ms a token. At 16 rows it saved 5 µs and
# a launch a layer, about 1% of a 16-row step, yet a server whose full
# batches take it meets the router GEMV's 16-row build first at 9 to 15 rows
# (priming would need both). So no call takes it by default (MAX_BATCH + 1);
# a smaller value turns it on. Metal: not measured.
MIN_ROWS = MAX_BATCH + 1
# SIMD groups per threadgroup (each at least both norms' SIMD groups) and
# router rows per SIMD group at a time (a lane loads all their units before
# it multiplies: ROWS x ceil(D / 512) 16-byte loads in flight). Neither
# changes a row's sums. On CUDA (sm_90) 2 rows take 72 registers a thread,
# too many for 1,024 threads (the launch fails; lily then runs the
# reference, with a notice), so 16 SIMD groups; nvcc left 4-bit words in
# local memory at 1 row and 4.
SIMD_GROUPS = 16
ROWS_PER_SG = 2
ROWS_CHOICES = (1, 2, 4)
MAX_D = 4096  # the GEMV's staged input: D values of T in threadgroup memory


def moe_decode_router_reference(h, norm_weight, eps, gate, shared_gate, top_k, norm_topk_prob):
    """Stock's ops: the router and the shared gate on rms_norm(h), the
    softmax top-k of the router's logits, rms_norm(h) as xn."""
    B, D = h.shape[0], h.shape[-1]
    logits, shared_logit = quantized_matvec_reference(h, (gate, shared_gate), norm_weight, eps)
    inds, scores = router_topk_reference(logits, int(top_k), bool(norm_topk_prob))
    xn = mx.fast.rms_norm(h, norm_weight, eps).reshape(B, D)
    return logits, shared_logit, xn, inds.reshape(B, -1).astype(mx.uint32), scores.reshape(B, -1)


def moe_decode_router_supports(h, norm_weight, eps, gate, shared_gate, top_k, norm_topk_prob) -> Optional[str]:
    """None when the launch takes this call, else why not."""
    if h.ndim != 3 or h.shape[1] != 1 or not 1 <= h.shape[0] <= MAX_BATCH:
        return f"h {tuple(h.shape)} (kernel: [B, 1, D], 1 <= B <= {MAX_BATCH})"
    if h.dtype not in ACTIVATION_DTYPES:
        return activation_dtype_reason("h", h.dtype)
    if norm_weight.dtype != h.dtype:
        return f"norm_weight dtype {norm_weight.dtype} (kernel: h's, {h.dtype})"
    why = quantized_matvec_supports(h, (gate, shared_gate), norm_weight, eps)
    if why is not None:
        return why
    D, E = h.shape[-1], gate[0].shape[0]
    if D > MAX_D:
        return f"D={D} (kernel: at most {MAX_D})"
    if shared_gate[0].shape[0] != 1:
        return f"shared gate of {shared_gate[0].shape[0]} rows (kernel: 1)"
    if not 1 <= E <= MAX_EXPERTS:
        return f"{E} experts (kernel: 1 to {MAX_EXPERTS})"
    if not 1 <= int(top_k) <= min(E, MAX_K):
        return f"top_k={top_k} with {E} experts (kernel: 1 <= k <= min(E, {MAX_K}))"
    return None


def _steps(D: int, bits: int) -> int:
    """A lane's 16-byte units of a row of D values at ``bits``."""
    return math.ceil(D / (SIMD_WIDTH * 128 // bits))


def _launch(h, norm_weight, eps, gate, shared_gate, top_k, norm_topk_prob, *,
            simdgroups: Optional[int] = None, rows_per_sg: Optional[int] = None) -> Launch:
    """The call's launch; ``simdgroups`` and ``rows_per_sg`` are tuning
    choices (default SIMD_GROUPS, ROWS_PER_SG) that leave every row's bits
    as they are."""
    B, D, k = h.shape[0], h.shape[-1], int(top_k)
    (gw, gs, gb), (sw, ss, sb) = gate, shared_gate
    E = gw.shape[0]
    gate_bits, shared_bits = int(gw.shape[1]) * 32 // D, int(sw.shape[1]) * 32 // D
    gemv_norm_sg = single_row_simdgroups((E, 1), gpu_backend())
    nsg = SIMD_GROUPS if simdgroups is None else int(simdgroups)
    rows = ROWS_PER_SG if rows_per_sg is None else int(rows_per_sg)
    if not max(gemv_norm_sg, ROUTE_NORM_SG) <= nsg <= 32:
        raise ValueError(f"simdgroups {nsg}: {max(gemv_norm_sg, ROUTE_NORM_SG)} (both norms' SIMD groups) to 32")
    if rows not in ROWS_CHOICES:
        raise ValueError(f"rows_per_sg {rows}: one of {ROWS_CHOICES}")
    return Launch(
        inputs=[h, norm_weight, _eps_array(float(eps)), gw, gs, gb, sw, ss, sb],
        grid=(nsg * SIMD_WIDTH, B, 1),
        threadgroup=(nsg * SIMD_WIDTH, 1, 1),
        output_shapes=[(B, 1, E), (B, 1, 1), (B, D), (B, k), (B, k)],
        output_dtypes=[h.dtype, h.dtype, h.dtype, mx.uint32, h.dtype],
        template=[("T", h.dtype), ("E", E), ("K", k), ("VALS", math.ceil(E / SIMD_WIDTH)),
                  ("NORMALIZE", bool(norm_topk_prob)), ("D", D),
                  ("BITS", gate_bits), ("SHARED_BITS", shared_bits),
                  ("NSG", nsg), ("GEMV_NORM_SG", gemv_norm_sg), ("NORM_SG", ROUTE_NORM_SG), ("ROWS", rows),
                  ("STEPS", max(_steps(D, bits) for bits in (gate_bits, shared_bits)))],
        finish=tuple,
    )


def moe_decode_router_agree(got, want, h, norm_weight, eps, gate, shared_gate, top_k, norm_topk_prob) -> Optional[str]:
    """None when the launch's outputs meet the contract (module docstring)."""
    if len(got) != 5:
        return f"{len(got)} outputs (kernel: 5)"
    logits, shared_logit, xn, inds, scores = got
    for name, g, w in zip(("logits", "shared_logit", "xn", "inds", "scores"), got, want):
        if g.shape != w.shape or g.dtype != w.dtype:
            return f"{name}: {tuple(g.shape)} {g.dtype} (reference: {tuple(w.shape)} {w.dtype})"
    why = quantized_matvec_agree((logits, shared_logit), want[:2], h, (gate, shared_gate), norm_weight, eps)
    if why is not None:
        return f"router GEMV: {why}"
    B, k = inds.shape
    order, weights, _ = router_topk_ground_truth(logits.reshape(B, -1), k, bool(norm_topk_prob))
    truth = (mx.array(order), mx.array(weights.astype(np.float32)).astype(scores.dtype))
    why = router_outputs_agree((inds, scores), truth, logits.reshape(B, -1), k, bool(norm_topk_prob))
    if why is not None:
        return f"top-k of the launch's logits: {why}"
    normed = np.array(mx.fast.rms_norm(h, norm_weight, eps).reshape(xn.shape).astype(mx.float32), np.float64)
    got_xn = np.array(xn.astype(mx.float32), np.float64)
    # One rounding step of xn's dtype: the two sums of squares may differ in order.
    if not (np.abs(got_xn - normed) <= STEP[xn.dtype] * np.abs(normed) + 1e-30).all():
        return f"xn off rms_norm(h) by {float(np.abs(got_xn - normed).max()):.3g}"
    return None


def _sample():
    from .testing import moe_router_inputs

    return moe_router_inputs(128, 24, 3, seed=3, rows=2)


def _fuzz(rng):
    """A random call: 1 to 4 rows (now and then MAX_BATCH), D, E, k, 4- or
    8-bit router and shared gate, renormalised or not, bf16 or fp16."""
    from .testing import moe_router_inputs

    rows = int(rng.choice([1, 1, 2, 3, 4, MAX_BATCH]))
    D = int(rng.choice([64, 128, 192, 320]))
    E = int(rng.choice([int(rng.integers(1, 33)), int(rng.integers(33, 80))]))
    k = int(rng.integers(1, min(E, 8) + 1))
    dtype = ACTIVATION_DTYPES[int(rng.integers(len(ACTIVATION_DTYPES)))]
    return moe_router_inputs(D, E, k, rng=rng, rows=rows, dtype=dtype, normalize=bool(rng.random() < 0.6),
                             bits=(int(rng.choice([4, 8])), int(rng.choice([4, 8]))))


moe_decode_router_kernel = Kernel(
    name="moe_decode_router",
    input_names=("h", "norm_weight", "eps", "router_w", "router_s", "router_b", "shared_w", "shared_s",
                 "shared_b"),
    output_names=("logits", "shared_logit", "xn", "inds", "scores"),
    body=Path(__file__).with_name("moe_decode_router.metal"),
    header=TOPK_HEADER,
    launch=_launch,
    reference=moe_decode_router_reference,
    sample=_sample,
    agree=moe_decode_router_agree,
    tiles=True,  # lily_tile_unpack only (4-bit words to floats)
)


def _compare(got, want) -> tuple[bool, float]:
    """(acceptable, largest logit difference relative to the largest
    logit), for doctor, which has no inputs to judge with: the logits within
    2^-4 (the GEMV's doctor bound; stock's CPU matmul sums bf16 in bf16)."""
    g, w = (np.array(a[0].astype(mx.float32), np.float64) for a in (got, want))
    if g.shape != w.shape or not np.isfinite(g).all():
        return False, math.inf
    err = float(np.abs(g - w).max(initial=0.0)) / max(float(np.abs(w).max(initial=0.0)), 1e-30)
    return err <= 2.0**-4, err


moe_decode_router = register(
    LilyOp(
        "moe_decode_router",
        moe_decode_router_reference,
        kernel=moe_decode_router_kernel,
        supports=moe_decode_router_supports,
        description="MoE decode router of 1-16 tokens in one launch: norm, router + shared gate GEMV, top-k, "
                    "the experts' normed input",
        sample=_sample,
        compare=_compare,
        fuzz=_fuzz,
        # The model calls it only where MIN_ROWS turns it on: "every op
        # ran" checks leave it out.
        in_model=False,
    )
)
