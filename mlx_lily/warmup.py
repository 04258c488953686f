"""Build and check every kernel instance a server will meet, at load time.

A lily kernel is built, and checked at its first use, for each set of
template arguments it is launched with; which instances a request needs
follows from its prompt's length. ``prime(model)`` runs the model once over a
few synthetic prompts chosen so that every such instance is met, rather than
the first request of each kind paying for them mid-request. It runs by
default under ``mlx_lm.server --backend lily`` and ``python -m mlx_lily
serve``; ``MLX_LILY_PRIME=1`` asks for it in any program that loads through
lily, ``MLX_LILY_PRIME=0`` turns it off.

Which instances, the prompts, and a measurement: docs/layer-notes.md#warmup.
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any, List, Optional

import mlx.core as mx

from . import call_trace
from ._notice import notice_once
from .kernels.gated_delta.recurrence import CHUNKED_FROM
from .kernels.linear.gemv import BATCH_BUCKETS
from .kernels.moe.routing import TILE_ROWS
from .layers.decoder import priming
from .toolchain.registry import kernel_backend

PRIME_ENV = "MLX_LILY_PRIME"
# Tokens of a prompt's short tail chunk and of the batched prompts.
SHORT_CHUNK = 10
DECODE_TOKENS = 2
# Decode batches primed: one per row bucket of the batched GEMV (a single
# request primes the one-row bucket).
PRIME_BATCHES = tuple(b for b in BATCH_BUCKETS if b > 1)


def requested(program: Optional[str]) -> bool:
    """Whether to prime: ``MLX_LILY_PRIME`` if set, else only under mlx_lm.server."""
    value = os.environ.get(PRIME_ENV, "").strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    if value:
        notice_once(f"prime-env:{value}", f"{PRIME_ENV}={value!r} is not 0 or 1; ignored")
    return program == "mlx_lm.server"


def _moe_shape(model: Any) -> Optional[tuple]:
    """(experts, top_k) of the model's routed MoE, or None if it has none."""
    for layer in getattr(model, "layers", []):
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and hasattr(mlp, "num_experts") and hasattr(mlp, "top_k"):
            return int(mlp.num_experts), int(mlp.top_k)
    return None


def chunk_lengths(experts: int, top_k: int) -> List[int]:
    """Prompt chunk lengths that meet each MoE tile size and both DeltaNet
    forms, in the order they run on one cache (the first has no incoming
    state, the others do): the largest tile's chunk, then each smaller tile's
    (chunked DeltaNet where the tile's range allows), then a short tail."""
    def tokens_for(average_rows: float) -> int:
        # The fewest tokens whose rows per expert exceed ``average_rows``.
        return math.floor(average_rows * experts / top_k) + 1

    lengths = [max(tokens_for(TILE_ROWS[-2]), CHUNKED_FROM)]
    for below, tile in zip(TILE_ROWS[:-2], TILE_ROWS[1:-1]):
        first, last = tokens_for(below), tokens_for(tile) - 1
        lengths.append(max(first, min(CHUNKED_FROM, last)))
    lengths.append(min(SHORT_CHUNK, CHUNKED_FROM - 1))
    return lengths


def _prompt(length: int, offset: int = 0) -> mx.array:
    # Any ids a vocabulary of 100 or more holds; their values do not matter.
    return (mx.arange(offset, offset + length) * 7919 % 97 + 3)[None]


def prime(model: Any, log=None, server: bool = True) -> Optional[dict]:
    """Run ``model`` over synthetic prompts that meet every kernel instance a
    server's requests can (``server``; else ``mlx_lm.generate``'s calls);
    returns what ran (None when nothing needed it)."""
    backend, _ = kernel_backend()
    shape = _moe_shape(model)
    if backend is None or shape is None or not _is_lily(model):
        return None
    log = log or (lambda message: print(f"[mlx-lily] {message}", file=sys.stderr, flush=True))
    lengths = chunk_lengths(*shape)
    caches = "the server's" if server else "mlx_lm.generate's"
    log(f"priming lily's kernels on {backend}: prompt chunks of {', '.join(map(str, lengths))} "
        f"tokens on {caches} caches, decode steps and decode batches of "
        f"{', '.join(map(str, PRIME_BATCHES))} ({PRIME_ENV}=0 skips this)")
    start = time.perf_counter()
    with call_trace.paused(), priming():
        _run(model, lengths, start, log, server)
    mx.clear_cache()
    seconds = time.perf_counter() - start
    log(f"primed in {seconds:.1f}s")
    return {"backend": backend, "chunks": lengths, "server_caches": server, "seconds": seconds}


def _prime_piece_states(model: Any, server: bool) -> None:
    """The chunked DeltaNet state pass that keeps the state after a call's
    last whole chunk, which prefix reuse asks for while it records a prompt
    (without and with an incoming state): two calls that end inside a chunk."""
    from .prefix_reuse import ask_piece_states, cuts_merge

    if not cuts_merge():
        return  # the recorder asks only where those checkpoints can be exact
    cache = prompt_cache(model, server)
    ask_piece_states(cache, True)
    try:
        for offset in (0, CHUNKED_FROM + SHORT_CHUNK):
            mx.eval(model(_prompt(CHUNKED_FROM + SHORT_CHUNK, offset), cache=cache), [c.state for c in cache])
    finally:
        ask_piece_states(cache, False)


def _prime_packed_rows(model: Any, server: bool) -> bool:
    """Prompts arriving together, packed into one call (layers/prompt_rows.py):
    the DeltaNet rows' batch (``gated_delta_rows``: its kernels and their
    self-check), without and with incoming states and prefix reuse's
    checkpoints, and the rows' attention. False where nothing is packed."""
    from .layers.prompt_rows import _packable, packed_call, packing_enabled
    from .prefix_reuse import ask_piece_states, cuts_merge

    text = model.language_model.model
    if not (packing_enabled() and _packable(text)):
        return False
    for capture in (False, True) if cuts_merge() else (False,):
        caches = [prompt_cache(model, server) for _ in range(2)]
        for cache in caches:
            ask_piece_states(cache, capture)
        for offset in (0, CHUNKED_FROM + 2):  # fresh rows, then rows with a state
            ids = [_prompt(CHUNKED_FROM + 1 + r, offset + r) for r in range(2)]
            mx.eval(packed_call(text, ids, caches), [c.state for cache in caches for c in cache])
        for cache in caches:
            ask_piece_states(cache, False)
    return True


def prompt_cache(model: Any, server: bool) -> List[Any]:
    """A fresh cache for one prompt: ``mlx_lm.generate``'s, or the one the
    server's batch generator makes of it (each cache merged into a batch of
    one, as mlx-lm's ``BatchGenerator`` does)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    if server:
        cache = [c.merge([c]) if hasattr(c, "merge") else c for c in cache]
    return cache


class _PhaseCosts:
    """What one priming step's time went to, for its progress line: the
    kernels' first-use checks (building and running each new instance, on
    CUDA mostly compiling it; and its reference), the modules lily's CUDA
    cache compiled, first uses met inside a compiled step's trace (each
    traces the step again), and the kernels MLX itself compiled into its PTX
    folder (``_mlx_ptx_files``: its own ops' and fused elementwise kernels).
    The rest of a step's seconds is
    running and tracing the model. Why: on the H200 one step of priming took
    minutes where its neighbours took seconds; at 5b9ed7a its line showed that
    neither lily's compiling nor its checks took that time."""

    def __init__(self):
        self._at = self._now()

    @staticmethod
    def _now() -> tuple:
        from .toolchain import tracing

        first = tracing.FIRST_USE_TIME
        cache = None
        if kernel_backend()[0] == "cuda":
            from .toolchain import cuda_cache

            cache = cuda_cache.module_cache()
        return (time.perf_counter(), first.checks, first.kernel_s, first.reference_s,
                cache.compiled if cache else 0, cache.compile_s if cache else 0.0, tracing.first_uses_in_traces(),
                _mlx_ptx_files())

    def take(self) -> str:
        """This step's costs since the last ``take`` (or the start)."""
        now = self._now()
        seconds, checks, kernel_s, reference_s, compiled, compile_s, in_traces, mlx_files = (
            a - b for a, b in zip(now, self._at))
        self._at = now
        parts = [f"{seconds:.1f}s here", f"{checks} first-use checks: kernels {kernel_s:.1f}s, "
                                         f"references {reference_s:.1f}s"]
        if compiled:
            parts.append(f"{compiled} modules compiled ({compile_s:.1f}s of compiling)")
        if in_traces:
            parts.append(f"{in_traces} first uses inside traces")
        if mlx_files > 0:  # (a folder emptied meanwhile counts none)
            parts.append(f"{mlx_files} of MLX's own kernels compiled")
        return "; ".join(parts)


def _mlx_ptx_files() -> int:
    """Modules in MLX's PTX folder (``cuda_cache.ptx_dir``: MLX_PTX_CACHE_DIR,
    else MLX's default) that are not custom kernels, on CUDA: each one of
    MLX's own kernels it compiled (a module's ``.ptx``; long names are
    folders of it)."""
    if kernel_backend()[0] != "cuda":
        return 0
    from .toolchain import cuda_cache

    folder = cuda_cache.ptx_dir()
    try:
        return sum(1 for path in folder.rglob("*.ptx")
                   if not path.relative_to(folder).parts[0].startswith("custom_kernel_"))
    except OSError:
        return 0


def _run(model: Any, lengths: List[int], start: float, log, server: bool) -> None:
    costs = _PhaseCosts()

    def said(what: str, note: str = "") -> None:
        """A step's progress line: the seconds since priming began, then where
        this step's went."""
        log(f"  primed {what} ({note}{time.perf_counter() - start:.1f}s; {costs.take()})")

    cache = prompt_cache(model, server)
    done = 0
    for length in lengths:
        logits = model(_prompt(length, done), cache=cache)
        mx.eval(logits, [c.state for c in cache])
        done += length
        said(f"a {length}-token chunk")
    token = mx.argmax(logits[:, -1:], axis=-1)
    for _ in range(DECODE_TOKENS):
        logits = model(token, cache=cache)
        token = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(token, [c.state for c in cache])
    # A short prompt alone: the sequential recurrence without a state.
    mx.eval(model(_prompt(SHORT_CHUNK), cache=prompt_cache(model, server)))
    del cache, logits
    said(f"{DECODE_TOKENS} decode steps and a short prompt alone")

    if not server:
        # The server's attention decode calls carry its batch caches' array
        # masks, which run MLX's sdpa: none meets these kernel instances.
        _prime_attention_decode(model)
        said("the attention decode's key-block forms")

    if server:
        # A prompt of several prefill steps through the batch generator, as a
        # server's long prompt runs: its short tail chunk carries a state and no mask.
        long = 2 * CHUNKED_FROM + SHORT_CHUNK + 1
        run_batch(model, [_prompt(long)[0].tolist()], DECODE_TOKENS, prefill_step_size=CHUNKED_FROM)
        said(f"a prompt of {long} tokens in chunks of {CHUNKED_FROM}")
        _prime_piece_states(model, server)
        said("prefix reuse's checkpoints inside a call")
        if _prime_packed_rows(model, server):
            said("prompts packed together")

    # Batches of mixed lengths, one per build of the batched decode kernels
    # (the GEMV's row buckets; the other batched kernels have one build).
    for rows in PRIME_BATCHES:
        batch = [_prompt(SHORT_CHUNK // (1 + r % 2), r)[0].tolist() for r in range(rows)]
        steps = run_batch(model, batch, DECODE_TOKENS + 1)
        said(f"a decode batch of {rows}", f"{steps} steps, ")


def run_batch(model: Any, prompts: List[List[int]], max_tokens: int, prefill_step_size: int = 2048,
              rows: Optional[int] = None) -> int:
    """Run ``prompts`` through mlx-lm's BatchGenerator, ``rows`` at a time
    (default: all together), as the server does, until every one has
    finished; returns the calls that gave tokens. (A call of ``next()`` that
    only prefills gives none: that is not the end.)"""
    from mlx_lm.generate import BatchGenerator

    rows = rows or len(prompts)
    gen = BatchGenerator(model, completion_batch_size=rows, prefill_batch_size=rows,
                         prefill_step_size=prefill_step_size)
    finished, steps = set(), 0
    chunks = sum(-(-len(p) // prefill_step_size) + 1 for p in prompts)
    try:
        uids = gen.insert(prompts, max_tokens=[max_tokens] * len(prompts))
        # Bounded: every prompt's chunks, then max_tokens steps each, with room to spare.
        for _ in range(2 * (chunks + max_tokens * len(prompts)) + 8):
            _, responses = gen.next()
            steps += bool(responses)
            finished |= {r.uid for r in responses if r.finish_reason is not None}
            if finished >= set(uids):
                break
    finally:
        gen.close()
    return steps


def decode_contexts(kv_heads: int, longest: int = 1 << 18) -> List[int]:
    """The shortest context of each attention decode form (``decode_form``:
    the single pass, then each key-block size of the split, which grows with
    the context, so a long conversation meets each first mid-reply)."""
    from .kernels.attention.sdpa import SPLIT_FROM, decode_form

    seen, contexts, n = set(), [], 1
    while n <= longest:
        form = decode_form(n, kv_heads)
        if form not in seen:
            seen.add(form)
            contexts.append(n)
        n = n * 2 if n < SPLIT_FROM else n + SPLIT_FROM
    return contexts


def _prime_attention_decode(model: Any) -> None:
    """One attention decode call per form (``decode_contexts``) on stand-in
    keys: the chunks above reach only the shorter contexts. Each form also
    bounded, as the whole decode step calls it: over a cache of whole
    capacity steps, its form set by the capacity, the length on the device.
    Each with the layer's output gate, which the decode steps hand the
    attention op (a view of the query projection's halves, as theirs)."""
    from . import kernels as K
    from .kernels.attention.sdpa import decode_form
    from .layers.text_model import whole_capacity

    attn = next((layer.self_attn for layer in model.layers if hasattr(layer, "self_attn")), None)
    if attn is None:
        return
    Hq, Hkv, D = attn.num_attention_heads, attn.num_key_value_heads, attn.head_dim
    q = mx.zeros((1, Hq, 1, D), mx.bfloat16)
    gate = mx.split(mx.zeros((1, 1, Hq, 2 * D), mx.bfloat16), 2, axis=-1)[1]
    bounded = set()
    for n in decode_contexts(Hkv):
        kv = mx.zeros((1, Hkv, n, D), mx.bfloat16)
        mx.eval(K.attention(q, kv, kv, attn.scale, None, gate=gate))
        capacity = whole_capacity(n)
        form = decode_form(capacity, Hkv)
        if form not in bounded:
            bounded.add(form)
            kv = mx.zeros((1, Hkv, capacity, D), mx.bfloat16)
            mx.eval(K.attention(q, kv, kv, attn.scale, None, length=mx.array([n], dtype=mx.int32), gate=gate))


def _is_lily(model: Any) -> bool:
    """Whether ``model`` is lily's model class (other model types load stock)."""
    return type(model).__module__.startswith("mlx_lily.")
