"""Prompt-prefix reuse for the hybrid cache: Gated DeltaNet state checkpoints.

mlx-lm's server reuses a cached prompt only where it can trim the cache back
to the tokens a new prompt shares with it; a Gated DeltaNet layer's state
(``ArraysCache``) cannot be trimmed, so for ``qwen3_5_moe`` a follow-up that
diverges anywhere before the cached entry's end prefilled everything. Lily
keeps, with each prompt cache entry, the DeltaNet states at the prefill's
chunk boundaries (checkpoints), and a new request resumes from the last
checkpoint at or before its divergence, with the attention KV caches cut to
the same token. Design and rules: docs/prefix-reuse.md.

The pieces, each installed over mlx-lm's own classes by ``install()`` (the
lily backend does it when ``mlx_lm.server`` loads a model):

* ``PromptProcessingBatch.prompt`` (the batch generator's one prefill chunk
  per row): after stock's call, each row's DeltaNet states are recorded as a
  checkpoint at the row's position (``Recorder``), with the chunk ends that
  produced them (its cut history).
* ``LRUPromptCache.insert_cache``: an entry takes the checkpoints recorded for
  its tokens (its bytes count them, so ``--prompt-cache-bytes`` and the LRU
  bound them; they are evicted with it).
* ``LRUPromptCache.fetch_nearest_cache``: the longest usable prefix among the
  entries' checkpoints; without one, stock's answer.
* ``ResponseGenerator._tokenize``: the server's prompt segments, which are
  where a cold prefill of that prompt cuts (so which checkpoints give its bits).

Exactness: a checkpoint at token p is used (policy ``exact``, the default)
only where its cut history and the resumed prefill's chunk ends differ from a
cold prefill's only by cuts that change no bit (``prefill_cuts``), so the
resumed prefill gives the cold prefill's bits. Besides the chunk ends, the
recorder keeps the states after each call's last whole 64-token chunk
(``ask_piece_states``): a follow-up resumes at most 63 tokens before the
previous prompt's end.
"""

from __future__ import annotations

import importlib
import math
import os
import re
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, KVCache, LRUPromptCache

from ._notice import notice_once
from ._patches import Patches, program_module
from .prefill_cuts import cold_cuts, cuts_merge, exact_from, on_piece_grid  # noqa: F401 - cold_cuts re-exported

POLICY_ENV = "MLX_LILY_PREFIX_REUSE"
BUDGET_ENV = "MLX_LILY_CHECKPOINT_BYTES"
POLICIES = ("exact", "longest", "off")
# Per history (one prompt cache entry): 2 GiB holds 32 checkpoints of
# Qwen3.6-35B-A3B (30 layers x [32, 128, 128] fp32 + conv state, ~64.5 MB
# each), a 32K history at the server's 2048-token chunks in 16.
DEFAULT_BUDGET = 2 << 30
# Rows the recorder follows at once (rows removed before they finish are
# forgotten after this many newer ones).
MAX_ROWS = 64


OFF_VALUES = ("0", "false", "no")
EXACT_VALUES = ("1", "true", "yes", "on")


def policy() -> str:
    """``MLX_LILY_PREFIX_REUSE``: exact (default), longest or off (also 0,
    false, no; 1, true, yes and on mean exact). Any other value is named in
    one notice and runs as exact."""
    raw = os.environ.get(POLICY_ENV)
    value = (raw or "").strip().lower()
    if value in OFF_VALUES:
        return "off"
    if value in POLICIES:
        return value
    if value and value not in EXACT_VALUES:
        notice_once(f"prefix-policy:{raw}", f"{POLICY_ENV}={raw!r} is not a policy (accepted: "
                                            f"{', '.join(POLICIES)}; 0/false/no for off); using exact")
    return "exact"


_SIZE = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(E[+-]?\d+)?\s*([KMGT]?)I?B?")
_SCALE = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str) -> int:
    """A byte count: 2147483648, 512M, 1.5G, 2GiB, 2 GB (binary units); a
    negative, non-finite or unreadable value raises ValueError."""
    found = _SIZE.fullmatch(text.strip().upper())
    if found is None:
        raise ValueError(f"not a size: {text!r}")
    value = float(found.group(1) + (found.group(2) or "")) * _SCALE[found.group(3)]
    if not math.isfinite(value):
        raise ValueError(f"not a finite size: {text!r}")
    return int(value)


def budget() -> int:
    """Checkpoint bytes one history keeps (``MLX_LILY_CHECKPOINT_BYTES``, e.g.
    2G; 0 keeps none). A value that is not a size is named in one notice and
    the default (2 GiB) is used."""
    raw = os.environ.get(BUDGET_ENV)
    if raw is None or not raw.strip():
        return DEFAULT_BUDGET
    try:
        return parse_bytes(raw)
    except ValueError:
        notice_once(f"checkpoint-budget:{raw}", f"{BUDGET_ENV}={raw!r} is not a size (a byte count such "
                                                "as 2147483648, 512M or 2G); using 2G")
        return DEFAULT_BUDGET


# ------------------------------------------------------------------ checkpoints


@dataclass
class Checkpoint:
    """The DeltaNet states of one row after its first ``position`` tokens.

    ``cuts``: the chunk ends of the prefill that produced them, from token 0
    up to ``position`` (None where unknown: a row resumed from a cache lily
    did not hand out, or prefilled with other rows in one padded call);
    ``step``: that prefill's chunk size. ``states``: layer index -> the
    layer's ArraysCache arrays (conv, recurrent), one row each."""

    position: int
    cuts: Optional[Tuple[int, ...]]
    step: int
    states: Dict[int, Tuple[mx.array, ...]]
    nbytes: int = 0

    def __post_init__(self):
        if not self.nbytes:
            self.nbytes = sum(a.nbytes for arrays in self.states.values() for a in arrays if a is not None)


def thin(checkpoints: List[Checkpoint], limit: int) -> List[Checkpoint]:
    """Drop checkpoints until their bytes fit ``limit``: the latest is kept;
    first those of unknown history, then those off the chunk grid (a prompt's
    end: exact only for a prompt cut there too), then the one whose removal
    leaves the smallest gap, so the rest stay about evenly spaced."""
    kept = sorted(checkpoints, key=lambda c: c.position)
    total = sum(c.nbytes for c in kept)
    merge = cuts_merge()
    while total > limit and len(kept) > 1:
        unknown = [i for i, c in enumerate(kept[:-1]) if c.cuts is None]
        off_grid = [i for i, c in enumerate(kept[:-1]) if merge and not on_piece_grid(c.cuts)]
        if unknown:
            i = unknown[0]
        elif off_grid:
            i = off_grid[0]
        else:
            def gap(i: int) -> int:
                before = kept[i - 1].position if i > 0 else 0
                return kept[i + 1].position - before
            i = min(range(len(kept) - 1), key=gap)
        total -= kept.pop(i).nbytes
    if total > limit and kept:
        kept = []
    return kept


def _row_copy(a: Optional[mx.array], i: int) -> Optional[mx.array]:
    """Row i of a batch state as an array of its own (a slice would keep the
    whole batch's buffer alive, and a cache may write into its arrays in
    place); ``* 1`` keeps every bit, signed zeros too."""
    if a is None:
        return None
    return a[i:i + 1] * mx.array(1, dtype=a.dtype)


@dataclass
class _RowLog:
    tokens: list  # the batch generator's token list of the row (grows in place)
    position: int
    cuts: Optional[Tuple[int, ...]]
    checkpoints: List[Checkpoint] = field(default_factory=list)


@dataclass
class _Handed:
    tokens: List[int]
    cuts: Optional[Tuple[int, ...]]
    checkpoints: List[Checkpoint]


class Recorder:
    """Checkpoints of the rows the batch generator is prefilling, until their
    prompt cache entries take them."""

    def __init__(self):
        self.rows: "OrderedDict[int, _RowLog]" = OrderedDict()
        self.handed: deque = deque(maxlen=8)

    def clear(self) -> None:
        self.rows.clear()
        self.handed.clear()

    def hand_out(self, tokens: List[int], cuts, checkpoints: List[Checkpoint]) -> None:
        """A cache lily restored for tokens[:p]: the row that resumes from it
        starts with these checkpoints and this cut history."""
        self.handed.append(_Handed(list(tokens), cuts, list(checkpoints)))

    def _start(self, tokens: list, start: int) -> _RowLog:
        if start == 0:
            return _RowLog(tokens, 0, ())
        for handed in reversed(self.handed):
            if len(handed.tokens) == start and tokens[:start] == handed.tokens:
                self.handed.remove(handed)
                return _RowLog(tokens, start, handed.cuts, list(handed.checkpoints))
        return _RowLog(tokens, start, None)

    def after_prompt(self, batch: Any, starts: List[int], chunks: List[List[int]]) -> None:
        """Record each row's states after one prefill chunk of ``batch`` (a
        PromptProcessingBatch)."""
        model = batch.model
        if not type(model).__module__.startswith("mlx_lily"):
            return
        from .layers.prompt_rows import rows_enabled

        rows = len(batch.uids)
        alone = rows == 1 or rows_enabled()
        linear = [i for i, c in enumerate(batch.prompt_cache) if type(c) is ArraysCache]
        if not linear:
            return
        step = int(batch.prefill_step_size)
        limit = budget()
        fresh = []
        for i, tokens in enumerate(batch.tokens):
            if i >= len(chunks) or not chunks[i]:
                continue
            log = self.rows.get(id(tokens))
            if log is None or log.tokens is not tokens or log.position != starts[i]:
                log = self._start(tokens, starts[i])
                self.rows[id(tokens)] = log
            self.rows.move_to_end(id(tokens))
            position = len(tokens)
            before = log.cuts if alone else None
            piece = take_piece_states(batch.prompt_cache, linear, i)
            if piece is not None and before is not None:
                # The states after the call's last whole chunk: as if the
                # call had been cut there (prefill_cuts).
                at = starts[i] + piece[0]
                fresh += [a for arrays in piece[1].values() for a in arrays]
                log.checkpoints.append(Checkpoint(at, before + (at,), step, piece[1]))
            log.cuts = before + (position,) if before is not None else None
            log.position = position
            states = {j: tuple(_row_copy(a, i) for a in batch.prompt_cache[j].cache) for j in linear}
            if any(a is None for arrays in states.values() for a in arrays):
                continue
            fresh += [a for arrays in states.values() for a in arrays]
            log.checkpoints.append(Checkpoint(position, log.cuts, step, states))
            log.checkpoints = thin(log.checkpoints, limit)
        if fresh:
            mx.eval(fresh)
        while len(self.rows) > MAX_ROWS:
            self.rows.popitem(last=False)

    def claim(self, tokens: List[int]) -> List[Checkpoint]:
        """The checkpoints recorded for a prefix of ``tokens`` (a prompt cache
        entry's). A row's entry made after its prefill (its tokens past the
        last checkpoint: generated tokens) takes the row's log with it."""
        for key in reversed(list(self.rows)):
            log = self.rows[key]
            cks = [c for c in log.checkpoints if c.position <= len(tokens)]
            if not cks:
                continue
            last = cks[-1].position
            if tokens[:last] != log.tokens[:last]:
                continue
            if len(tokens) > log.position:
                del self.rows[key]
            return cks
        return []


RECORDER = Recorder()


def ask_piece_states(caches: Sequence[Any], on: bool) -> None:
    """Ask lily's DeltaNet layers to keep the states after each call's last
    whole chunk on these caches (``on``), or stop asking and drop what they
    kept (``layers/gated_deltanet.wants_piece_state``)."""
    for c in caches:
        if type(c) is ArraysCache:
            if on:
                c.lily_capture = True
            else:
                for name in ("lily_capture", "lily_piece_state", "lily_piece_states"):
                    c.__dict__.pop(name, None)


def take_piece_states(caches: Sequence[Any], linear: Sequence[int], row: Optional[int] = None):
    """(position in the call, {layer: (conv rows, recurrent state)}) that the
    last call kept for batch row ``row`` (None: a one-row cache's own), if
    every DeltaNet layer kept them at one position; else None."""
    found: Dict[int, Tuple[mx.array, ...]] = {}
    cuts = set()
    for j in linear:
        c = caches[j]
        per_row = c.__dict__.get("lily_piece_states")  # prompt_rows' calls, one per row
        if row is not None and per_row is not None:
            kept = per_row[row] if row < len(per_row) else None
        else:  # the call on the whole cache
            kept = c.__dict__.get("lily_piece_state")
            if kept is not None and row is not None:
                kept = (kept[0], _row_copy(kept[1], row), _row_copy(kept[2], row))
        if kept is None:
            return None
        cuts.add(kept[0])
        found[j] = (kept[1], kept[2])
    return (cuts.pop(), found) if len(cuts) == 1 and found else None


# ------------------------------------------------------------------ the prompt cache


def _entries(prompt_cache: LRUPromptCache, model: Any, tokens: List[int]):
    """(common prefix length, entry, on the path) for each entry that shares
    a prefix with tokens: those on the tokens' path (their whole length) and
    those below the deepest node reached (that node's depth)."""
    root = prompt_cache._trie._trie.get(model)
    if root is None:
        return []
    found, node, depth = [], root, 0
    while depth < len(tokens) and tokens[depth] in node:
        node = node[tokens[depth]]
        depth += 1
        if "__value__" in node:
            found.append((depth, node["__value__"], True))
    if depth == 0:
        return found
    stack = [(node, True)]
    while stack:
        current, top = stack.pop()
        for key, child in current.items():
            if key == "__value__":
                if not top:
                    found.append((depth, child, False))
            else:
                stack.append((child, False))
    return found


def _restore(entry: Any, ck: Checkpoint) -> Optional[List[Any]]:
    """The entry's caches at ``ck``: KV caches cut to its position, DeltaNet
    caches holding its states; None where the entry's caches are not the
    kinds lily restores."""
    p = ck.position
    out = []
    for i, c in enumerate(entry.prompt_cache):
        if i in ck.states:
            if type(c) is not ArraysCache:
                return None
            fresh = ArraysCache(len(ck.states[i]))
            fresh.cache = list(ck.states[i])
            out.append(fresh)
        elif type(c) is KVCache:
            if c.keys is None or c.offset < p:
                return None
            fresh = KVCache()
            fresh.state = (c.keys[..., :p, :], c.values[..., :p, :], p)
            out.append(fresh)
        else:
            return None
    return out


@dataclass
class Plan:
    """What fetch chose: reuse up to ``position`` from ``checkpoint`` of ``entry``."""

    position: int
    checkpoint: Checkpoint
    entry: Any
    exact: bool


def plan(prompt_cache: LRUPromptCache, model: Any, tokens: List[int],
         segments: Optional[Sequence[int]] = None, mode: Optional[str] = None) -> Optional[Plan]:
    """The checkpoint a request for ``tokens`` resumes from, or None: the
    latest at or before the divergence from a cached entry and before the
    prompt's last token; under ``exact`` only one from which the resumed
    prefill has a cold prefill's bits (``prefill_cuts.exact_from``)."""
    mode = mode or policy()
    limit = len(tokens) - 1
    merge = cuts_merge()
    best: Optional[Plan] = None
    for common, entry, _ in _entries(prompt_cache, model, tokens):
        for ck in getattr(entry, "lily_checkpoints", ()):
            p = ck.position
            if p > min(common, limit) or p <= 0 or (best is not None and p <= best.position):
                continue
            exact = exact_from(ck.cuts, p, len(tokens), segments, ck.step, merge)
            if mode == "exact" and not exact:
                continue
            best = Plan(p, ck, entry, exact)
    return best


def _noted_segments(prompt_cache: LRUPromptCache, tokens: List[int]) -> Optional[List[int]]:
    noted = prompt_cache.__dict__.get("_lily_segments")
    if noted is not None and noted[0] is tokens:
        return noted[1]
    return None


def fetch_nearest_cache(self: LRUPromptCache, model: Any, tokens: List[int]):
    """``LRUPromptCache.fetch_nearest_cache`` with checkpoints (module docstring)."""
    mode = policy()
    if mode == "off":
        return _ORIGINAL["fetch"](self, model, tokens)
    chosen = plan(self, model, tokens, _noted_segments(self, tokens), mode)
    if chosen is not None and mode == "longest":
        # Stock's own answer reuses its longest entry on the prompt's path.
        stock_len = max((common for common, _, on_path in _entries(self, model, tokens) if on_path), default=0)
        if stock_len >= chosen.position:
            chosen = None
    cache = _restore(chosen.entry, chosen.checkpoint) if chosen is not None else None
    if cache is None:
        return _ORIGINAL["fetch"](self, model, tokens)
    p = chosen.position
    inherited = [c for c in chosen.entry.lily_checkpoints if c.position <= p]
    RECORDER.hand_out(tokens[:p], chosen.checkpoint.cuts if chosen.exact else None, inherited)
    self.__dict__["lily_last_reuse"] = {"tokens": p, "exact": chosen.exact}
    return cache, tokens[p:]


def insert_cache(self: LRUPromptCache, model: Any, tokens: List[int], prompt_cache: List[Any], *,
                 cache_type: str = "assistant"):
    """``LRUPromptCache.insert_cache``; the entry also takes the checkpoints
    recorded for its tokens, and counts their bytes."""
    _ORIGINAL["insert"](self, model, tokens, prompt_cache, cache_type=cache_type)
    if policy() == "off":
        return
    cks = RECORDER.claim(tokens)
    if not cks:
        return
    try:
        entry = self._trie.get(model, tokens)
    except KeyError:  # already evicted by the bounds
        return
    if entry.prompt_cache is not prompt_cache:
        return
    extra = sum(c.nbytes for c in cks)
    entry.lily_checkpoints = cks
    entry.nbytes += extra
    self._n_bytes += extra
    self._n_bytes_by_type[entry.cache_type] += extra
    while self._n_bytes > self.max_bytes and len(self._lru) > 0:
        old_model, old_tokens = self._lru.pop()
        old = self._trie.pop(old_model, old_tokens)
        self._n_bytes -= old.nbytes
        self._n_bytes_by_type[old.cache_type] -= old.nbytes


def checkpoint_bytes(prompt_cache: LRUPromptCache) -> int:
    """Bytes of the distinct checkpoint states held by the prompt cache's entries."""
    seen, total = set(), 0
    stack = list(prompt_cache._trie._trie.values())
    while stack:
        node = stack.pop()
        for key, child in node.items():
            if key == "__value__":
                for ck in getattr(child, "lily_checkpoints", ()):
                    for arrays in ck.states.values():
                        for a in arrays:
                            if id(a) not in seen:
                                seen.add(id(a))
                                total += a.nbytes
            else:
                stack.append(child)
    return total


# ------------------------------------------------------------------ install


_stock = Patches()
# mlx-lm's own methods, which the installed ones call.
_ORIGINAL = {"fetch": LRUPromptCache.fetch_nearest_cache, "insert": LRUPromptCache.insert_cache}


def _prompt(self, tokens):
    starts = [len(t) for t in self.tokens]
    recording = policy() != "off"
    # Checkpoints inside a call are exact only where chunk-aligned cuts change no bit.
    ask = recording and cuts_merge() and type(self.model).__module__.startswith("mlx_lily")
    if ask:
        ask_piece_states(self.prompt_cache, True)
    try:
        _stock["prompt"](self, tokens)
        if recording:
            try:
                RECORDER.after_prompt(self, starts, tokens)
            except Exception as exc:  # noqa: BLE001 - checkpoints are an optimization only
                notice_once("checkpoint-record", f"recording prefix checkpoints failed ({type(exc).__name__}: "
                                                 f"{exc}); prompts are served without them")
                RECORDER.clear()
    finally:
        if ask:
            ask_piece_states(self.prompt_cache, False)


def _tokenize(self, tokenizer, request, args):
    out = _stock["tokenize"](self, tokenizer, request, args)
    try:
        self.prompt_cache.__dict__["_lily_segments"] = (out[0], [len(s) for s in out[1]])
    except Exception:  # noqa: BLE001 - without segments the prompt counts as one
        pass
    return out


def install() -> None:
    """Install checkpoint recording and reuse over mlx-lm's batch generator,
    prompt cache and server (idempotent)."""
    if _stock:
        return
    gen = importlib.import_module("mlx_lm.generate")

    _stock.set("prompt", gen.PromptProcessingBatch, "prompt", _prompt)
    _stock.set("fetch", LRUPromptCache, "fetch_nearest_cache", fetch_nearest_cache)
    _stock.set("insert", LRUPromptCache, "insert_cache", insert_cache)
    try:
        server = program_module("mlx_lm.server")

        _stock.set("tokenize", server.ResponseGenerator, "_tokenize", _tokenize)
    except (ImportError, AttributeError):
        pass


def uninstall() -> None:
    if not _stock:
        return
    _stock.undo()
    RECORDER.clear()


def installed() -> bool:
    return bool(_stock)


def add_entry(prompt_cache: LRUPromptCache, model_key: Any, tokens: List[int], cache: List[Any],
              checkpoints: List[Checkpoint], cache_type: str = "assistant") -> None:
    """Insert an entry with its checkpoints (a loaded file's)."""
    RECORDER.rows[-1] = _RowLog(list(tokens), len(tokens) + 1, None, list(checkpoints))
    try:
        insert_cache(prompt_cache, model_key, list(tokens), cache, cache_type=cache_type)
    finally:
        RECORDER.rows.pop(-1, None)


def entry_checkpoints(prompt_cache: LRUPromptCache, model_key: Any, tokens: List[int]) -> List[Checkpoint]:
    """The checkpoints the entry for exactly ``tokens`` holds ([] if none)."""
    try:
        return list(getattr(prompt_cache._trie.get(model_key, tokens), "lily_checkpoints", ()))
    except KeyError:
        return []
