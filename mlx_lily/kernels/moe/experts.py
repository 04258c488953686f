"""Routed experts for prefill: on-GPU routing plus two grouped expert GEMMs.

Stock mlx-lm's ``SwitchGLU`` runs ``gather_qmm`` three times (gate, up, down)
with a SwiGLU between. Lily's kernel path does the same math in three
dispatches, with no host round trip: ``moe_routing``, then gate + up with a
SwiGLU epilogue, then down (both ``moe_gemm.metal``). Everything the kernel
does not take runs the reference, stock's ``SwitchGLU``.

The three dispatches, the tile rows, and what the kernel takes:
docs/kernel-notes.md#moe-experts.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwiGLU, SwitchGLU

from ...toolchain.kernel import Kernel, Launch, SampleCheckedKernels
from ...toolchain.registry import LilyOp, register
from .routing import moe_routing_kernel, moe_routing_supports, tile_rows_for

# Threads per threadgroup and output columns per threadgroup: must match the body.
THREADS = 128
GATED_COLS = 64  # gate+up: 64 columns of each
DOWN_COLS = 128
GROUP_SIZE, BITS = 64, 4
# Below this many tokens a call is decode-like: a handful of rows per expert,
# where stock's gather_qmm (a matrix-vector product per row) is the right tool.
MIN_TOKENS = 8


def moe_experts_reference(x: mx.array, inds: mx.array, experts: SwitchGLU) -> mx.array:
    """x [..., D], inds [..., k] -> each chosen expert's output [..., k, D]."""
    return experts(x, inds)


def quantized_as_kernel_takes(layer, dtype=mx.bfloat16, kind=QuantizedSwitchLinear) -> Optional[str]:
    """None when ``layer`` is a ``kind`` the MoE kernels read (affine 4-bit
    group 64, biases, no linear bias, scales in ``dtype``), else why not."""
    if not isinstance(layer, kind):
        return f"{type(layer).__name__} (kernel: 4-bit {kind.__name__})"
    if (layer.mode, layer.bits, layer.group_size) != ("affine", BITS, GROUP_SIZE):
        return f"{layer.mode} {layer.bits}-bit group {layer.group_size} (kernel: affine 4-bit group 64)"
    if layer.get("biases") is None or "bias" in layer or layer.get("global_scale") is not None:
        return "quantization without biases, or with a linear bias (kernel: affine, no bias)"
    if layer.scales.dtype != dtype or layer.biases.dtype != dtype:
        return f"scales {layer.scales.dtype} (kernel: {str(dtype).rsplit('.', 1)[-1]})"
    return None


def moe_experts_supports(x: mx.array, inds: mx.array, experts) -> Optional[str]:
    """None when the kernel takes this call, else why not."""
    if not isinstance(experts, SwitchGLU) or type(experts.activation) is not SwiGLU:
        return f"{type(experts).__name__} (kernel: SwitchGLU with SwiGLU)"
    for name in ("gate_proj", "up_proj", "down_proj"):
        why = quantized_as_kernel_takes(getattr(experts, name))
        if why is not None:
            return f"{name}: {why}"
    if x.dtype != mx.bfloat16:
        return f"x dtype {x.dtype} (kernel: bfloat16)"
    tokens = math.prod(x.shape[:-1])
    if tokens < MIN_TOKENS:
        return f"{tokens} tokens (kernel: prefill, at least {MIN_TOKENS})"
    if tuple(inds.shape[:-1]) != tuple(x.shape[:-1]):
        return f"inds {tuple(inds.shape)} for x {tuple(x.shape)}"
    D, E = x.shape[-1], experts.gate_proj.num_experts
    I = experts.gate_proj.output_dims
    if D % DOWN_COLS or I % GATED_COLS:
        return f"hidden {D}, intermediate {I} (kernel: multiples of {DOWN_COLS} and {GATED_COLS})"
    if experts.gate_proj.input_dims != D or experts.down_proj.input_dims != I:
        return "expert weights do not match x"
    return moe_routing_supports(inds.reshape(-1, inds.shape[-1]).astype(mx.uint32), E,
                                tile_rows_for(inds.size, E))


def _quantized(layer):
    return layer.weight, layer.scales, layer.biases


def _launch_grouped(act, order, tiles, first, second, tile_m: int, top_k: int) -> Launch:
    """One grouped GEMM: gate+up (``second`` given) or down (``second`` None)."""
    gated = second is not None
    w0, s0, b0 = _quantized(first)
    w1, s1, b1 = _quantized(second) if gated else (w0, s0, b0)  # down: not read
    E, d_out = w0.shape[0], w0.shape[1]
    cols = GATED_COLS if gated else DOWN_COLS
    rows = order.shape[0]
    return Launch(
        inputs=[act, order, tiles, w0, s0, b0, w1, s1, b1],
        grid=((d_out // cols) * THREADS, tiles.shape[0], 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, d_out)],
        output_dtypes=[mx.bfloat16],
        template=[
            ("GATED", gated),
            ("TILE_M", tile_m),
            ("D_IN", act.shape[-1]),
            ("D_OUT", d_out),
            ("E", E),
            ("TOPK", top_k),
        ],
        finish=lambda outputs: outputs[0],
    )


_GEMM = dict(
    input_names=("act", "order", "tiles", "w0", "scales0", "biases0", "w1", "scales1", "biases1"),
    output_names=("out",),
    body=Path(__file__).with_name("moe_gemm.metal"),
    launch=_launch_grouped,
    tiles=True,
)
# Two kernels of one body (the GATED constant differs): their names keep
# their self-check results and builds apart.
moe_gate_up_kernel = Kernel(name="moe_gate_up", **_GEMM)
moe_down_kernel = Kernel(name="moe_down", **_GEMM)


def run_moe_experts(backend: str, x: mx.array, inds: mx.array, experts: SwitchGLU) -> mx.array:
    """The kernel path on ``backend``: routing, gate+up+SwiGLU, down."""
    lead, D = x.shape[:-1], x.shape[-1]
    k = inds.shape[-1]
    tokens = math.prod(lead)
    E = experts.gate_proj.num_experts
    ids = inds.reshape(tokens, k).astype(mx.uint32)
    tile_m = tile_rows_for(tokens * k, E)
    order, _, tiles = moe_routing_kernel.run_on(backend, ids, E, tile_m)
    h = moe_gate_up_kernel.run_on(
        backend, x.reshape(tokens, D), order, tiles, experts.gate_proj, experts.up_proj, tile_m, k
    )
    y = moe_down_kernel.run_on(backend, h, order, tiles, experts.down_proj, None, tile_m, k)
    return y.reshape(*lead, k, D)


def _dequantized(layer) -> mx.array:
    """[E, out, in] weights as the kernel stages them: scale * q + bias rounded to bf16."""
    w = mx.dequantize(layer.weight, layer.scales.astype(mx.float32), layer.biases.astype(mx.float32),
                      group_size=layer.group_size, bits=layer.bits)
    return w.astype(mx.bfloat16).astype(mx.float32)


def moe_experts_precise(x: mx.array, inds: mx.array, experts: SwitchGLU) -> mx.array:
    """Stock's math with fp32 accumulation (what stock's GPU kernels compute),
    the ground truth of the kernel's tests and self-check: bf16 operands, fp32
    sums, gate, up, each SwiGLU step and y rounded to bf16. Loops over experts
    (small shapes only: it holds every expert's weights in fp32)."""
    bf16 = lambda a: a.astype(mx.bfloat16).astype(mx.float32)  # noqa: E731
    lead, D = x.shape[:-1], x.shape[-1]
    k = inds.shape[-1]
    xs = x.reshape(-1, D).astype(mx.float32)
    ids = inds.reshape(-1, k)
    wg, wu, wd = (_dequantized(getattr(experts, n)) for n in ("gate_proj", "up_proj", "down_proj"))
    y = mx.zeros((xs.shape[0], k, D), mx.float32)
    for e in range(wg.shape[0]):
        gate, up = bf16(xs @ wg[e].T), bf16(xs @ wu[e].T)
        h = bf16(bf16(gate * bf16(mx.sigmoid(gate))) * up)
        y_e = bf16(h @ wd[e].T)
        y = mx.where((ids == e)[..., None], y_e[:, None, :], y)
    return y.reshape(*lead, k, D).astype(mx.bfloat16)


# How far the kernel may be from moe_experts_precise, as max |kernel -
# precise| / max |precise|: both round the same bf16 values at the same
# points and differ only in fp32 summation order, so an element of gate, up or
# h now and then lands one bf16 step (2^-8 relative) apart and the down
# projection carries that into y. (In the emulator, whose fp32 sums run in
# the reference's order, the two agree to the bit at the test shapes.)
RELATIVE_TOLERANCE = 2e-2
# Against stock on the same machine (doctor): on a GPU stock accumulates in
# fp32 like the kernel, but on a CPU its bf16 quantized matmul accumulates in
# bf16, ~4e-2 of the output's scale at the sample's 128-wide rows.
STOCK_TOLERANCE = 6e-2


def relative_error(got: mx.array, want: mx.array) -> float:
    g = np.array(got.astype(mx.float32)).astype(np.float64)
    w = np.array(want.astype(mx.float32)).astype(np.float64)
    if g.shape != w.shape or not np.isfinite(g).all():
        return math.inf
    return float(np.abs(g - w).max(initial=0.0)) / max(float(np.abs(w).max(initial=0.0)), 1e-30)


def moe_experts_agree(got, want, *args, tolerance: float = RELATIVE_TOLERANCE, **kwargs) -> Optional[str]:
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{tuple(got.shape)} {got.dtype} vs reference {tuple(want.shape)} {want.dtype}"
    err = relative_error(got, want)
    if not err <= tolerance:
        return f"max |kernel - reference| / max |reference| = {err:.3g} (> {tolerance:g})"
    return None


def moe_experts_compare(got, want) -> tuple[bool, float]:
    """(acceptable, relative error) against stock, for doctor."""
    err = relative_error(got, want)
    return err <= STOCK_TOLERANCE, err


def quantized_experts(hidden: int, inter: int, experts: int, seed: int = 0) -> SwitchGLU:
    """A 4-bit group-64 SwitchGLU in bf16, as the model's checkpoints have it."""
    mx.random.seed(seed)
    glu = SwitchGLU(hidden, inter, experts)
    glu.set_dtype(mx.bfloat16)
    nn.quantize(glu, group_size=GROUP_SIZE, bits=BITS)
    mx.eval(glu.parameters())
    return glu


def sample_moe_experts():
    """Small but every case of the kernel: 24 experts top-3 over 20 tokens (an
    uneven load, empty experts, tiles of 16 rows, a row count off the tile)."""
    experts = quantized_experts(128, 64, 24, seed=9)
    x = mx.random.normal((1, 20, 128), key=mx.random.key(9)).astype(mx.bfloat16)
    logits = mx.random.normal((1, 20, 24), key=mx.random.key(10))
    inds = mx.argpartition(logits, kth=-3, axis=-1)[..., -3:].astype(mx.uint32)
    return (x, inds, experts), {}


def fuzz_moe_experts(rng):
    """A random prefill call the kernels take: widths, experts, top-k, tokens,
    and routings from uniform to all-on-one-expert."""
    hidden, inter = int(rng.choice([128, 256])), int(rng.choice([64, 128, 192]))
    experts = int(rng.choice([int(rng.integers(1, 9)), int(rng.integers(9, 41))]))
    k = int(rng.integers(1, min(experts, 8) + 1))
    tokens = int(rng.integers(MIN_TOKENS, 48))
    glu = quantized_experts(hidden, inter, experts, seed=int(rng.integers(1 << 30)))
    x = mx.array(rng.standard_normal((1, tokens, hidden)).astype(np.float32)).astype(mx.bfloat16)
    skew = float(rng.choice([0.0, 1.0, 8.0]))  # 8: nearly every row on the same few experts
    logits = rng.standard_normal((tokens, experts)) + skew * np.linspace(0.0, 1.0, experts)
    inds = np.argsort(-logits, axis=-1, kind="stable")[:, :k].astype(np.uint32)
    return (x, mx.array(inds)[None], glu), {}


def _agree_with_precise(got, want, *args, **kwargs) -> Optional[str]:
    """The kernels' contract is with ``moe_experts_precise`` (stock's math
    accumulated in fp32), not with ``want`` (stock, which on a CPU
    accumulates its bf16 matmuls in bf16)."""
    return moe_experts_agree(got, moe_experts_precise(*args, **kwargs))


# The kernel path as one KernelLike: the three kernels, self-checked together
# once per backend against ``moe_experts_precise`` on the sample.
moe_experts_kernel = SampleCheckedKernels(
    "moe_experts", (moe_routing_kernel, moe_gate_up_kernel, moe_down_kernel), "routing, gate+up+SwiGLU, down",
    sample=sample_moe_experts, run=run_moe_experts, agree=_agree_with_precise)

moe_experts = register(
    LilyOp(
        "moe_experts",
        moe_experts_reference,
        kernel=moe_experts_kernel,
        supports=moe_experts_supports,
        description="routed experts: on-GPU routing, grouped 4-bit GEMMs (gate+up+SwiGLU, down)",
        sample=sample_moe_experts,
        compare=moe_experts_compare,
        fuzz=fuzz_moe_experts,
    )
)
