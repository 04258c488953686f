"""The measurements themselves: one arm (warmup, prefill, decode) and the
teacher-forced numerics. Both engines go through exactly this code."""

from __future__ import annotations

import hashlib
import statistics
import time
from typing import Any, Dict, List

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generate_step, generation_stream, wired_limit
from mlx_lm.models.cache import make_prompt_cache

from .common import PREFILL_STEP, last_op_paths, prompt_ids
from .gpu_time import decode_gpu_ms
from .engines import lily_layer_count
from .gpu_clocks import sampled_clocks

# Decode steps in a warmup: enough to build and run the one-token graph a few
# times at the arm's context; the arm's prefill shapes are warmed in full.
WARMUP_DECODE_STEPS = 8


def tokens_digest(tokens: List[int]) -> str:
    return hashlib.sha1(",".join(map(str, tokens)).encode()).hexdigest()[:16]


def _sync() -> None:
    mx.synchronize(generation_stream)
    mx.synchronize()


def generate(model: Any, prompt: mx.array, decode_steps: int, cache: Any = None) -> Dict[str, Any]:
    """Greedy generation through mlx-lm's own ``generate_step`` (the loop
    behind ``stream_generate``/``generate``), timed as ``stream_generate``
    times it: prefill = until the first token is available (mlx-lm chunks the
    prompt by 2048 and evaluates each chunk's cache), decode = the next
    ``decode_steps`` tokens (each ``.item()`` waits for its token).

    ``stream_generate`` itself is not used because it needs a tokenizer and
    stops at EOS; a benchmark must run exactly ``decode_steps`` tokens.
    ``cache``: the prompt cache to fill (default: a fresh one, mlx-lm's)."""
    gen = generate_step(
        prompt, model, max_tokens=decode_steps + 1, prefill_step_size=PREFILL_STEP,
        prompt_cache=cache,
    )
    with wired_limit(model, [generation_stream]):
        start = time.perf_counter()
        first, _ = next(gen)
        first_at, decode_from = time.perf_counter(), time.time()
        tokens = [first]
        for _ in range(decode_steps):
            token, _ = next(gen)
            tokens.append(token)
        end, decode_to = time.perf_counter(), time.time()
        # generate_step dispatches one step ahead; let it finish before the
        # next measurement starts.
        gen.close()
        _sync()
    return {"prefill_s": first_at - start, "decode_s": end - first_at, "tokens": tokens,
            "decode_window": (decode_from, decode_to)}


def prompt_array(length: int, vocab_size: int) -> mx.array:
    prompt = mx.array(prompt_ids(length, vocab_size))
    mx.eval(prompt)
    return prompt


def warmup(model: Any, length: int, vocab_size: int) -> float:
    """An unmeasured run at the given prompt length; returns its seconds."""
    start = time.perf_counter()
    generate(model, prompt_array(length, vocab_size), WARMUP_DECODE_STEPS)
    mx.clear_cache()
    return time.perf_counter() - start


def measure_arm(model: Any, length: int, vocab_size: int, decode_steps: int,
                cache: Any = None, timed_from: int = 0, gpu_clocks: bool = False,
                gpu_time: bool = True) -> Dict[str, Any]:
    """One measured prefill of ``length`` tokens then ``decode_steps`` decode
    steps; throughputs, the tokens (and their digest), peak memory, and the
    kernels and bytes of one more decode step on the run's cache
    (``bench.counts``; counted after the measurement, so it costs it nothing).
    With ``cache`` already holding the prompt's first ``timed_from`` tokens,
    only the rest is prefilled and timed (``lily_prefilled_cache``). With
    ``gpu_clocks``, the GPU's clocks during the decode (``bench.gpu_clocks``).
    With ``gpu_time``, the kernels' device time of a few more decode steps
    (``bench.gpu_time``; None where the platform has no timer)."""
    prompt = prompt_array(length, vocab_size)
    mx.clear_cache()
    mx.reset_peak_memory()
    cache = make_prompt_cache(model) if cache is None else cache
    with sampled_clocks(gpu_clocks) as clocks:
        run = generate(model, prompt[timed_from:], decode_steps, cache)
    peak = mx.get_peak_memory()
    host_ms = host_ms_per_decode_token(model, cache, run["tokens"][-1])
    gpu_ms, gpu_note = decode_gpu_ms(model, cache, run["tokens"][-1]) if gpu_time else (None, "not asked for")
    counts = _counts(model, cache, run["tokens"][-1])
    del cache
    mx.clear_cache()
    return {
        "prefill_s": run["prefill_s"],
        "prefill_tps": (length - timed_from) / run["prefill_s"],
        "decode_s": run["decode_s"],
        "decode_tps": decode_steps / run["decode_s"],
        "tokens": run["tokens"],
        "digest": tokens_digest(run["tokens"]),
        "peak_memory_bytes": int(peak),
        "lily_layers": lily_layer_count(model),
        "op_last_paths": last_op_paths(),
        "counts": counts,
        "host_ms_per_decode_token": host_ms,
        "gpu_ms_per_decode_token": gpu_ms,
        "gpu_time_note": gpu_note,
        "decode_gpu_clocks": clocks.summary(*run["decode_window"]),
    }


HOST_STEPS = 8


def host_ms_per_decode_token(model: Any, cache: Any, token: int, steps: int = HOST_STEPS) -> float:
    """Milliseconds the host spends building one decode step's graph (the
    model's Python and MLX's graph construction, before any evaluation):
    median over ``steps`` steps, each evaluated (untimed) before the next.
    When this is near the time per decode token, decode is bound by the host,
    not by the GPU's kernels. Advances ``cache`` by ``steps`` tokens."""
    return decode_step_times(model, cache, token, steps)[0]


def _chunked_prefill(model: Any, vocab_size: int, context: int) -> Any:
    """A fresh prompt cache holding the prompt's first ``context`` tokens,
    prefilled in mlx-lm's chunks (each chunk's cache evaluated)."""
    cache = make_prompt_cache(model)
    prompt = prompt_array(context, vocab_size)
    for start in range(0, context, PREFILL_STEP):
        model(prompt[None, start:start + PREFILL_STEP], cache=cache)
        mx.eval([c.state for c in cache])
    return cache


def lily_prefilled_cache(model: Any, vocab_size: int, context: int) -> Any:
    """``context`` prompt tokens prefilled by lily's engine, the model switched
    back to the engine it ran. Lily and stock share the cache types, so either
    engine goes on from it: long-context arms time only their last chunk and
    the decode (``--depth-from``)."""
    from .engines import switch

    engine = "lily" if lily_layer_count(model) else "stock"
    switch(model, "lily")
    try:
        cache = _chunked_prefill(model, vocab_size, context)
    finally:
        switch(model, engine)
    mx.clear_cache()
    return cache


def prefilled_cache(model: Any, vocab_size: int, context: int) -> Any:
    """``context`` prompt tokens prefilled, then three decode steps
    (compilation and first-use checks), for timing decode at that context."""
    cache = _chunked_prefill(model, vocab_size, context)
    decode_step_times(model, cache, 1, 3)
    return cache


def decode_step_times(model: Any, cache: Any, token: int, steps: int) -> tuple:
    """(median ms building a step's graph, median ms of the whole step, built
    and evaluated) over ``steps`` greedy decode steps on ``cache``."""
    host, whole = [], []
    tok = mx.array([[token]])
    for _ in range(steps):
        start = time.perf_counter()
        logits = model(tok, cache=cache)
        built = time.perf_counter()
        tok = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(tok, [c.state for c in cache])
        host.append(built - start)
        whole.append(time.perf_counter() - start)
    return 1e3 * statistics.median(host), 1e3 * statistics.median(whole)


def _counts(model: Any, cache: Any, token: int) -> Dict[str, Any]:
    """One decode step's counts; a failure is recorded, not raised (the
    throughput figures stand without it)."""
    from .counts import decode_step_counts

    try:
        return decode_step_counts(model, cache, token)
    except Exception as exc:  # noqa: BLE001 - recorded in the arm's JSON
        return {"error": f"{type(exc).__name__}: {exc}"}


# ---------------------------------------------------------------- numerics


# One bf16 step: the smallest change the model's activations can carry.
NOISE_STEP = 2.0**-7


def score(model: Any, tokens: mx.array, nudge_first: bool = False) -> np.ndarray:
    """Teacher-forced next-token log-probabilities [N, V] in fp32: one
    forward over the sequence with a fresh cache (one prefill chunk).

    ``nudge_first`` scales the first token's embedding by one bf16 step, to
    measure how far rounding-sized noise alone moves this model's outputs."""
    cache = make_prompt_cache(model)
    if nudge_first:
        embeddings = model.model.embed_tokens(tokens[None])
        scale = mx.ones((1, tokens.size, 1)).at[0, 0, 0].add(NOISE_STEP)
        embeddings = (embeddings.astype(mx.float32) * scale).astype(embeddings.dtype)
        logits = model(tokens[None], cache=cache, input_embeddings=embeddings)[0]
    else:
        logits = model(tokens[None], cache=cache)[0]
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(logprobs)
    out = np.array(logprobs)
    del cache, logits, logprobs
    mx.clear_cache()
    return out


def supports_input_embeddings(model: Any) -> bool:
    from mlx_lm.utils import does_model_support_input_embeddings

    embed = getattr(getattr(model, "model", None), "embed_tokens", None)
    return embed is not None and does_model_support_input_embeddings(model)


def compare(lily: np.ndarray, stock: np.ndarray, tokens: np.ndarray) -> Dict[str, Any]:
    """Top-1 agreement, perplexities and KL(lily || stock), all in fp32/fp64.

    The divergence of lily's next-token distribution Q from stock's P:
    sum_v Q(v) (log Q(v) - log P(v)), averaged over positions."""
    n = len(tokens)
    targets = tokens[1:]

    def ppl(lp: np.ndarray) -> float:
        nll = -lp[np.arange(n - 1), targets].astype(np.float64)
        return float(np.exp(nll.mean()))

    top1 = float((lily.argmax(-1) == stock.argmax(-1)).mean())
    # A few rows at a time: at a 248K vocabulary a float64 copy of all rows
    # would be half a gigabyte per array.
    kl = np.concatenate([
        (np.exp(q) * (q - s)).sum(-1)
        for s, q in (
            (stock[i:i + 32].astype(np.float64), lily[i:i + 32].astype(np.float64))
            for i in range(0, n, 32)
        )
    ])
    ppl_lily, ppl_stock = ppl(lily), ppl(stock)
    return {
        "positions": n,
        "top1_agreement": top1,
        "ppl_lily": ppl_lily,
        "ppl_stock": ppl_stock,
        "ppl_rel_diff": (ppl_lily - ppl_stock) / ppl_stock,
        "kl_mean": float(kl.mean()),
        "kl_max": float(kl.max()),
        "kl_direction": "KL(lily || stock): the divergence of lily's distribution from stock's",
        "max_abs_logprob_diff": float(np.abs(lily - stock).max()),
    }
