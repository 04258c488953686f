"""``python -m bench --serve --multi-turn``: prompt-prefix reuse over an agent-style conversation.

Each engine (lily, stock) serves one conversation of ``--turns`` turns whose
history grows to ``--history-tokens`` tokens, the way ``mlx_lm.server``'s
batched path serves it, in this process: the prompt cache
(``LRUPromptCache``, ``--prompt-cache-size`` entries; lily's with its
checkpoints, ``mlx_lily.prefix_reuse``), the fetch, mlx-lm's
``BatchGenerator`` (``--prefill-step-size`` chunks), the insert of each
finished request. Every turn's prompt is the previous prompt, the previous
reply re-rendered differently after its first tokens (as chat templates drop
a reply's reasoning), and a new message; so the prompt diverges from the
cached tokens inside the previous reply, which stock's cache cannot reuse
past (its Gated DeltaNet states cannot be trimmed).

Per turn: the prompt's tokens, the tokens reused from the prompt cache, the
time to the first token with the cache (TTFT) and of a cold request of the
same prompt (a fresh cache, same generator), their ratio, whether the first
token's log-probabilities are the cold request's bit for bit, and the bytes
the prompt cache holds (lily: its checkpoints' distinct bytes). The
``multi_turn`` section of the serve JSON: per engine ``turns`` and the
summary ``ttft_ratio_median`` (follow-up turns), ``checkpoint_bytes_max``,
``outputs_identical``, ``tokens_reused``, ``first_at_length_s_median``.

Both timed requests of a follow-up turn find the decode step traced for
their length: before them an untimed cold request of the same prompt meets
its KV capacity first (lily traces its compiled step once per 1,024-token
capacity, whichever request comes first, cold or not). That request's TTFT
is kept (``first_cold_ttft_s``); its excess over the timed cold request's is
the cost of a length met for the first time (``first_at_length_s``).
"""

from __future__ import annotations

import gc
import os
import random
import statistics
import time
from typing import Any, Dict, List, Optional

KEY = ("bench", None, None)


def conversation(vocab: int, turns: int, history_tokens: int, reply_tokens: int, first_tokens: int,
                 seed: int = 0):
    """The new text of each turn (token lists): the first turn's prompt (an
    agent's system prompt, tools and task: ``first_tokens``), then messages
    (tool results, user turns) sized so that the last turn's prompt is about
    history_tokens."""
    rng = random.Random(seed)
    first = max(8, min(first_tokens, history_tokens))
    per_turn = max(8, (history_tokens - first) // max(1, turns - 1) - reply_tokens)
    messages = [[rng.randrange(4, vocab) for _ in range(first if t == 0 else per_turn)] for t in range(turns)]
    return messages, rng


def rerender(reply: List[int], keep: int, rng: random.Random, vocab: int) -> List[int]:
    """The reply as the next prompt shows it: its first ``keep`` tokens, then
    other tokens (the reasoning dropped, another rendering)."""
    return reply[:keep] + [rng.randrange(4, vocab) for _ in range(max(1, len(reply) - keep))]


class Phases:
    """Where one request's TTFT goes, from wall-clock stamps (no added
    synchronization: each prefill call of mlx-lm's batch generator already
    waits for its chunk, as lily's checkpoint recording does for its states):

    * ``fetch_s``: the prompt cache's fetch (lily: the checkpoint plan and the
      restored caches, still lazy);
    * ``prefill_s``: ``PromptProcessingBatch.prompt`` calls until the first
      token (``prefill_calls`` of them), lily's checkpoint recording included;
    * ``record_s``: of which the recording (``prefix_reuse.RECORDER``);
    * ``rest_s``: the rest of the TTFT: the generator's setup, the batch
      caches' merge, the first decode step (the prompt's last token), the
      first token's log-probabilities."""

    def __init__(self):
        self.times = {"fetch_s": 0.0, "prefill_s": 0.0, "record_s": 0.0, "prefill_calls": 0}
        self.open = True

    def __enter__(self) -> "Phases":
        import importlib

        from mlx_lily import prefix_reuse

        generate = importlib.import_module("mlx_lm.generate")
        self._cls, self._recorder = generate.PromptProcessingBatch, prefix_reuse.RECORDER
        base_prompt, base_record = self._cls.prompt, self._recorder.after_prompt
        phases = self

        def prompt(batch, tokens, *args, **kwargs):
            start = time.perf_counter()
            try:
                return base_prompt(batch, tokens, *args, **kwargs)
            finally:
                if phases.open:
                    phases.times["prefill_s"] += time.perf_counter() - start
                    phases.times["prefill_calls"] += any(tokens)  # the generator also calls it with no rows

        def after_prompt(*args, **kwargs):
            start = time.perf_counter()
            try:
                return base_record(*args, **kwargs)
            finally:
                if phases.open:
                    phases.times["record_s"] += time.perf_counter() - start

        self._base = base_prompt
        self._cls.prompt = prompt
        self._recorder.after_prompt = after_prompt
        return self

    def __exit__(self, *exc) -> None:
        self._cls.prompt = self._base
        self._recorder.__dict__.pop("after_prompt", None)

    def close(self, ttft: float) -> Dict[str, float]:
        """The phases of a TTFT of ``ttft`` s (later calls not counted)."""
        self.open = False
        t = self.times
        out = {k: (round(v, 5) if isinstance(v, float) else v) for k, v in t.items()}
        out["rest_s"] = round(ttft - t["fetch_s"] - t["prefill_s"], 5)
        return out


def request(model, lru, tokens: List[int], step: int, max_tokens: int):
    """One request as the server's batched path runs it; (reused tokens,
    TTFT s, first log-probs, generated tokens, the TTFT's phases). ``lru``
    None: a cold request."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    mx.synchronize()
    with Phases() as phases:
        start = time.perf_counter()
        cache, rest = (None, tokens) if lru is None else lru.fetch_nearest_cache(KEY, tokens)
        phases.times["fetch_s"] = time.perf_counter() - start
        reused = len(tokens) - len(rest)
        gen = BatchGenerator(model, prefill_step_size=step)
        gen.insert(prompts=[rest], max_tokens=[max_tokens], caches=[cache], all_tokens=[tokens[:reused]])
        ttft, first, out, split = None, None, [], None
        while True:
            _, responses = gen.next()
            for r in responses:
                if first is None:
                    mx.eval(r.logprobs)
                    ttft, first = time.perf_counter() - start, r.logprobs
                    split = phases.close(ttft)
                out.append(r.token)
                if r.finish_reason is not None:
                    if lru is not None:
                        lru.insert_cache(KEY, r.all_tokens[:], r.prompt_cache)
                    gen.close()
                    return reused, ttft, first, out, split


def run_engine(engine: str, model_path: str, args) -> Dict[str, Any]:
    import mlx.core as mx
    from mlx_lm.models.cache import LRUPromptCache

    import mlx_lily
    from mlx_lily import prefix_reuse

    model, _ = mlx_lily.load(model_path, backend=engine)
    if engine == "lily":
        os.environ[prefix_reuse.POLICY_ENV] = args.reuse_policy
        prefix_reuse.install()
    else:
        prefix_reuse.uninstall()
    vocab = int(model.language_model.model.embed_tokens.num_embeddings)
    first = args.first_turn_tokens if args.first_turn_tokens is not None else args.history_tokens // 2
    messages, rng = conversation(vocab, args.turns, args.history_tokens, args.reply_tokens, first, args.seed)
    lru = LRUPromptCache(max_size=args.prompt_cache_size)
    step = args.prefill_step_size
    # Warmup (not timed): a cold request of the first turn's length, and one
    # of the last's, so kernels and traces exist before anything is timed.
    request(model, None, messages[0], step, 2)
    request(model, None, sum(messages, [])[: args.history_tokens], step, 2)
    turns: List[Dict[str, Any]] = []
    history: List[int] = []
    try:
        for t, message in enumerate(messages):
            prompt = history + message
            if t > 0:  # untimed for the ratio: meets the prompt's length first (module docstring)
                _, first_cold_ttft, _, _, _ = request(model, None, prompt, step, 1)
            reused, ttft, first, reply, phases = request(model, lru, prompt, step, args.reply_tokens)
            row: Dict[str, Any] = {
                "turn": t + 1, "prompt_tokens": len(prompt), "tokens_reused": reused, "ttft_s": ttft,
                "phases": phases,
            }
            if t > 0:
                _, cold_ttft, cold_first, _, cold_phases = request(model, None, prompt, step, 1)
                row["cold_phases"] = cold_phases
                row["first_cold_ttft_s"] = first_cold_ttft
                row["first_at_length_s"] = first_cold_ttft - cold_ttft
                row["cold_ttft_s"] = cold_ttft
                row["ttft_ratio"] = ttft / cold_ttft if cold_ttft else None
                row["outputs_identical"] = bool(mx.array_equal(first, cold_first).item())
            row["prompt_cache_bytes"] = lru.nbytes
            row["checkpoint_bytes"] = prefix_reuse.checkpoint_bytes(lru)
            turns.append(row)
            print(f"[multi-turn] {engine} turn {t + 1}: {len(prompt)} tokens, {reused} reused, "
                  f"TTFT {ttft:.3f} s" + (f" (cold {row['cold_ttft_s']:.3f} s, identical "
                                          f"{row['outputs_identical']})" if t > 0 else ""), flush=True)
            history = prompt + rerender(reply, args.keep_reply_tokens, rng, vocab)
    finally:
        if engine == "lily":
            prefix_reuse.uninstall()
        del lru, model
        gc.collect()
        mx.clear_cache()
    follow = [r for r in turns if r["turn"] > 1]
    ratios = [r["ttft_ratio"] for r in follow if r.get("ttft_ratio") is not None]
    return {
        "turns": turns,
        "ttft_ratio_median": statistics.median(ratios) if ratios else None,
        "checkpoint_bytes_max": max((r["checkpoint_bytes"] for r in turns), default=0),
        "prompt_cache_bytes_max": max((r["prompt_cache_bytes"] for r in turns), default=0),
        "outputs_identical": all(r["outputs_identical"] for r in follow) if follow else None,
        "tokens_reused": sum(r["tokens_reused"] for r in follow),
        "first_at_length_s_median": statistics.median(r["first_at_length_s"] for r in follow) if follow else None,
        "prompt_tokens": sum(r["prompt_tokens"] for r in follow),
    }


def run(model_path: str, args) -> Dict[str, Any]:
    """The ``multi_turn`` section: settings and each engine's figures."""
    section: Dict[str, Any] = {
        "settings": {
            "turns": args.turns, "history_tokens": args.history_tokens, "reply_tokens": args.reply_tokens,
            "keep_reply_tokens": args.keep_reply_tokens, "prefill_step_size": args.prefill_step_size,
            "prompt_cache_size": args.prompt_cache_size, "seed": args.seed,
            "first_turn_tokens": args.first_turn_tokens if args.first_turn_tokens is not None
            else args.history_tokens // 2,
            "lily_reuse_policy": args.reuse_policy,
            "how": "mlx_lm.server's batched path in process: LRUPromptCache fetch, BatchGenerator, insert",
        },
    }
    for engine in args.engines:
        name = "stock" if engine == "mlx" else engine
        try:
            section[name] = run_engine(engine, model_path, args)
        except Exception as exc:  # recorded; the other engine still runs
            section[name] = {"error": f"{type(exc).__name__}: {exc}"}
    return section


def markdown(section: Dict[str, Any]) -> str:
    lines = ["## Multi-turn prefix reuse", "",
             "| engine | turn | prompt tokens | reused | TTFT s | cold TTFT s | ratio | identical | checkpoint MB "
             "| first cold TTFT s |",
             "|---|---:|---:|---:|---:|---:|---:|---|---:|---:|"]
    for name in ("lily", "stock"):
        result = section.get(name) or {}
        for r in result.get("turns", []):
            def f(x, d=3):
                return "" if x is None else f"{x:.{d}f}"
            lines.append(f"| {name} | {r['turn']} | {r['prompt_tokens']} | {r['tokens_reused']} | {f(r['ttft_s'])} | "
                         f"{f(r.get('cold_ttft_s'))} | {f(r.get('ttft_ratio'), 2)} | "
                         f"{r.get('outputs_identical', '')} | {r['checkpoint_bytes'] / 2**20:.1f} | "
                         f"{f(r.get('first_cold_ttft_s'))} |")
        if result.get("error"):
            lines.append(f"| {name} | error: {result['error']} |||||||")
    lines += ["", "Where each TTFT goes (ms; `Phases`): follow-up / cold request of the same prompt", "",
              "| engine | turn | fetch | prefill (calls) | of which recording | rest |", "|---|---:|---:|---:|---:|---:|"]
    for name in ("lily", "stock"):
        for r in (section.get(name) or {}).get("turns", []):
            pair = [p for p in (r.get("phases"), r.get("cold_phases")) if p]
            if not pair:
                continue

            def ms(key):
                return " / ".join(f"{1e3 * p[key]:.1f}" for p in pair)
            calls = " / ".join(str(p["prefill_calls"]) for p in pair)
            lines.append(f"| {name} | {r['turn']} | {ms('fetch_s')} | {ms('prefill_s')} ({calls}) | "
                         f"{ms('record_s')} | {ms('rest_s')} |")
    lines.append("")
    for name in ("lily", "stock"):
        result = section.get(name) or {}
        if "ttft_ratio_median" in result:
            lines.append(f"- {name}: follow-up TTFT / cold TTFT median {result['ttft_ratio_median']}, "
                         f"checkpoint bytes max {result['checkpoint_bytes_max']}, outputs identical "
                         f"{result['outputs_identical']}, tokens reused {result['tokens_reused']} of "
                         f"{result['prompt_tokens']}; a length met first: "
                         f"+{result['first_at_length_s_median']} s (median, cold)")
    return "\n".join(lines) + "\n"


def add_arguments(p) -> None:
    g = p.add_argument_group("--multi-turn (prompt-prefix reuse over a conversation)")
    g.add_argument("--multi-turn", action="store_true", help="run only the multi-turn conversation")
    g.add_argument("--turns", type=int, default=8, help="turns (default 8)")
    g.add_argument("--history-tokens", type=int, default=16384, help="the last turn's prompt, about (default 16384)")
    g.add_argument("--first-turn-tokens", type=int, default=None,
                   help="the first prompt (system prompt, tools, task), tokens (default: half the history)")
    g.add_argument("--reuse-policy", choices=("exact", "longest"), default="exact",
                   help="lily's MLX_LILY_PREFIX_REUSE for the run (default exact)")
    g.add_argument("--reply-tokens", type=int, default=64, help="tokens each reply generates (default 64)")
    g.add_argument("--keep-reply-tokens", type=int, default=8,
                   help="a reply's first tokens the next prompt keeps as generated (default 8)")
    g.add_argument("--prefill-step-size", type=int, default=2048, help="the server's prefill chunk (default 2048)")
    g.add_argument("--prompt-cache-size", type=int, default=10, help="the server's --prompt-cache-size (default 10)")


def main_section(model_path: str, args) -> Optional[Dict[str, Any]]:
    return run(model_path, args) if args.multi_turn else None
