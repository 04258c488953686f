"""Where a server's decode time goes, timed inside ``mlx_lm.server``'s process.

``bench.serve_process`` installs this when ``bench --serve`` names a file in
``LILY_BENCH_SERVER_SPLIT``. On the generation thread it times each decode step
of mlx-lm's ``GenerationBatch`` (one token for every row of the batch), by
batch size B:

* ``build``: the step up to MLX's launch, chiefly the model's call (building
  the step's graph);
* ``launch``: ``mx.async_eval`` of the step (MLX encoding and launching its
  kernels);
* ``wait``: ``mx.eval`` of the token before (waiting for the GPU);
* ``rest``: the rest of the step (reading the tokens back, bookkeeping);
* ``generator``: ``BatchGenerator.next`` outside the step (its responses,
  stop checks, the prompt queue);
* ``server``: the time from one ``next`` returning to the next one starting:
  the server's own work per token (detokenizing, the log-prob read, the
  queues) and whatever holds the generation thread up (the HTTP threads'
  turns with the interpreter lock).

The parts of one token sum to ``token``: one decode step as the server runs
it. Medians over the last ``KEEP`` steps of each B, written as JSON by
``write`` (the process's watcher calls it once a second).

Each prompt-processing call of the generator (``PromptProcessingBatch.prompt``:
one batch of prompts prefilled together; the calls with no prompt, which the
generator makes at every step, are not kept) is recorded too, the last
``KEEP_PREFILLS`` of them: when it began (wall clock, for the bench to find a
wave's), its rows and tokens, its seconds, and how much of them MLX's
``eval`` and ``async_eval`` took. Stock's prompt loop only calls ``eval``
(which launches a chunk's kernels and waits for them); lily's prefill pacing
launches each layer with ``async_eval`` and waits for the one before with
``eval``. The method wrapped is whatever the class holds when the server
first steps its generator, so lily's own patch of it (prefix reuse's
checkpoint recording) is inside the time. It wraps mlx-lm's
methods and MLX's two eval functions for the process, which only a bench
server runs; the wrappers add well under a microsecond a call.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections import defaultdict, deque
from typing import Any, Callable, Dict, List

PARTS = ("build", "launch", "wait", "rest", "generator", "server")
KEEP = 2000
KEEP_PREFILLS = 256

_samples: Dict[int, Dict[str, deque]] = defaultdict(lambda: {p: deque(maxlen=KEEP) for p in (*PARTS, "token")})
_prefills: deque = deque(maxlen=KEEP_PREFILLS)
_lock = threading.Lock()
_local = threading.local()


def _timed_eval(name: str, base: Callable) -> Callable:
    """MLX's eval function ``name``, timing its calls made inside a decode
    step (as the step's launch or wait) or a prefill call (by name)."""

    def call(*args: Any, **kwargs: Any):
        step = getattr(_local, "step", None)
        prefill = None if step is not None else getattr(_local, "prefill", None)
        if step is None and prefill is None:
            return base(*args, **kwargs)
        start = time.perf_counter()
        if step is not None and name == "async_eval" and "launch_at" not in step:
            step["launch_at"] = start
        try:
            return base(*args, **kwargs)
        finally:
            seconds = time.perf_counter() - start
            if step is not None:
                part = "launch" if name == "async_eval" else "wait"
                step[part] = step.get(part, 0.0) + seconds
            else:
                prefill[name] += seconds

    call.__name__ = name
    return call


def install() -> None:
    """Wrap ``GenerationBatch._step``, ``BatchGenerator.next``,
    ``PromptProcessingBatch.prompt`` and MLX's ``eval`` / ``async_eval``
    (once)."""
    import importlib

    import mlx.core as mx

    generate = importlib.import_module("mlx_lm.generate")  # the module (mlx_lm.generate is also a function)
    if getattr(generate.GenerationBatch._step, "_lily_split", False):
        return
    for name in ("eval", "async_eval"):
        setattr(mx, name, _timed_eval(name, getattr(mx, name)))
    base_step, base_next = generate.GenerationBatch._step, generate.BatchGenerator.next

    def _step(self, *args: Any, **kwargs: Any):
        _local.step = step = {"start": time.perf_counter()}
        try:
            return base_step(self, *args, **kwargs)
        finally:
            _local.step = None
            step["end"] = time.perf_counter()
            step["rows"] = len(self.uids)
            _local.last_step = step

    def next_(self, *args: Any, **kwargs: Any):
        _wrap_prompt(generate)
        start = time.perf_counter()
        _local.last_step = None
        try:
            return base_next(self, *args, **kwargs)
        finally:
            end = time.perf_counter()
            _record(_local.last_step, start, end, getattr(_local, "returned", None))
            _local.returned = end

    _step._lily_split = True
    generate.GenerationBatch._step = _step
    generate.BatchGenerator.next = next_
    _wrap_prompt(generate)


# The prompt wrappers made here: the outermost times a call, any inside it
# (one made before a later patch wrapped it in turn) passes through.
_PROMPT_WRAPPERS: set = set()


def _wrap_prompt(generate: Any) -> None:
    """Time ``PromptProcessingBatch.prompt`` as the class holds it now, unless
    that is already one of these wrappers: called at install and before
    each generator step, so a patch installed later (lily's backend loads
    after this module installs) is timed too."""
    base = generate.PromptProcessingBatch.prompt
    if base in _PROMPT_WRAPPERS:
        return

    def prompt(self, tokens: Any, *args: Any, **kwargs: Any):
        if not tokens or getattr(_local, "prefill", None) is not None:
            return base(self, tokens, *args, **kwargs)  # nothing to prefill, or timed outside
        record = {"at": time.time(), "rows": len(tokens), "tokens": sum(len(t) for t in tokens),
                  "eval": 0.0, "async_eval": 0.0}
        _local.prefill = record
        start = time.perf_counter()
        try:
            return base(self, tokens, *args, **kwargs)
        finally:
            _local.prefill = None
            record["seconds"] = time.perf_counter() - start
            with _lock:
                _prefills.append(record)

    _PROMPT_WRAPPERS.add(prompt)
    generate.PromptProcessingBatch.prompt = prompt


def _record(step: Any, start: float, end: float, previous_end: Any) -> None:
    """One ``next`` call that ran a decode step: its parts by the step's B."""
    if step is None:
        return
    launch_at = step.get("launch_at", step["end"])
    parts = {
        "build": launch_at - step["start"],
        "launch": step.get("launch", 0.0),
        "wait": step.get("wait", 0.0),
        "generator": (end - start) - (step["end"] - step["start"]),
        "server": start - previous_end if previous_end is not None else None,
    }
    parts["rest"] = (step["end"] - step["start"]) - parts["build"] - parts["launch"] - parts["wait"]
    if parts["server"] is None:  # the first step: no token before it
        return
    parts["token"] = sum(parts[p] for p in PARTS)
    with _lock:
        kept = _samples[step["rows"]]
        for part, seconds in parts.items():
            kept[part].append(seconds)


def summary() -> Dict[str, Dict[str, Any]]:
    """{B: {"steps": n, part: median ms, ...}} over the steps kept."""
    with _lock:
        return {
            str(rows): {"steps": len(kept["token"]),
                        **{part: round(1e3 * statistics.median(kept[part]), 4) for part in (*PARTS, "token")}}
            for rows, kept in sorted(_samples.items()) if kept["token"]
        }


def prefills() -> List[Dict[str, Any]]:
    """The prompt-processing calls kept: {at (wall clock s), rows, tokens, ms,
    wait_ms (in eval: stock's launches its chunk there too), launch_ms (in
    async_eval)}, oldest first."""
    with _lock:
        return [{"at": r["at"], "rows": r["rows"], "tokens": r["tokens"], "ms": round(1e3 * r["seconds"], 2),
                 "wait_ms": round(1e3 * r["eval"], 2), "launch_ms": round(1e3 * r["async_eval"], 2)}
                for r in _prefills]


def write(path: str) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump({"ms_by_batch": summary(), "prefills": prefills(), "at": time.time()}, f)
    os.replace(tmp, path)


# ------------------------------------------- mlx_lm.generate's own loop


class GenerateSplit:
    """``mlx_lm.generate``'s decode loop (``generate_step`` under
    ``stream_generate``) timed the way the server's steps are, for the
    generate check's process (``bench.serve.generate_worker``): per token,

    * ``build``: from the model's call to MLX's launch (the model's call,
      the log-softmax and the sampler);
    * ``launch``: ``mx.async_eval`` of the step;
    * ``other``: the rest of the token, from one launch's end to the next
      model call: the wait for the token before (``y.item()``), detokenizing
      and ``stream_generate``'s bookkeeping.

    ``with GenerateSplit(model) as split: ...`` wraps the model's class
    call and ``mx.async_eval`` while it is active; ``split.summary()`` gives
    the medians (ms) over the tokens after the first ``SKIP``."""

    SKIP = 4

    def __init__(self, model: Any):
        self._model_class = type(model)
        self._tokens: list = []

    def __enter__(self) -> "GenerateSplit":
        import mlx.core as mx

        self._mx = mx
        self._base_call = self._model_class.__call__
        self._base_async = mx.async_eval
        state: Dict[str, float] = {}
        self._state = state
        split = self

        def call(model_self, *args: Any, **kwargs: Any):
            state.setdefault("built_from", time.perf_counter())
            return split._base_call(model_self, *args, **kwargs)

        def async_eval(*args: Any, **kwargs: Any):
            start = time.perf_counter()
            try:
                return split._base_async(*args, **kwargs)
            finally:
                end = time.perf_counter()
                built_from = state.pop("built_from", None)
                previous_end = state.get("launched_at")
                if built_from is not None and previous_end is not None:
                    split._tokens.append({"build": start - built_from, "launch": end - start,
                                          "other": built_from - previous_end, "token": end - previous_end})
                state["launched_at"] = end

        self._model_class.__call__ = call
        mx.async_eval = async_eval
        return self

    def __exit__(self, *exc: Any) -> None:
        self._model_class.__call__ = self._base_call
        self._mx.async_eval = self._base_async

    def summary(self) -> Dict[str, Any]:
        kept = self._tokens[self.SKIP:]
        if not kept:
            return {}
        return {"steps": len(kept),
                **{part: round(1e3 * statistics.median(t[part] for t in kept), 4)
                   for part in ("build", "launch", "other", "token")}}
