"""MoE decode chain: the routed experts and the shared expert of B rows (one
token each: server decode, speculative verification; B <= ``MAX_BATCH``) in
four launches, from the post-attention residual h to the layer's output.

``moe_decode`` takes the two gates' logits from the caller (they come out of
the same GEMV as the rest of the layer's small projections) and does the
rest: ``moe_decode_route`` (router top-k and RMSNorm, a threadgroup per row),
``moe_decode_gate_up`` and ``moe_decode_down`` (gate, up, SwiGLU, then down
with the routing weights and the shared gate, a threadgroup per block of rows
and entry: the shared expert, and each distinct expert of the rows' picks,
found from the picks by its first occurrence; each selected expert's
weights, and the shared expert's, read once for every row that uses them),
and ``moe_decode_combine`` (per row its slots in its own order, the shared
term and the residual; with ``residual=False``, a tensor-parallel rank's
partial sum, not the residual: ``h + out(residual=False)`` is
``out(residual=True)`` to the bit). One row (one stream's step) takes two
launches: route with gate/up, and down with the combine. Batch invariant:
each row's result is the same bits whatever B is and whatever the other rows
hold (the bodies' comments say why). The reference is stock's op sequence,
to the bit.

Stock's math, the kernels, what they take, and the contract
(``moe_decode_agree``, decode_contract.py) with its reasoning:
docs/kernel-notes.md#moe-decode.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.qwen3_next import Qwen3NextMLP
from mlx_lm.models.switch_layers import SwiGLU, SwitchGLU

from ...toolchain.kernel import Kernel, Launch, SampleCheckedKernels, SIMD_WIDTH
from ...toolchain.registry import LilyOp, gpu_backend, register
from ..dtypes import ACTIVATION_DTYPES, activation_dtype_reason
from .combine import moe_combine_reference
from .decode_contract import (  # noqa: F401 - the contract, importable from here too
    BITS,
    GROUP_SIZE,
    RELATIVE_TOLERANCE,
    STOCK_TOLERANCE,
    _parts,
    moe_decode_agree,
    moe_decode_compare,
    moe_decode_precise,
)
from .experts import quantized_as_kernel_takes
from .router import TOPK_HEADER, router_topk_reference

ROUTE_NORM_SG = 8  # SIMD groups of a row's RMSNorm, beside its top-k's one
ROUTE_THREADS = (1 + ROUTE_NORM_SG) * SIMD_WIDTH
# Launch shapes, passed to the bodies as template constants; none changes a
# row's sums (moe_decode_sweep times the choices). Gate/up: SIMD groups per
# threadgroup, a hidden row of one expert each. Down: SIMD groups per
# threadgroup and output rows per SIMD group (its weights held in registers).
GATE_UP_SIMD_GROUPS = 8
# Gate/up's hidden rows per SIMD group: as two launches, and as the routed
# one (a few rows, ROUTED_MAX_ROWS), whose every threadgroup first redoes
# every row's top-k and norm. Every choice gives a row the same bits. The
# routed launch on CUDA by B (while ROUTED_ROWS_BY_BATCH; the sweep's
# choices turn it off): (at least B, rows per SIMD group). Device µs with
# the weights read from memory on the H200 (moe_decode_sweep --cold 8,
# bench/results/2026-12-03-nvidia-h200-1428e8a), rows 1 / 2 / 4 / 8: B = 1
# 34.3 / 35.9 / 40.1 / 42.5; B = 4 102.9 / 72.9 / 77.5 / 118.4. B = 2 and 3
# were not timed. Elsewhere (Metal, not measured; the emulator)
# ROUTED_ROWS_PER_SG at every B. Those times predate the loads run ahead
# across turns (a turn's first step loaded during the turn before's last):
# until then each turn of a SIMD group waited out its own loads, so several
# rows a SIMD group cost about as many times one row's latency. Not yet
# timed with it (moe_decode_sweep --launch: "gate_up rows N", "routed rows N").
GATE_UP_ROWS_PER_SG = 1
ROUTED_ROWS_PER_SG = 1
CUDA_ROUTED_ROWS_FOR_BATCH = ((4, 2), (1, 1))
ROUTED_ROWS_BY_BATCH = True
ROWS_PER_SG_CHOICES = (1, 2, 4, 8)
DOWN_SIMD_GROUPS, DOWN_ROWS_PER_SG = 8, 4
SIMD_GROUP_CHOICES = (2, 4, 8, 16)
DOWN_ROWS_CHOICES = (1, 2, 4, 8)
# Down on CUDA by B, the call's rows: (at least B, SIMD groups, rows per SIMD
# group). Few rows run fastest in few, full threadgroups (64 output rows
# each), many rows in more, smaller ones (16). Down's device µs on the H200
# (moe_decode_sweep --launch, bench/results/2026-12-03-nvidia-h200-922ac27):
# B = 1: 16 x 4 7.6, 8 x 4 11.3; B = 4: 8 x 4 23.5, 4 x 4 23.6; B = 16:
# 4 x 4 73.8, 8 x 4 91.2. B = 8 was not timed. Elsewhere (Metal, not
# measured; the emulator) and while DOWN_BY_BATCH is off (the sweep's
# choices): DOWN_SIMD_GROUPS x DOWN_ROWS_PER_SG at every B. Every choice gives
# a row the same bits.
CUDA_DOWN_LAUNCH_FOR_BATCH = ((8, 4, 4), (3, 8, 4), (1, 16, 4))
DOWN_BY_BATCH = True
# Gate/up takes the rows that use an expert this many at a time (its
# accumulators are registers: fewer rows a pass, more threadgroups resident);
# any value gives every row the same bits. One row a pass was the fastest at
# every B on the H200 (gate/up at the real shapes, B = 1 / 4 / 8 / 16: 8.8 /
# 28.5 / 55.0 / 103.9 µs, against 35.9 / 122.5 / 227.6 / 399.4 with all 16
# rows' accumulators; moe_decode_sweep, bench/results/2026-12-03-nvidia-h200-e77d914).
# A row's later passes read the expert's rows from cache. Metal: not measured.
GATE_UP_GROUPS = (1, 2, 4, 8, 16)
GATE_UP_GROUP = 1
# Calls of at most this many rows take route and gate/up as one launch
# (moe_decode_route_gate_up.metal.h): one stream's decode step, one launch
# fewer per layer. Each threadgroup then redoes every row's top-k and norm,
# which costs device time; the same bits either way. H200, one stream at B =
# 1 (bench/results/2026-12-03-nvidia-h200-b941f9d): the one launch is 34 us
# of device time a layer, the two 16 us (route 6.8, gate/up 9.4), yet the
# step with the two launches (40 more a token) took 7.8 ms a token against
# 5.7: the host, not the GPU, bounds one stream there. A speculative round's
# verification (2 to 4 rows) is bound by the GPU instead: with the one launch
# up to 4 rows a k = 1 round took 8.04 device ms and a k = 3 round 13.24;
# with the two launches from 2 rows, 6.23 and 10.68 (the routed launch 76 us
# at B = 4 against 35 for the two; bench/results/2026-12-04-nvidia-h200-26444a1).
# Those times predate the routed build's x in threadgroup memory (94
# registers a thread before, 56 now: four threadgroups an SM, not two): 28.0
# us at B = 1 and 39.4 at B = 2 with it, where the two launches take about 16
# and 22 (bench/results/2026-12-05-nvidia-h200-78c2dda). At k = 1 verification
# (B = 2) the one launch and the two gave the same speedups within the host's
# spread there, so 2 rows keep the two. The routed build is tested at 1 to 4 rows (the sweep's
# "routed rows N" choices raise this to 4).
ROUTED_MAX_ROWS = 1
# The routed launch keeps its rows' normed x in threadgroup memory (T values,
# D a row): at most this many bytes, within the 32 KB a Metal threadgroup
# may hold beside its other arrays. Larger calls take the two launches.
ROUTED_XN_BYTES = 16 * 1024
# Calls of at most this many rows take down and the combine as one launch,
# row by row (moe_decode_down_combine.metal): one stream's decode step, one
# launch fewer per layer. Each row then reads its own picks' down weights, so
# calls that share experts between rows keep the expert-major down. The same
# bits either way. A first form (a SIMD group per output element, walking its
# 9 slots) took 21.3 µs at B = 1 on the H200 against 10.1 for down and the
# combine (bench/results/2026-12-03-nvidia-h200-f1f8b78). This form gives each
# slot a SIMD group of the threadgroup (down's work per SIMD group) and sums
# the slots in threadgroup memory. In a one-stream step at 4K on the H200
# (decode_ab, bench/results/2026-12-04-nvidia-h200-26444a1) it took the same
# device time as the two launches (5.13 against 5.08 ms a token; 4.90
# against 5.04 in an earlier run) with 289 kernels a token against 329, and
# 6.19 ms a token against 7.84 over four rounds in rotated order (an earlier
# run, the two launches always first: 7.25 against 5.99). moe_decode_sweep
# --launch times it ("combined down ...", against "down apart"). Up to two
# rows: a k = 1 speculative round verifies two positions and is bound by the
# host; with the one launch at two rows it spent 8.7 ms of host time against
# 10.3 (submitting 5.21 against 6.22 ms, building 2.50 against 2.92) on one
# H200, one run after the other (bench --spec --k 1 --set ...=2,
# bench/results/2026-12-04-nvidia-h200-efe1204). Its launch:
# SIMD groups per threadgroup (None: one per slot, K + 1, at most 32) and
# output elements per threadgroup.
COMBINED_DOWN_MAX_ROWS = 2
COMBINED_DOWN_SIMD_GROUPS, COMBINED_DOWN_ROWS = None, 4
COMBINED_DOWN_ROWS_CHOICES = (1, 2, 4, 8, 16)
COMBINE_THREADS = 256
# Rows (one token each) a call may have: server decode and speculative
# verification (at most 16: gate/up and down give each row a lane, and gate/up
# packs a row's index in four bits). Every B
# runs the same build (B is read from the inputs' shapes at run time), so
# that a row's result is the same bits whatever B is.
MAX_BATCH = 16
# The top-k keeps ceil(E / 32) probabilities a lane in registers (as the
# router kernel: at most 32), and lane r holds the r-th pick.
MAX_EXPERTS = 1024
MAX_K = SIMD_WIDTH
# Each gate/up lane holds its units' weights in registers: D / 1024 units.
MAX_D = 4096
# The bodies index with 32-bit unsigned integers.
MAX_ELEMENTS = 2**31


def moe_decode_reference(
    h, router_logits, shared_gate_logit, norm_weight, eps, top_k, norm_topk_prob, switch_mlp, shared_expert,
    *, residual=True, routed=None,
):
    """h [B, 1, D] -> h + moe(rms_norm(h)) [B, 1, D], stock's ops in stock's
    order; ``residual=False``: moe(rms_norm(h)) alone (a tensor-parallel
    rank's partial sum, which stock sums across ranks before adding h).
    ``routed``: the router launch's (xn, inds, scores) for these logits
    (decode_router.py), which the kernels take instead of routing again;
    the reference routes itself."""
    xn = mx.fast.rms_norm(h, norm_weight, eps)
    inds, scores = router_topk_reference(router_logits, top_k, norm_topk_prob)
    y = switch_mlp(xn, inds)
    shared = shared_expert(xn)
    moe = moe_combine_reference(y, scores, shared, shared_gate_logit)
    return h + moe if residual else moe


def _linear_as_kernel_takes(layer, dtype=mx.bfloat16) -> Optional[str]:
    return quantized_as_kernel_takes(layer, dtype, nn.QuantizedLinear)


def _dims(layer) -> tuple[int, int]:
    """(output, input) dimensions of a quantized (switch) linear."""
    return layer.weight.shape[-2], layer.weight.shape[-1] * 32 // layer.bits


def moe_decode_supports(
    h, router_logits, shared_gate_logit, norm_weight, eps, top_k, norm_topk_prob, switch_mlp, shared_expert,
    *, residual=True, routed=None,
) -> Optional[str]:
    """None when the kernels take this call, else why not."""
    if h.ndim != 3 or h.shape[1] != 1:
        return f"h {tuple(h.shape)} (kernel: one token per row, [B, 1, D])"
    B, D = h.shape[0], h.shape[-1]
    if not 1 <= B <= MAX_BATCH:
        return f"B={B} rows (kernel: 1 to MAX_BATCH={MAX_BATCH})"
    if routed is not None:
        want = ((B, D), h.dtype), ((B, top_k), mx.uint32), ((B, top_k), h.dtype)
        for name, a, (shape, dtype) in zip(("xn", "inds", "scores"), routed, want):
            if tuple(a.shape) != shape or a.dtype != dtype:
                return f"routed {name} {tuple(a.shape)} {a.dtype} (kernel: {list(shape)} {dtype})"
    if router_logits.ndim != 3 or router_logits.shape[:2] != (B, 1):
        return f"router_logits {tuple(router_logits.shape)} for h {tuple(h.shape)} (kernel: one token per row, [B, 1, E])"
    E = router_logits.shape[-1]
    if tuple(shared_gate_logit.shape) != (B, 1, 1):
        return f"shared_gate_logit {tuple(shared_gate_logit.shape)} (kernel: [{B}, 1, 1])"
    if tuple(norm_weight.shape) != (D,):
        return f"norm_weight {tuple(norm_weight.shape)} (kernel: [{D}])"
    if h.dtype not in ACTIVATION_DTYPES:
        return activation_dtype_reason("h", h.dtype)
    for name, x in (("router_logits", router_logits), ("shared_gate_logit", shared_gate_logit),
                    ("norm_weight", norm_weight)):
        if x.dtype != h.dtype:
            return f"{name} dtype {x.dtype} (kernel: h's, {h.dtype})"
    if D % GROUP_SIZE or D > MAX_D:
        return f"D={D} (kernel: a multiple of {GROUP_SIZE}, at most {MAX_D})"
    if not 1 <= E <= MAX_EXPERTS:
        return f"{E} experts (kernel: 1 to {MAX_EXPERTS})"
    if not 1 <= top_k <= min(E, MAX_K):
        return f"top_k={top_k} with {E} experts (kernel: 1 <= k <= min(E, {MAX_K}))"
    if not isinstance(switch_mlp, SwitchGLU) or type(switch_mlp.activation) is not SwiGLU:
        return f"{type(switch_mlp).__name__} (kernel: SwitchGLU with SwiGLU)"
    if not isinstance(shared_expert, Qwen3NextMLP):
        return f"shared expert {type(shared_expert).__name__} (kernel: Qwen3NextMLP)"
    for owner, module in (("switch_mlp", switch_mlp), ("shared_expert", shared_expert)):
        check = quantized_as_kernel_takes if owner == "switch_mlp" else _linear_as_kernel_takes
        for name in ("gate_proj", "up_proj", "down_proj"):
            why = check(getattr(module, name), h.dtype)
            if why is not None:
                return f"{owner}.{name}: {why}"
    (I, Dg), (Iu, Du), (Dd, Id) = (_dims(getattr(switch_mlp, n)) for n in ("gate_proj", "up_proj", "down_proj"))
    (IS, Dsg), (ISu, Dsu), (Dsd, ISd) = (
        _dims(getattr(shared_expert, n)) for n in ("gate_proj", "up_proj", "down_proj")
    )
    if (Dg, Du, Dd, Dsg, Dsu, Dsd) != (D,) * 6 or (Iu, Id) != (I, I) or (ISu, ISd) != (IS, IS):
        return "expert or shared expert weights do not match h"
    if switch_mlp.gate_proj.weight.shape[0] != E:
        return f"{switch_mlp.gate_proj.weight.shape[0]} experts' weights for {E} router logits"
    if I % GROUP_SIZE or IS % GROUP_SIZE:
        return f"I={I}, shared I={IS} (kernel: multiples of {GROUP_SIZE})"
    if E * max(I, D) * max(I, D) // 8 >= MAX_ELEMENTS:
        return "too large for 32-bit indexing"
    return None


@functools.lru_cache(maxsize=64)
def _eps_array(eps: float) -> mx.array:
    """eps as the kernel's input: one array per model constant, not per call."""
    return mx.array([eps], dtype=mx.float32)


def _hidden_sizes(switch_mlp, shared_expert) -> tuple[int, int, int]:
    """(I, shared I, max of the two)."""
    I = switch_mlp.gate_proj.weight.shape[-2]
    IS = shared_expert.gate_proj.weight.shape[-2]
    return I, IS, max(I, IS)


# Launch geometry depends on B only through how many threadgroups there are
# (route and combine: a row each; gate/up and down: one entry per pick, of
# which those of an expert's later occurrences do nothing); the threads' work
# for a row, and the builds (no template constant is B), are the same for
# every B.


def _launch_route(h, router_logits, norm_weight, eps, top_k, norm_topk_prob) -> Launch:
    B, D, E, k = h.shape[0], h.shape[-1], router_logits.shape[-1], int(top_k)
    return Launch(
        inputs=[h, router_logits, norm_weight, _eps_array(float(eps))],
        grid=(ROUTE_THREADS, B, 1),
        threadgroup=(ROUTE_THREADS, 1, 1),
        output_shapes=[(B, D), (B, k), (B, k)],
        output_dtypes=[h.dtype, mx.uint32, h.dtype],
        template=[("T", h.dtype), ("E", E), ("K", k), ("VALS", math.ceil(E / SIMD_WIDTH)),
                  ("NORMALIZE", bool(norm_topk_prob)), ("D", D), ("NORM_SG", ROUTE_NORM_SG)],
        finish=tuple,
    )


def _launch_gate_up(xn, inds, switch_mlp, shared_expert) -> Launch:
    B, D = xn.shape
    k = inds.shape[-1]
    I, IS, IMAX = _hidden_sizes(switch_mlp, shared_expert)
    (gw, gs, gb), (uw, us, ub), _ = _parts(switch_mlp)
    (sgw, sgs, sgb), (suw, sus, sub), _ = _parts(shared_expert)
    rows_per_tg = GATE_UP_SIMD_GROUPS * GATE_UP_ROWS_PER_SG
    return Launch(
        inputs=[xn, inds, gw, gs, gb, uw, us, ub, sgw, sgs, sgb, suw, sus, sub],
        grid=(math.ceil(IMAX / rows_per_tg) * GATE_UP_SIMD_GROUPS * SIMD_WIDTH, 1 + B * k, 1),
        threadgroup=(GATE_UP_SIMD_GROUPS * SIMD_WIDTH, 1, 1),
        output_shapes=[(B, k + 1, IMAX)],
        output_dtypes=[xn.dtype],
        template=[("T", xn.dtype), ("E", gw.shape[0]), ("K", k), ("D", D), ("I", I), ("IS", IS), ("IMAX", IMAX),
                  ("MAX_BATCH", MAX_BATCH), ("GROUP", GATE_UP_GROUP), ("NSG", GATE_UP_SIMD_GROUPS),
                  ("ROWS", GATE_UP_ROWS_PER_SG)],
        finish=lambda outputs: outputs[0],
    )


def down_launch(batch: int, backend: Optional[str]) -> Tuple[int, int]:
    """(SIMD groups per threadgroup, output rows per SIMD group) of down for
    ``batch`` rows on ``backend`` (CUDA_DOWN_LAUNCH_FOR_BATCH)."""
    if backend == "cuda" and DOWN_BY_BATCH:
        for at_least, nsg, rows in CUDA_DOWN_LAUNCH_FOR_BATCH:
            if batch >= at_least:
                return nsg, rows
    return DOWN_SIMD_GROUPS, DOWN_ROWS_PER_SG


def routed_rows_per_sg(batch: int, backend: Optional[str]) -> int:
    """Hidden rows per SIMD group of the routed gate/up launch for ``batch``
    rows on ``backend`` (CUDA_ROUTED_ROWS_FOR_BATCH)."""
    if backend == "cuda" and ROUTED_ROWS_BY_BATCH:
        for at_least, rows in CUDA_ROUTED_ROWS_FOR_BATCH:
            if batch >= at_least:
                return rows
    return ROUTED_ROWS_PER_SG


def routes_in_gate_up(rows: int, hidden: int = 0, itemsize: int = 2) -> bool:
    """Whether a call of ``rows`` rows of ``hidden`` values (``itemsize``
    bytes each) takes route and gate/up as one launch
    (``moe_decode_route_gate_up_kernel``): a few rows, whose normed x fits
    the threadgroup memory it is given (ROUTED_XN_BYTES), and gate/up's SIMD
    groups those of route's norm (its sums in route's order)."""
    return (rows <= ROUTED_MAX_ROWS and rows * hidden * itemsize <= ROUTED_XN_BYTES
            and GATE_UP_SIMD_GROUPS == ROUTE_NORM_SG)


def _launch_route_gate_up(h, router_logits, norm_weight, eps, top_k, norm_topk_prob, switch_mlp,
                          shared_expert) -> Launch:
    B, D, E, k = h.shape[0], h.shape[-1], router_logits.shape[-1], int(top_k)
    I, IS, IMAX = _hidden_sizes(switch_mlp, shared_expert)
    (gw, gs, gb), (uw, us, ub), _ = _parts(switch_mlp)
    (sgw, sgs, sgb), (suw, sus, sub), _ = _parts(shared_expert)
    rows_per_sg = routed_rows_per_sg(B, gpu_backend())
    rows_per_tg = GATE_UP_SIMD_GROUPS * rows_per_sg
    return Launch(
        inputs=[h, router_logits, norm_weight, _eps_array(float(eps)), gw, gs, gb, uw, us, ub,
                sgw, sgs, sgb, suw, sus, sub],
        grid=(math.ceil(IMAX / rows_per_tg) * GATE_UP_SIMD_GROUPS * SIMD_WIDTH, 1 + B * k, 1),
        threadgroup=(GATE_UP_SIMD_GROUPS * SIMD_WIDTH, 1, 1),
        output_shapes=[(B, k + 1, IMAX), (B, k), (B, k)],
        output_dtypes=[h.dtype, mx.uint32, h.dtype],
        template=[("T", h.dtype), ("E", E), ("K", k), ("VALS", math.ceil(E / SIMD_WIDTH)),
                  ("NORMALIZE", bool(norm_topk_prob)), ("D", D), ("I", I), ("IS", IS), ("IMAX", IMAX),
                  ("MAX_BATCH", MAX_BATCH), ("GROUP", GATE_UP_GROUP), ("NSG", GATE_UP_SIMD_GROUPS),
                  ("ROWS", rows_per_sg), ("XN_ROWS", B)],
        finish=tuple,
    )


def _launch_down(act, inds, scores, shared_gate_logit, switch_mlp, shared_expert) -> Launch:
    B, k = inds.shape
    I, IS, IMAX = _hidden_sizes(switch_mlp, shared_expert)
    _, _, (dw, ds, db) = _parts(switch_mlp)
    _, _, (sdw, sds, sdb) = _parts(shared_expert)
    D = dw.shape[-2]
    nsg, rows = down_launch(B, gpu_backend())
    return Launch(
        inputs=[act, inds, scores, shared_gate_logit, dw, ds, db, sdw, sds, sdb],
        grid=(math.ceil(D / (nsg * rows)) * nsg * SIMD_WIDTH, 1 + B * k, 1),
        threadgroup=(nsg * SIMD_WIDTH, 1, 1),
        output_shapes=[(B, k + 1, D)],
        output_dtypes=[act.dtype],
        template=[("T", act.dtype), ("E", dw.shape[0]), ("K", k), ("D", D), ("I", I), ("IS", IS),
                  ("IMAX", IMAX), ("MAX_BATCH", MAX_BATCH), ("NSG", nsg), ("ROWS", rows)],
        finish=lambda outputs: outputs[0],
    )


def _launch_down_combine(h, act, inds, scores, shared_gate_logit, switch_mlp, shared_expert,
                         residual=True) -> Launch:
    B, k = inds.shape
    I, IS, IMAX = _hidden_sizes(switch_mlp, shared_expert)
    _, _, (dw, ds, db) = _parts(switch_mlp)
    _, _, (sdw, sds, sdb) = _parts(shared_expert)
    D = dw.shape[-2]
    nsg = min(COMBINED_DOWN_SIMD_GROUPS or k + 1, k + 1, SIMD_WIDTH)
    rows = COMBINED_DOWN_ROWS
    if not 1 <= rows <= SIMD_WIDTH:  # the sums' threads are SIMD group 0's lanes
        raise ValueError(f"decode.COMBINED_DOWN_ROWS = {rows}: 1 to {SIMD_WIDTH} output elements a threadgroup")
    return Launch(
        inputs=[h, act, inds, scores, shared_gate_logit, dw, ds, db, sdw, sds, sdb],
        grid=(math.ceil(D / rows) * nsg * SIMD_WIDTH, B, 1),
        threadgroup=(nsg * SIMD_WIDTH, 1, 1),
        output_shapes=[(B, 1, D)],
        output_dtypes=[h.dtype],
        template=[("T", h.dtype), ("E", dw.shape[0]), ("K", k), ("D", D), ("I", I), ("IS", IS),
                  ("IMAX", IMAX), ("NSG", nsg), ("ROWS", rows), ("RESIDUAL", bool(residual))],
        finish=lambda outputs: outputs[0],
    )


def combines_in_down(rows: int) -> bool:
    """Whether a call of ``rows`` rows takes down and the combine as one
    launch (``moe_decode_down_combine_kernel``)."""
    return rows <= COMBINED_DOWN_MAX_ROWS


def _launch_combine(h, terms, residual=True) -> Launch:
    B, k1, D = terms.shape
    return Launch(
        inputs=[h, terms],
        grid=(math.ceil(D / COMBINE_THREADS) * COMBINE_THREADS, B, 1),
        threadgroup=(COMBINE_THREADS, 1, 1),
        output_shapes=[(B, 1, D)],
        output_dtypes=[h.dtype],
        template=[("T", h.dtype), ("K", k1 - 1), ("D", D), ("RESIDUAL", bool(residual))],
        finish=lambda outputs: outputs[0],
    )


moe_decode_route_kernel = Kernel(
    name="moe_decode_route",
    input_names=("h", "logits", "norm_weight", "eps"),
    output_names=("xn", "inds", "scores"),
    body=Path(__file__).with_name("moe_decode_route.metal"),
    header=TOPK_HEADER,
    launch=_launch_route,
)

moe_decode_gate_up_kernel = Kernel(
    name="moe_decode_gate_up",
    input_names=("xn", "inds", "gate_w", "gate_s", "gate_b", "up_w", "up_s", "up_b",
                 "sgate_w", "sgate_s", "sgate_b", "sup_w", "sup_s", "sup_b"),
    output_names=("act",),
    body=Path(__file__).with_name("moe_decode_gate_up.metal"),
    header=Path(__file__).with_name("moe_decode_gate_up.metal.h").read_text(),
    launch=_launch_gate_up,
    # For lily_tile_unpack and lily_tile_load16 only (4-bit words and xn to
    # floats), no matrix tiles.
    tiles=True,
)

# Route and gate/up as one launch for a few rows (routes_in_gate_up): the
# gate/up body, each threadgroup taking route's work for every row first.
moe_decode_route_gate_up_kernel = Kernel(
    name="moe_decode_route_gate_up",
    input_names=("h", "logits", "norm_weight", "eps", "gate_w", "gate_s", "gate_b", "up_w", "up_s", "up_b",
                 "sgate_w", "sgate_s", "sgate_b", "sup_w", "sup_s", "sup_b"),
    output_names=("act", "inds", "scores"),
    # Its threadgroup arrays, then gate/up's body.
    source=(Path(__file__).with_name("moe_decode_route_gate_up.metal").read_text()
            + Path(__file__).with_name("moe_decode_gate_up.metal").read_text()),
    header=TOPK_HEADER + Path(__file__).with_name("moe_decode_route_gate_up.metal.h").read_text(),
    launch=_launch_route_gate_up,
    tiles=True,
)

DOWN_HEADER = Path(__file__).with_name("moe_decode_down.metal.h").read_text()

moe_decode_down_kernel = Kernel(
    name="moe_decode_down",
    input_names=("act", "inds", "scores", "gate_logit", "down_w", "down_s", "down_b",
                 "sdown_w", "sdown_s", "sdown_b"),
    output_names=("terms",),
    body=Path(__file__).with_name("moe_decode_down.metal"),
    header=DOWN_HEADER,
    launch=_launch_down,
    tiles=True,  # lily_tile_load16 and lily_tile_unpack_as only
)

# Down and the combine as one launch for a few rows (combines_in_down): each
# row's terms made as down makes them, summed as the combine sums them.
moe_decode_down_combine_kernel = Kernel(
    name="moe_decode_down_combine",
    input_names=("h", "act", "inds", "scores", "gate_logit", "down_w", "down_s", "down_b",
                 "sdown_w", "sdown_s", "sdown_b"),
    output_names=("out",),
    body=Path(__file__).with_name("moe_decode_down_combine.metal"),
    header=DOWN_HEADER,
    launch=_launch_down_combine,
    tiles=True,
)

moe_decode_combine_kernel = Kernel(
    name="moe_decode_combine",
    input_names=("h", "terms"),
    output_names=("out",),
    body=Path(__file__).with_name("moe_decode_combine.metal"),
    launch=_launch_combine,
)


def run_moe_decode(
    backend, h, router_logits, shared_gate_logit, norm_weight, eps, top_k, norm_topk_prob, switch_mlp, shared_expert,
    *, residual=True, routed=None,
):
    """The kernel path on ``backend``: four launches (route, gate/up, down,
    combine; the combine adds h unless ``residual=False``); for one row two,
    route with gate/up (``routes_in_gate_up``) and down with the combine
    (``combines_in_down``); the same bits. With ``routed`` (the router
    launch's xn, inds and scores) no route: gate/up reads them."""
    if routed is not None:
        xn, inds, scores = routed
        act = moe_decode_gate_up_kernel.run_on(backend, xn, inds, switch_mlp, shared_expert)
    elif routes_in_gate_up(h.shape[0], h.shape[-1], h.dtype.size):
        act, inds, scores = moe_decode_route_gate_up_kernel.run_on(
            backend, h, router_logits, norm_weight, eps, top_k, norm_topk_prob, switch_mlp, shared_expert)
    else:
        xn, inds, scores = moe_decode_route_kernel.run_on(backend, h, router_logits, norm_weight, eps, top_k,
                                                          norm_topk_prob)
        act = moe_decode_gate_up_kernel.run_on(backend, xn, inds, switch_mlp, shared_expert)
    if combines_in_down(h.shape[0]):
        return moe_decode_down_combine_kernel.run_on(backend, h, act, inds, scores, shared_gate_logit, switch_mlp,
                                                     shared_expert, residual)
    terms = moe_decode_down_kernel.run_on(backend, act, inds, scores, shared_gate_logit, switch_mlp,
                                          shared_expert)
    return moe_decode_combine_kernel.run_on(backend, h, terms, residual)

# -- inputs ------------------------------------------------------------------------


def _sample():
    """24 experts top-3, D 128, experts' I 64 and the shared expert's 128."""
    from .testing import moe_decode_inputs

    return moe_decode_inputs(128, 24, 3, 64, 128, seed=11)


def _self_check_samples():
    """The kernels' self-check: the sample (one row: route and gate/up as one
    launch) and a call of more rows than that takes (the two launches)."""
    from .testing import moe_decode_inputs

    return [_sample(), moe_decode_inputs(128, 24, 3, 64, 128, seed=12, rows=ROUTED_MAX_ROWS + 1)]


def _fuzz(rng):
    """A random decode call: 1 to 4 rows (now and then MAX_BATCH), D, E, k, I
    and the shared I, renormalised or not, logits rows with ties, -inf and
    NaN among the plain ones, bf16 or fp16, with the residual or (a quarter
    of calls) without."""
    from .testing import moe_decode_inputs

    rows = int(rng.choice([1, 1, 2, 3, 4, MAX_BATCH]))
    D = int(rng.choice([64, 128, 192]))
    E = int(rng.choice([int(rng.integers(1, 33)), int(rng.integers(33, 80))]))
    k = int(rng.integers(1, min(E, 8) + 1))
    I, IS = int(rng.choice([64, 128])), int(rng.choice([64, 128, 192]))
    logits = 2.0 * rng.standard_normal((rows, E))
    for row in logits:
        kind = rng.choice(["plain", "plain", "ties", "-inf", "nan"])
        if kind == "ties":  # whole runs of equal logits, across the k-th place
            row[:] = np.round(row)
        elif kind == "-inf":
            row[rng.random(E) < 0.3] = -np.inf
            row[int(rng.integers(E))] = 1.0
        elif kind == "nan":
            row[int(rng.integers(E))] = np.nan
    dtype = ACTIVATION_DTYPES[int(rng.integers(len(ACTIVATION_DTYPES)))]
    args, kwargs = moe_decode_inputs(D, E, k, I, IS, normalize=bool(rng.random() < 0.6), rng=rng, logits=logits,
                                     dtype=dtype, rows=rows)
    if rng.random() < 0.25:  # a tensor-parallel rank's form: no residual
        kwargs = {**kwargs, "residual": False}
    return args, kwargs


# The four kernels as one KernelLike, self-checked together once per backend
# against ``moe_decode_precise`` on the sample (``moe_decode_agree``).
moe_decode_kernel = SampleCheckedKernels(
    "moe_decode",
    (moe_decode_route_kernel, moe_decode_gate_up_kernel, moe_decode_route_gate_up_kernel, moe_decode_down_kernel,
     moe_decode_combine_kernel, moe_decode_down_combine_kernel),
    "routing + norm, gate/up + SwiGLU (for a few rows as one launch), down + weights, combine "
    "(down and combine as one launch where enabled)",
    sample=_self_check_samples, run=run_moe_decode,
    agree=moe_decode_agree)

moe_decode = register(
    LilyOp(
        "moe_decode",
        moe_decode_reference,
        kernel=moe_decode_kernel,
        supports=moe_decode_supports,
        description="MoE block of 1-16 decode tokens in four launches: routing + norm, gate/up, down, combine "
                    "(three for up to 4 tokens: routing and gate/up as one)",
        sample=_sample,
        compare=moe_decode_compare,
        fuzz=_fuzz,
    )
)
