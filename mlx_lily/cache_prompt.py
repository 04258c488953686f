"""``mlx_lm.cache_prompt`` and ``mlx_lm.generate --prompt-cache-file`` on lily.

* ``python -m mlx_lily cache-prompt`` (or ``mlx_lm.cache_prompt --backend
  lily``) is mlx-lm's command, every flag unchanged: the same prefill
  (``generate_step``), the same file. On lily the file also carries the
  prompt's tokens, the model's fingerprint and the DeltaNet checkpoints at
  the prefill's chunk ends (``prefix_files.save_cache_file``), so a prompt
  cache entry made from it resumes a request that diverges inside the cached
  prompt. ``--prefill-step-size N`` (lily's command only; default 2048, as
  ``generate_step`` and ``mlx_lm.server``) sets the chunks, and so where the
  checkpoints fall: use the server's value.
* ``mlx_lm.generate --prompt-cache-file F`` on lily continues from F as stock
  does; before it does, F is checked against the loaded model
  (``prefix_files.check_file``) and a file of another model or format is
  refused in one line.

The lily backend calls ``model_loaded`` when mlx-lm's loader returns a model
in one of these programs. Design: docs/prefix-reuse.md.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from typing import Any, List, Optional

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from . import prefix_files, prefix_reuse
from ._patches import Patches, program_module
from .prefix_reuse import Checkpoint

DEFAULT_STEP = 2048
STEP_FLAG = "--prefill-step-size"

_settings = {"step": DEFAULT_STEP}
_stock = Patches()


def take_step_flag(argv: List[str]) -> None:
    """Remove ``--prefill-step-size N`` / ``=N`` from argv (in place) and keep
    N for the prefill (mlx_lm.cache_prompt's parser does not know the flag)."""
    _settings["step"] = DEFAULT_STEP
    for i, arg in enumerate(argv):
        value = None
        if arg == STEP_FLAG and i + 1 < len(argv):
            value, end = argv[i + 1], i + 2
        elif arg.startswith(STEP_FLAG + "="):
            value, end = arg.split("=", 1)[1], i + 1
        if value is not None:
            if not value.isdigit() or int(value) < 1:
                raise prefix_files.PromptCacheFileError(f"{STEP_FLAG} takes a positive number of tokens, "
                                                        f"not {value!r}")
            _settings["step"] = int(value)
            del argv[i:end]
            return


@dataclass
class Recording:
    """The prefill of one ``generate_step`` call on a lily model: its tokens
    and a checkpoint after every prefill chunk (not after the last token,
    which is the first decode step)."""

    model: Any
    tokens: List[int]
    step: int
    cache: Any = None
    checkpoints: List[Checkpoint] = field(default_factory=list)
    position: int = 0

    cuts: tuple = ()

    def after_call(self, n: int, cache: List[Any]) -> None:
        start = self.position
        self.position += n
        linear = [j for j, c in enumerate(cache) if type(c) is ArraysCache]
        piece = prefix_reuse.take_piece_states(cache, linear)
        if self.position >= len(self.tokens):
            return
        if piece is not None:  # the states after the call's last whole chunk
            at = start + piece[0]
            mx.eval([a for arrays in piece[1].values() for a in arrays])
            self.checkpoints.append(Checkpoint(at, self.cuts + (at,), self.step, piece[1]))
        self.cuts += (self.position,)
        states = {j: tuple(prefix_reuse._row_copy(a, 0) for a in cache[j].cache) for j in linear
                  if all(a is not None for a in cache[j].cache)}
        if not states:
            return
        mx.eval([a for arrays in states.values() for a in arrays])
        self.checkpoints.append(Checkpoint(self.position, self.cuts, self.step, states))
        self.checkpoints = prefix_reuse.thin(self.checkpoints, prefix_reuse.budget())


class _Recorded:
    """The model as ``generate_step`` calls it, recording after each call."""

    def __init__(self, model: Any, recording: Recording):
        self._model, self._recording = model, recording

    def __call__(self, inputs, cache=None, **kwargs):
        ask = cache is not None and prefix_reuse.cuts_merge()
        if ask:
            prefix_reuse.ask_piece_states(cache, True)
        try:
            out = self._model(inputs, cache=cache, **kwargs)
            if cache is not None:
                self._recording.cache = cache
                self._recording.after_call(int(inputs.shape[1]), cache)
        finally:
            if ask:
                prefix_reuse.ask_piece_states(cache, False)
        return out

    def __getattr__(self, name):
        return getattr(self._model, name)


_last: dict = {}


def _generate_step(prompt, model, *args, **kwargs):
    """mlx_lm.cache_prompt's generate_step, recording the prefill's checkpoints."""
    step = kwargs.setdefault("prefill_step_size", _settings["step"])
    recording = Recording(model, [int(t) for t in prompt.tolist()], int(step))
    _last["recording"] = recording
    return _stock["generate_step"](prompt, _Recorded(model, recording), *args, **kwargs)


def _save_prompt_cache(file_name, cache, metadata=None):
    """mlx_lm.cache_prompt's save_prompt_cache: lily's file (its tokens,
    fingerprint and checkpoints in mlx-lm's layout) for the cache it recorded."""
    recording: Optional[Recording] = _last.pop("recording", None)
    if recording is None or recording.cache is not cache:
        return _stock["save_prompt_cache"](file_name, cache, metadata)
    prefix_files.save_cache_file(file_name, recording.model, recording.tokens, cache, recording.checkpoints,
                                 metadata)
    print(f"[mlx-lily] {len(recording.checkpoints)} DeltaNet checkpoints saved with the cache "
          f"(every {recording.step} tokens)", file=sys.stderr)


def install_cache_prompt() -> None:
    """Record and save checkpoints in mlx_lm.cache_prompt (idempotent)."""
    if _stock:
        return
    module = program_module("mlx_lm.cache_prompt")  # at model load: the program's own module
    _stock.set("generate_step", module, "generate_step", _generate_step)
    _stock.set("save_prompt_cache", module, "save_prompt_cache", _save_prompt_cache)


def uninstall() -> None:
    _settings.pop("checked", None)
    if not _stock:
        return
    _stock.undo()
    _last.clear()



def prompt_cache_file(argv: List[str]) -> Optional[str]:
    """``mlx_lm.generate``'s --prompt-cache-file in argv (its own parser: the
    same abbreviations), or None."""
    if any(arg in ("-h", "--help") for arg in argv):
        return None
    generate = importlib.import_module("mlx_lm.generate")
    try:
        args, _ = generate.setup_arg_parser().parse_known_args(argv)
    except SystemExit:  # the program's own parser reports it
        return None
    return getattr(args, "prompt_cache_file", None)


def check_before_generating(argv: List[str]) -> None:
    """For ``python -m mlx_lily generate``: refuse, in one line, a
    --prompt-cache-file that is not a prompt cache file before mlx-lm's
    loader fails on it (the model check follows at load)."""
    _settings.pop("checked", None)  # a new run: its first load is checked
    path = prompt_cache_file(argv)
    if path is not None:
        prefix_files.read_header(path)


def model_loaded(program: Optional[str], model: Any) -> None:
    """What the lily backend does when mlx-lm's loader returns ``model`` in
    ``program``: check generate's --prompt-cache-file against it; make
    cache_prompt record and save checkpoints."""
    if program == "mlx_lm.generate":
        # The first model is the one the file continues; a --draft-model
        # loads after it and keeps its own (empty) cache.
        if _settings.get("checked"):
            return
        _settings["checked"] = True
        path = prompt_cache_file(sys.argv[1:])
        if path is not None:
            prefix_files.check_file(path, model)
    elif program == "mlx_lm.cache_prompt":
        install_cache_prompt()
