"""MoE router: softmax over all experts, top-k, optional renormalisation.

The reference is stock mlx-lm's routing, step for step, so that the
reference path reproduces stock logits exactly. The kernel
(``router_topk.metal``, with the top-k routine of ``router_topk.metal.h``)
computes the softmax in fp32 and ranks the experts as stock does. The op's
contract: the same experts except among tied rounded probabilities, and the
same weights within the dtype's tolerance.

Ranking, ties and NaN rows: docs/kernel-notes.md#moe-router.
"""


from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from ...toolchain.registry import LilyOp, register
from ...toolchain.kernel import Kernel, Launch, SIMD_WIDTH


def router_topk_reference(logits: mx.array, k: int, normalize: bool):
    """logits [..., E] -> (indices [..., k] uint32, weights [..., k])."""
    gates = mx.softmax(logits, axis=-1, precise=True)
    inds = mx.stop_gradient(mx.argpartition(gates, kth=-k, axis=-1)[..., -k:])
    scores = mx.take_along_axis(gates, inds, axis=-1)
    if normalize:
        scores = scores / scores.sum(axis=-1, keepdims=True)
    return inds, scores


# -- the kernel --------------------------------------------------------------

# The top-k routine (a macro of the portable subset), shared with the bodies
# that route a token themselves (moe_decode).
TOPK_HEADER = Path(__file__).with_name("router_topk.metal.h").read_text()

# Rows (tokens) per threadgroup: one SIMD group each. Four keep a 2048-token
# prefill chunk at 512 threadgroups, enough to fill a large GPU.
ROWS_PER_THREADGROUP = 4
# Each lane holds ceil(E / 32) probabilities in registers and every loop over
# them is unrolled; 32 per lane (1024 experts) bounds both.
MAX_VALS_PER_LANE = 32
MAX_EXPERTS = SIMD_WIDTH * MAX_VALS_PER_LANE
# Lane r of a row's SIMD group keeps the r-th pick.
MAX_K = SIMD_WIDTH
KERNEL_DTYPES = (mx.bfloat16, mx.float16, mx.float32)


def router_topk_supports(logits: mx.array, k: int, normalize: bool) -> Optional[str]:
    """None when the kernel takes this call, else why not."""
    if logits.dtype not in KERNEL_DTYPES:
        return f"logits dtype {logits.dtype} (kernel: bfloat16, float16, float32)"
    if logits.ndim < 1 or logits.size == 0:
        return f"empty logits {tuple(logits.shape)}"
    experts = logits.shape[-1]
    if experts > MAX_EXPERTS:
        return f"{experts} experts (kernel: at most {MAX_EXPERTS})"
    if not 1 <= k <= min(experts, MAX_K):
        return f"k={k} with {experts} experts (kernel: 1 <= k <= min(E, {MAX_K}))"
    return None


def _launch_router_topk(logits: mx.array, k: int, normalize: bool) -> Launch:
    experts = logits.shape[-1]
    lead = logits.shape[:-1]
    rows = math.prod(lead)
    rows_per_group = min(ROWS_PER_THREADGROUP, rows)

    def finish(outputs):
        indices, weights = outputs
        return indices.reshape(*lead, k), weights.reshape(*lead, k)

    return Launch(
        inputs=[logits.reshape(rows, experts)],
        grid=(rows * SIMD_WIDTH, 1, 1),
        threadgroup=(rows_per_group * SIMD_WIDTH, 1, 1),
        output_shapes=[(rows, k), (rows, k)],
        output_dtypes=[mx.uint32, logits.dtype],
        template=[
            ("T", logits.dtype),
            ("E", experts),
            ("K", k),
            ("VALS", math.ceil(experts / SIMD_WIDTH)),
            ("NORMALIZE", bool(normalize)),
        ],
        finish=finish,
    )


# Weight tolerances (relative, absolute) by dtype: the reference rounds the
# softmax to the activation dtype before gathering and renormalising.
WEIGHT_TOLERANCE = {
    mx.bfloat16: (2e-2, 2e-3),
    mx.float16: (4e-3, 2e-4),
    mx.float32: (1e-5, 1e-6),
}


def router_outputs_agree(got, want, logits: mx.array, k: int, normalize: bool) -> Optional[str]:
    """None when two router results meet the op's contract, else the first breach.

    Experts may differ only where their probabilities are tied (to within the
    logits dtype's rounding, since the reference ranks the rounded softmax).
    """
    rtol, atol = WEIGHT_TOLERANCE.get(logits.dtype, WEIGHT_TOLERANCE[mx.bfloat16])
    probs = softmax_fp64(logits)
    got_idx, got_w = (np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a) for a in got)
    want_idx, want_w = (
        np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a) for a in want
    )
    experts = probs.shape[-1]
    probs = probs.reshape(-1, experts)
    got_idx, want_idx = got_idx.reshape(-1, k), want_idx.reshape(-1, k)
    got_w, want_w = got_w.reshape(-1, k).astype(np.float64), want_w.reshape(-1, k).astype(np.float64)
    for row in range(probs.shape[0]):
        if not ((0 <= got_idx[row]) & (got_idx[row] < experts)).all():
            return f"row {row}: expert index out of range: {got_idx[row].tolist()}"
        if len(set(got_idx[row].tolist())) != k:
            return f"row {row}: repeated experts {got_idx[row].tolist()}"
        chosen = np.sort(probs[row, got_idx[row]])
        wanted = np.sort(probs[row, want_idx[row]])
        if not np.allclose(chosen, wanted, rtol=rtol, atol=atol):
            return (
                f"row {row}: experts {sorted(got_idx[row].tolist())} vs reference "
                f"{sorted(want_idx[row].tolist())}"
            )
        if not np.allclose(np.sort(got_w[row]), np.sort(want_w[row]), rtol=rtol, atol=atol):
            return f"row {row}: weights {got_w[row].tolist()} vs reference {want_w[row].tolist()}"
    return None


def router_compare(got, want, tolerance: float = 2e-2) -> tuple[bool, float]:
    """(acceptable, largest weight difference) of two router results, for doctor.

    Without the logits: each row's weights, sorted, must agree within
    ``tolerance``, and an expert only one side picked must weigh no more than
    the other side's lightest pick (plus ``tolerance``): a tie at the k-th place.
    """
    (got_idx, got_w), (want_idx, want_w) = (
        (np.array(i), np.array(w.astype(mx.float32))) for i, w in (got, want)
    )
    k = got_idx.shape[-1]
    if got_idx.shape != want_idx.shape or got_w.shape != want_w.shape:
        return False, float("inf")
    got_idx, want_idx = got_idx.reshape(-1, k), want_idx.reshape(-1, k)
    got_w, want_w = got_w.reshape(-1, k), want_w.reshape(-1, k)
    err = float(np.abs(np.sort(got_w, -1) - np.sort(want_w, -1)).max(initial=0.0))
    good = err <= tolerance
    for row in range(got_idx.shape[0]):
        extra = set(got_idx[row].tolist()) - set(want_idx[row].tolist())
        weight = dict(zip(got_idx[row].tolist(), got_w[row].tolist()))
        if any(weight[e] > want_w[row].min() + tolerance for e in extra):
            good = False
    return good, err


def softmax_fp64(logits: mx.array) -> np.ndarray:
    x = np.array(logits.astype(mx.float32)).astype(np.float64)
    x = np.exp(x - x.max(axis=-1, keepdims=True))
    return x / x.sum(axis=-1, keepdims=True)


def router_topk_ground_truth(logits: mx.array, k: int, normalize: bool):
    """The kernel's contract in numpy: (indices, weights, probabilities), all [..., *].

    fp32 softmax rounded to the logits' dtype; the k experts of largest rounded
    probability, the higher index first among equal ones (MLX's CPU
    argpartition), NaN below every number; weights the rounded probabilities
    and, when normalising, divided by their sum rounded to that dtype (stock
    mlx-lm's rounding), returned in fp32.
    """

    def rounded(a: np.ndarray) -> np.ndarray:
        return np.array(mx.array(a).astype(logits.dtype).astype(mx.float32))

    x = np.array(logits.astype(mx.float32))
    with np.errstate(invalid="ignore"):
        e = np.exp(x - x.max(axis=-1, keepdims=True))
        probs = e / e.sum(axis=-1, keepdims=True)
    ranks = rounded(probs)
    ranks = np.where(np.isnan(ranks), -0.5, ranks)
    index = np.broadcast_to(np.arange(ranks.shape[-1]), ranks.shape)
    # lexsort's last key is the primary one: rank, then index, both descending.
    order = np.lexsort((-index, -ranks), axis=-1)[..., :k]
    weights = rounded(np.take_along_axis(probs, order, axis=-1))
    if normalize:
        weights = weights / rounded(weights.sum(axis=-1, keepdims=True))
    return order.astype(np.uint32), weights, probs


def _sample():
    logits = mx.random.normal((6, 64), key=mx.random.key(0)).astype(mx.bfloat16)
    return (logits, 8, True), {}


FUZZ_DTYPES = (mx.bfloat16, mx.float16, mx.float32)


def _fuzz(rng):
    """A random call the kernel takes: rows, experts, k, dtype, logit scale, lead dims."""
    experts = int(rng.choice([int(rng.integers(1, 65)), int(rng.integers(65, MAX_EXPERTS + 1)), 256]))
    k = int(rng.integers(1, min(experts, MAX_K) + 1))
    rows = int(rng.choice([1, int(rng.integers(2, 9)), int(rng.integers(9, 200))]))
    dtype = FUZZ_DTYPES[int(rng.integers(len(FUZZ_DTYPES)))]
    scale = float(rng.choice([0.1, 1.0, 4.0, 16.0]))
    lead = (1,) if rng.random() < 0.5 else ()
    logits = mx.array((scale * rng.standard_normal((*lead, rows, experts))).astype(np.float32))
    return (logits.astype(dtype), k, bool(rng.random() < 0.7)), {}


router_topk_kernel = Kernel(
    name="router_topk",
    input_names=("logits",),
    output_names=("indices", "weights"),
    body=Path(__file__).with_name("router_topk.metal"),
    header=TOPK_HEADER,
    launch=_launch_router_topk,
    reference=router_topk_reference,
    sample=_sample,
    agree=router_outputs_agree,
)

router_topk = register(
    LilyOp(
        "router_topk",
        router_topk_reference,
        kernel=router_topk_kernel,
        supports=router_topk_supports,
        description="MoE router: softmax + top-k + renormalise",
        sample=_sample,
        compare=router_compare,
        fuzz=_fuzz,
    )
)
