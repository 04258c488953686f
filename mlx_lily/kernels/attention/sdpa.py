"""Full attention: q/k RMSNorm + partial RoPE (``qk_norm_rope``, its own
module, re-exported here), and GQA scaled dot-product attention.

The attention op's reference is MLX's ``scaled_dot_product_attention`` (what
stock mlx-lm calls). Its kernels (:class:`AttentionKernels`) compute fp32
scores, softmax and accumulation with one rounding of the output; the decode
kernel (``attention_decode.metal``) splits long contexts into key blocks that
``attention_combine.metal`` merges.

The decode kernel, its key blocks, and the contract (``attention_agree``):
docs/kernel-notes.md#sdpa.
"""

from __future__ import annotations

import functools
import math
import threading
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from ..._notice import notice_once
from ...toolchain.kernel import Kernel, KernelGroup, Launch, SIMD_WIDTH
from ...toolchain.tracing import contiguous
from ...toolchain.registry import LilyOp, gpu_backend, register
# Which prefill calls take MLX's sdpa on CUDA, and how: their own module.
from .cuda_prefill import (  # noqa: F401 - re-exported
    CUDA_PREFILL_REFERENCE_FROM,
    CUDA_REFERENCE_QUERIES,
    SDPA_KEY_MULTIPLE,
    attention_prefers_reference,
    causal_with_aligned_keys,
)
from ..dtypes import ACTIVATION_DTYPES, activation_dtype_reason, step_scale
from .decode import (MAX_BATCH, RowForm, batch_check_inputs, key_span_mask, rows_check_inputs,
                     rows_of_one_view, span_reason)
# The prologue (q/k norm + RoPE) lives in its own module; re-exported here.
from .qk_norm_rope import qk_norm_rope, qk_norm_rope_reference  # noqa: F401
# Self-check, sample and fuzz inputs (their own module; the old names stay).
from .testing import (bounded_check_inputs as _bounded_check_inputs, decode_check_inputs as _decode_check_inputs,
                      fuzz_attention as _fuzz_attention, output_gate,
                      prefill_check_inputs as _prefill_check_inputs, sample_attention as _sample_attention)


def attention_reference(q, k, v, scale, mask, length=None, start=None, gate=None):
    """q [B, Hq, L, D], k/v [B, Hkv, S, D] -> [B, Hq, L, D]. ``length`` (an
    int32 array [1], with no mask) bounds the keys to rows [0, length) of k/v:
    a cache of fixed capacity filled that far. ``start`` (int32 [B]) makes row
    b's keys [start[b], length) (``length`` [1], or [B]: one end per row), the
    left-padded rows of mlx-lm's BatchKVCache. ``gate`` [B, L, Hq, D] (the
    layer's output gate, any strides): the output times its sigmoid, as
    stock's layer computes it (``gated``)."""
    return gated(_attention(q, k, v, scale, mask, length, start), gate)


def gated(out: mx.array, gate: Optional[mx.array]) -> mx.array:
    """``out`` [B, Hq, L, D] times sigmoid(``gate`` [B, L, Hq, D]): stock's
    ``out * mx.sigmoid(gate)``, element by element, in the output's layout."""
    if gate is None:
        return out
    B, Hq, L, D = out.shape
    if tuple(gate.shape) != (B, L, Hq, D):
        raise ValueError(f"attention: an output gate of shape {tuple(gate.shape)} for an output of {B} rows, "
                         f"{L} queries and {Hq} heads of {D} (gate: [B, L, Hq, D])")
    return out * mx.sigmoid(gate.transpose(0, 2, 1, 3) if L > 1 else gate.reshape(B, Hq, 1, D))


def _attention(q, k, v, scale, mask, length=None, start=None):
    if length is not None or start is not None:
        if mask is not None:
            raise ValueError("attention: a length bound takes no mask (the bound is the mask)")
        mask = key_span_mask(k.shape[2], length, start)
    elif isinstance(mask, str) and mask == "causal" and q.shape[2] > 1 and gpu_backend() == "cuda":
        return causal_with_aligned_keys(q, k, v, scale)
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


# -- decode ------------------------------------------------------------------

# Contexts from which decode splits the keys into blocks (one threadgroup
# each, plus the combine pass); below it one threadgroup per KV head reads all
# keys. On the H200 that single pass took 0.47 ms per layer at 4K context (two
# threadgroups for the whole GPU: bench/diagnostics/decode_profile.py), so the
# split starts at short contexts (bench/diagnostics/attention_split.py times
# both sides).
SPLIT_FROM = 1024
# Keys per threadgroup: the fixed KEY_BLOCK once the context fills at least
# SPLIT_THREADGROUPS threadgroups with it (for the model's 2 KV heads: from
# 8K keys on; 128 blocks per KV head at 32K). Shorter contexts take smaller
# blocks, down to MIN_KEY_BLOCK, so that they still spread over the GPU.
KEY_BLOCK = 256
MIN_KEY_BLOCK = 64
SPLIT_THREADGROUPS = 128
# SIMD groups per threadgroup: more for the single pass (one threadgroup per
# KV head must keep many rows in flight), fewer when split (many threadgroups).
SINGLE_PASS_SIMD_GROUPS = 8
SPLIT_SIMD_GROUPS = 4
# Query heads per KV head: each lane keeps 8 query values and 8 accumulators
# per query head in registers; 8 heads (the model's 16 / 2) bound that at 128.
MAX_GROUP = 8
DECODE_HEAD_DIMS = (32, 64, 128, 256)
# Batched decode (a ``start`` per row): SIMD groups per threadgroup, the same
# for the one-block and the split launch (so a row's bits never depend on
# which one the capacity picked), and each row's blocks from its own span.
BATCH_SIMD_GROUPS = SINGLE_PASS_SIMD_GROUPS
# Passes of K and V rows a SIMD group fetches ahead of the one it scores
# (PREFETCH in attention_decode.metal; 16 passes a SIMD group at 64 keys and
# 4 SIMD groups, each waiting out most of a load at 1). The same bits at every
# value. 1, the form measured so far, until attention_split --prefetch times it.
DECODE_PREFETCH = 1


def batch_row_form() -> RowForm:
    """The batched decode's key blocks per row, from the module's constants."""
    return RowForm(SPLIT_FROM, MIN_KEY_BLOCK, KEY_BLOCK, SPLIT_THREADGROUPS)


def _shapes_reason(kind: str, q, k, v, mask, head_dims, dtypes_reason, max_batch: int = 1) -> Optional[str]:
    """The checks the decode and prefill kernels share, in order: ranks, one
    query token (decode), batch (up to ``max_batch``), mask, dtypes
    (``dtypes_reason``), head dims, keys and values; None when all pass."""
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        return f"ranks {q.ndim}, {k.ndim}, {v.ndim} (kernel: [B, H, L, D])"
    B, Hq, L, D = q.shape
    _, Hkv, S, _ = k.shape
    if kind == "decode" and L != 1:
        return f"{L} query tokens (decode kernel: 1)"
    if B > max_batch or k.shape[0] != B or v.shape[0] != B:
        more = f"; up to {MAX_BATCH} with a start per row" if kind == "decode" and max_batch == 1 else ""
        return f"batch {B} ({kind} kernel: {max_batch}{more})"
    if not (mask is None or (isinstance(mask, str) and mask == "causal")):
        return f"an explicit mask ({kind} kernel: none, or causal)"
    why = dtypes_reason(q, k, v)
    if why is not None:
        return why
    if D not in head_dims or k.shape[3] != D or v.shape[3] != D:
        return f"head dims {D}, {k.shape[3]}, {v.shape[3]} ({kind} kernel: one of {head_dims})"
    if v.shape[:3] != k.shape[:3] or S < 1 or Hkv < 1 or L < 1:
        return f"keys {tuple(k.shape)}, values {tuple(v.shape)}"
    return None


def _decode_dtypes_reason(q, k, v) -> Optional[str]:
    if q.dtype not in ACTIVATION_DTYPES:
        return activation_dtype_reason("q", q.dtype)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype} (decode kernel: one dtype)"
    return None


def decode_supports(q, k, v, scale, mask, length=None, start=None, gate=None) -> Optional[str]:
    """None when the decode kernel takes this call, else why not."""
    why = span_reason(q, k, mask, length, start)
    if why is not None:
        return why
    max_batch = MAX_BATCH if start is not None or rows_of_one_view(q, k, v, scale, mask, length, start) else 1
    why = _shapes_reason("decode", q, k, v, mask, DECODE_HEAD_DIMS, _decode_dtypes_reason, max_batch)
    if why is not None:
        return why
    Hq, Hkv = q.shape[1], k.shape[1]
    if Hq % Hkv or Hq // Hkv > MAX_GROUP:
        return f"{Hq} query heads on {Hkv} KV heads (decode kernel: at most {MAX_GROUP} per KV head)"
    if gate is not None and (tuple(gate.shape) != (q.shape[0], 1, Hq, q.shape[3]) or gate.dtype != q.dtype):
        return f"an output gate {tuple(gate.shape)} {gate.dtype} (decode kernel: [B, 1, Hq, D] of q's dtype)"
    return None


def decode_key_block(S: int, Hkv: int) -> int:
    """Keys per threadgroup of a split decode over S keys and Hkv KV heads."""
    block = min(MIN_KEY_BLOCK, KEY_BLOCK)
    while block < KEY_BLOCK and math.ceil(S / block) * Hkv > SPLIT_THREADGROUPS:
        block *= 2
    return block


@functools.lru_cache(maxsize=64)
def _scale_array(scale: float) -> mx.array:
    """The softmax scale as the kernels' fp32 [1] input: one array per value,
    not a new one (and its copy to the device) at every decode step."""
    return mx.array([scale], dtype=mx.float32)


@functools.lru_cache(maxsize=64)
def _whole_view(capacity: int) -> mx.array:
    """The end of a start-only batched call: the view's every row."""
    return mx.array([capacity], dtype=mx.int32)


def _launch_decode(q, k, v, scale, mask, length=None, split: bool = False, key_block: int = KEY_BLOCK,
                   start=None, row_form: Optional[RowForm] = None, gate=None) -> Launch:
    B, Hq, _, D = q.shape
    _, Hkv, S, _ = k.shape
    batched = start is not None
    if batched:
        # Each row's blocks follow its own span (row_form); the grid covers
        # the most that any span up to the capacity takes.
        row_form = batch_row_form() if row_form is None else row_form
        groups, key_block = BATCH_SIMD_GROUPS, row_form.max_block
        blocks = row_form.grid_blocks(S, Hkv) if split else 1
        length = _whole_view(S) if length is None else length
    else:
        groups = SPLIT_SIMD_GROUPS if split else SINGLE_PASS_SIMD_GROUPS
        blocks = math.ceil(S / key_block) if split else 1
    threads = groups * SIMD_WIDTH
    gate = None if split else gate  # the split's combine applies it
    if split:
        shapes = [(1,), (B * Hq, blocks, D), (B * Hq, blocks)]
    else:
        shapes = [(B * Hq, D), (1,), (1,)]
    return Launch(
        # The queries are tiny: made contiguous here, so the body indexes them
        # directly; K and V stay as they are (strided views of the cache).
        inputs=[contiguous(q.reshape(B * Hq, D)), k, v, _scale_array(float(scale)),
                *(() if length is None else (length,)), *(() if start is None else (start,)),
                *(() if gate is None else (gate,))],
        grid=(threads * blocks, Hkv, B),
        threadgroup=(threads, 1, 1),
        output_shapes=shapes,
        output_dtypes=[q.dtype, mx.float32, mx.float32],
        template=[
            ("T", q.dtype),
            ("D", D),
            ("G", Hq // Hkv),
            ("NSG", groups),
            ("SPLIT", bool(split)),
            ("BLOCK", key_block if split else 0),
            ("BOUNDED", length is not None),
            ("BATCHED", batched),
            # Each row's own end: a batch cache's rows, or (without a start)
            # rows of one view read as one-row calls, each bounded by its length.
            ("ROW_ENDS", length is not None and length.size > 1),
            ("SPLIT_FROM_KEYS", row_form.split_from if batched else 0),
            ("MIN_BLOCK", row_form.min_block if batched else 0),
            ("SPLIT_TGS", row_form.split_threadgroups if batched else 0),
            ("PREFETCH", int(DECODE_PREFETCH)),
            ("GATED", gate is not None),
        ],
        absent=(() if length is not None else ("length",)) + (() if batched else ("start",))
        + (() if gate is not None else ("gate",)),
    )


def _launch_combine(part_o, part_lse, dtype=mx.bfloat16, gate=None) -> Launch:
    H, _, D = part_o.shape
    return Launch(
        inputs=[part_o, part_lse, *(() if gate is None else (gate,))],
        grid=(D, H, 1),
        threadgroup=(D, 1, 1),
        output_shapes=[(H, D)],
        output_dtypes=[dtype],
        template=[("T", dtype), ("D", D), ("GATED", gate is not None)],
        absent=() if gate is not None else ("gate",),
        finish=lambda outputs: outputs[0],
    )


attention_decode_kernel = Kernel(
    name="attention_decode",
    input_names=("queries", "keys", "values", "scale", "length", "start", "gate"),
    output_names=("out", "part_o", "part_lse"),
    body=Path(__file__).with_name("attention_decode.metal"),
    launch=_launch_decode,
    # Unbounded launches pass no length, unbatched ones no start, ungated
    # ones no gate; the body reads them only when BOUNDED, BATCHED and GATED.
    stand_ins={"length": "auto length = scale;", "start": "auto start = scale;",
               "gate": "auto gate = queries; auto gate_strides = keys_strides;"},
    # For lily_tile_load16 / lily_tile_unpack (16-byte row reads); no tile products.
    tiles=True,
    # The KV cache slice is read in place, through its strides.
    row_contiguous=False,
)

attention_combine_kernel = Kernel(
    name="attention_combine",
    input_names=("part_o", "part_lse", "gate"),
    output_names=("out",),
    body=Path(__file__).with_name("attention_combine.metal"),
    launch=_launch_combine,
    # Ungated launches pass no gate (the body reads it only when GATED);
    # a gated one reads the gate through its strides.
    stand_ins={"gate": "auto gate = part_o; auto gate_shape = part_lse_shape; "
                       "auto gate_strides = part_lse_shape;"},
    row_contiguous=False,
)


def decode_form(keys: int, kv_heads: int) -> tuple[bool, int]:
    """(split, keys per block; 0 for the single pass) that ``run_decode``
    takes by default over ``keys`` keys: one kernel instance per form."""
    split = keys >= SPLIT_FROM
    return split, decode_key_block(keys, kv_heads) if split else 0


def run_decode(backend: str, q, k, v, scale, mask, length=None, split_from: Optional[int] = None,
               key_block: Optional[int] = None, start=None, row_form: Optional[RowForm] = None,
               gate=None) -> mx.array:
    """The decode kernels on ``backend``: [B, Hq, 1, D] (the split and its
    block size default to ``SPLIT_FROM`` and ``decode_key_block``). With a
    ``length`` the form follows the view's rows (the cache's capacity), so
    one launch serves every length up to it. With a ``start`` (B rows) the
    launch splits from ``row_form.split_from`` rows of the view and each
    row's blocks follow its own span (``row_form``, default ``batch_row_form``).
    ``gate`` [B, 1, Hq, D]: applied where the output is written (``gated``'s
    bits)."""
    if start is not None:
        row_form = batch_row_form() if row_form is None else row_form
        split_from = row_form.split_from
    split_from = SPLIT_FROM if split_from is None else split_from
    split = k.shape[2] >= split_from
    key_block = decode_key_block(k.shape[2], k.shape[1]) if key_block is None else key_block
    out, part_o, part_lse = attention_decode_kernel.run_on(
        backend, q, k, v, scale, mask, length, split=split, key_block=key_block, start=start, row_form=row_form,
        gate=gate,
    )
    if split:
        out = attention_combine_kernel.run_on(backend, part_o, part_lse, q.dtype, gate)
    return out.reshape(q.shape)


# -- prefill -----------------------------------------------------------------

# Threadgroups of 8 SIMD groups own 64 query rows (packed GQA) and step
# through the keys PREFILL_KEY_STEP at a time (the body's own constants). Threadgroup memory at D = 256: K (or V^T) 18 KB, scores 8 KB,
# P 5 KB: within Metal's 32 KB (and CUDA's 48 KB of static shared memory).
PREFILL_SIMD_GROUPS = 8
PREFILL_ROWS = 64
PREFILL_KEY_STEP = 32
PREFILL_HEAD_DIMS = (32, 64, 128, 256)
PREFILL_MAX_GROUP = PREFILL_ROWS  # at least one query position per threadgroup


def _prefill_dtypes_reason(q, k, v) -> Optional[str]:
    if q.dtype != mx.bfloat16 or k.dtype != mx.bfloat16 or v.dtype != mx.bfloat16:
        # The matrix tiles multiply bf16 only (fp16 prompt calls: the reference).
        return f"dtypes {q.dtype}, {k.dtype}, {v.dtype} (prefill kernel: bfloat16)"
    return None


def prefill_supports(q, k, v, scale, mask, length=None, start=None, gate=None) -> Optional[str]:
    """None when the prefill kernel takes this call, else why not (an output
    gate is applied after it, as the reference applies it)."""
    if length is not None or start is not None:
        return "a length bound or key start (decode only)"
    why = _shapes_reason("prefill", q, k, v, mask, PREFILL_HEAD_DIMS, _prefill_dtypes_reason)
    if why is not None:
        return why
    Hq, L = q.shape[1], q.shape[2]
    Hkv, S = k.shape[1], k.shape[2]
    if mask == "causal" and S < L:
        return f"causal with fewer keys ({S}) than queries ({L})"
    if Hq % Hkv or Hq // Hkv > PREFILL_MAX_GROUP:
        return f"{Hq} query heads on {Hkv} KV heads"
    return None


def _launch_prefill(q, k, v, scale, mask) -> Launch:
    _, Hq, L, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    positions = PREFILL_ROWS // G
    threads = PREFILL_SIMD_GROUPS * SIMD_WIDTH
    return Launch(
        inputs=[contiguous(q), k, v, _scale_array(float(scale))],
        grid=(threads * math.ceil(L / positions), Hkv, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[q.shape],
        output_dtypes=[mx.bfloat16],
        template=[
            ("D", D),
            ("G", G),
            ("BK", PREFILL_KEY_STEP),
            ("CAUSAL", mask is not None),
        ],
        finish=lambda outputs: outputs[0],
    )


attention_prefill_kernel = Kernel(
    name="attention_prefill",
    input_names=("queries", "keys", "values", "scale"),
    output_names=("out",),
    body=Path(__file__).with_name("attention_prefill.metal"),
    launch=_launch_prefill,
    tiles=True,
    row_contiguous=False,
)


def run_prefill(backend: str, q, k, v, scale, mask) -> mx.array:
    """The prefill kernel on ``backend``: [1, Hq, L, D]."""
    return attention_prefill_kernel.run_on(backend, q, k, v, scale, mask)


# -- the op's kernels ----------------------------------------------------------


def attention_agree(got, want, *args, **kwargs) -> Optional[str]:
    """None when the kernel's output is within the reference's own rounding.

    The kernel is exact up to fp32 and one bf16 rounding; the reference may
    round scores and probabilities to bf16 before the products (MLX's unfused
    path), which moves each weight by up to ~2^-8 relative: allow 2^-5 of the
    output's largest magnitude (outputs are averages of values, so the largest
    magnitude is their scale). In fp16 both round 8 times finer: 2^-8.
    """
    bound = 2.0**-5 * step_scale(want.dtype)
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    if got.shape != want.shape:
        return f"shape {got.shape} != reference {want.shape}"
    scale = max(mx.abs(want).max().item(), 1e-3)
    err = mx.abs(got - want).max().item() / scale
    return None if err <= bound else f"max |kernel - reference| / max |reference| = {err:.3g}"


KERNELS = (
    attention_decode_kernel,
    attention_combine_kernel,
    attention_prefill_kernel,
)


class AttentionKernels(KernelGroup):
    """The attention op's kernels behind one ``KernelLike`` (see registry.py).

    ``run_on`` routes each call by shape: decode (``decode_supports``) to the
    decode kernels, anything else to the reference. ``ready_on`` builds the
    kernels and self-checks each path once per backend and process on small
    inputs that exercise it (the single pass and the split with three key
    blocks, on strided K/V views); a path that fails is turned off with one
    notice and its calls run the reference.
    """

    name = "attention"
    agree = staticmethod(attention_agree)

    def __init__(self):
        self._checked: dict = {}
        self._lock = threading.RLock()

    def checks(self):
        """(path, run(backend, *args), args) for each self-check."""
        def single(backend, *args):
            return run_decode(backend, *args, split_from=1 << 30)

        def split(backend, *args):
            return run_decode(backend, *args, split_from=1, key_block=8)

        def batch_one_block(backend, *args):
            return run_decode(backend, *args[:5], **args[5], row_form=RowForm(1 << 30, 4, 8, 8))

        def batch_split(backend, *args):
            return run_decode(backend, *args[:5], **args[5], row_form=RowForm(8, 4, 8, 8))

        # The batched call again with the layer's output gate: applied by the
        # one-block launch, and by the split's combine.
        gated_batch = batch_check_inputs()
        q = gated_batch[0]
        gated_batch[5]["gate"] = output_gate(q.shape[0], 1, q.shape[1], q.shape[3])

        # Bounded: 19 of 45 rows, so the split has blocks with no key.
        # Batched: three left-padded rows, one of them split into blocks.
        # Rows of one view: three positions of a stream, 17 to 19 keys.
        return [
            ("decode", single, _decode_check_inputs(19)),
            ("decode", split, _decode_check_inputs(19)),
            ("decode", single, _bounded_check_inputs(19, 45)),
            ("decode", split, _bounded_check_inputs(19, 45)),
            ("decode", batch_one_block, batch_check_inputs()),
            ("decode", batch_split, batch_check_inputs()),
            ("decode", batch_one_block, gated_batch),
            ("decode", batch_split, gated_batch),
            ("rows", single, rows_check_inputs([17, 18, 19], 45)),
            ("rows", split, rows_check_inputs([17, 18, 19], 45)),
            ("prefill", run_prefill, _prefill_check_inputs(11, 45)),
        ]

    def ready_on(self, backend: str) -> tuple[bool, str]:
        known = self._checked.get(backend)
        if known is not None:
            return known[0]
        with self._lock:
            if backend not in self._checked:
                self._checked[backend] = self._self_check(backend)
            return self._checked[backend][0]

    def _self_check(self, backend: str):
        paths: dict = {}
        for kernel in KERNELS:
            ok, why = kernel.ready_on(backend)
            if not ok:
                return (False, why), {}
        for path, run, args in self.checks():
            if paths.get(path) is not None:
                continue  # this path already failed
            try:
                got = run(backend, *args)
                mx.eval(got)
                # A batched check's last argument is its keywords.
                keywords = args[-1] if isinstance(args[-1], dict) else {}
                want = attention_reference(*args[:len(args) - bool(keywords)], **keywords)
                why = attention_agree(got, want)
            except Exception as exc:  # compile errors surface at the first eval
                why = f"failed to run: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            paths[path] = why
            if why is not None:
                notice_once(
                    f"kernel-off:attention-{path}:{backend}",
                    f"kernel attention ({path}) is off on {backend} ({why}); "
                    "those calls run the pure-MLX reference",
                )
        working = sorted(p for p, why in paths.items() if why is None)
        if not working:
            return (False, f"{backend} self-check failed: " + "; ".join(
                f"{p}: {why}" for p, why in paths.items())), paths
        return (True, f"{backend} kernel ({', '.join(working)}), self-check passed"), paths

    def forget(self) -> None:
        """Drop self-check results and built kernels (tests)."""
        with self._lock:
            self._checked.clear()
            for kernel in KERNELS:
                kernel.forget()

    def path_for(self, backend: str, *args, **kwargs) -> Optional[str]:
        """'decode', 'prefill' or None (the reference) for this call; the
        backend is part of the kernel objects' common signature (bench asks
        every op's kernels the same way)."""
        return self._path(*args, **kwargs)

    def decode_on(self, backend: str) -> bool:
        """Whether decode calls run the kernels on ``backend`` (built, and the
        decode self-checks passed)."""
        return self.ready_on(backend)[0] and self._failed(backend, "decode") is None

    def rows_on(self, backend: str) -> bool:
        """Whether calls of rows of one view at their own lengths run the
        decode kernel on ``backend`` (their own self-checks passed too: a
        failure there turns off only that form, whose callers then take one
        row a call)."""
        return self.decode_on(backend) and self._failed(backend, "rows") is None

    def _failed(self, backend: str, path: Optional[str]) -> Optional[str]:
        """Why ``path``'s self-check failed on ``backend``, or None."""
        return self._checked.get(backend, (None, {}))[1].get(path)

    def _path(self, *args, **kwargs) -> Optional[str]:
        if decode_supports(*args, **kwargs) is None:
            return "rows" if rows_of_one_view(*args, **kwargs) else "decode"
        if prefill_supports(*args, **kwargs) is None:
            return "prefill"
        return None

    def run_on(self, backend: str, q, k, v, scale, mask, length=None, start=None, gate=None):
        path = self._path(q, k, v, scale, mask, length, start, gate)
        failed = self._failed(backend, path) or (self._failed(backend, "decode") if path == "rows" else None)
        if path in ("decode", "rows") and failed is None:
            return run_decode(backend, q, k, v, scale, mask, length, start=start, gate=gate)
        if path == "prefill" and failed is None:
            return gated(run_prefill(backend, q, k, v, scale, mask), gate)
        return attention_reference(q, k, v, scale, mask, length, start, gate)


def attention_supports(q, k, v, scale, mask, length=None, start=None, gate=None) -> Optional[str]:
    """None when one of the attention kernels takes this call, else why not."""
    if q.ndim == 4 and q.shape[2] == 1 and decode_supports(q, k, v, scale, mask, length, start, gate) is None:
        return None
    if q.ndim == 4 and q.shape[2] == 1 and (start is not None or q.shape[0] > 1):
        return decode_supports(q, k, v, scale, mask, length, start, gate)
    return prefill_supports(q, k, v, scale, mask, length, start, gate)


attention_kernels = AttentionKernels()

attention = register(
    LilyOp(
        "attention",
        attention_reference,
        kernel=attention_kernels,
        supports=attention_supports,
        prefers_reference=attention_prefers_reference,
        description="GQA scaled dot-product attention",
        sample=_sample_attention,
        fuzz=_fuzz_attention,
    )
)
