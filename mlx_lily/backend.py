"""Make mlx-lm's own loader build lily's model classes.

mlx-lm has no plugin mechanism. Every loader in ``mlx_lm.utils`` (``load``,
``sharded_load``, ``pipeline_load``) calls the module-level ``load_model``,
which takes a ``get_model_classes`` argument. ``enable()`` replaces
``mlx_lm.utils.load_model`` with a wrapper that passes lily's class resolver;
``disable()`` puts the original back. Model types lily does not specialize
resolve to stock classes, after one notice.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from typing import Any, Iterator

import mlx_lm.utils as mlx_utils

from . import trimmable_cache, warmup
from ._notice import notice_once
from .errors import LilyError
from .models import SPECIALIZED

BACKENDS = ("lily", "mlx")

_stock_load_model = mlx_utils.load_model


def resolve_classes(config: dict):
    """mlx-lm's class resolution, with lily's classes for the types it specializes."""
    model_class, args_class = mlx_utils._get_classes(config)
    model_type = model_class.__module__.rsplit(".", 1)[-1]
    if model_type in SPECIALIZED:
        lily = importlib.import_module(SPECIALIZED[model_type])
        notice_once(f"lily:{model_type}", f"backend lily: {model_type} runs on lily's model")
        return lily.Model, lily.ModelArgs
    notice_once(
        f"stock:{model_type}",
        f"backend lily does not specialize model type {config.get('model_type')!r}; "
        "running stock mlx-lm",
    )
    return model_class, args_class


@functools.wraps(_stock_load_model)
def _lily_load_model(model_path, *args: Any, **kwargs: Any):
    # load_model(model_path, lazy, strict, model_config, get_model_classes, ...)
    if len(args) < 4:
        kwargs.setdefault("get_model_classes", resolve_classes)
    loaded = _stock_load_model(model_path, *args, **kwargs)
    lazy = args[0] if args else kwargs.get("lazy", False)
    program = current_program()
    if program == "mlx_lm.server":
        # Prompt-prefix reuse with DeltaNet checkpoints (docs/prefix-reuse.md).
        from . import prefix_reuse

        prefix_reuse.install()
        # Each token's log-prob read off the decode stream (served_logprobs.py).
        from . import served_logprobs

        served_logprobs.install()
        if type(loaded[0]).__module__.startswith("mlx_lily"):
            # Requests that arrive while it decodes join after the current
            # step, not after a half-second round (server_admission.py).
            from . import server_admission

            server_admission.install()
    if program == "mlx_lm.generate":
        # The speculative loop (--draft-model) of the program's own module:
        # ``enable`` wrapped the imported one, a second copy where the
        # program runs as ``python -m mlx_lm.generate`` (its ``__main__``).
        from ._patches import program_module

        trimmable_cache.install(program_module("mlx_lm.generate"))
    if program in ("mlx_lm.generate", "mlx_lm.cache_prompt"):
        # Prompt cache files: checked against the model; written with checkpoints.
        from . import cache_prompt

        cache_prompt.model_loaded(program, loaded[0])
    from . import mtp_cli  # --mtp: drafting with the MTP head (docs/speculative.md)

    mtp_cli.loaded(loaded[0], model_path, program)
    if not lazy and warmup.requested(program):
        # A lazy load (sharded and pipeline loads) has no weights yet.
        _prime_quietly(loaded[0], server=program == "mlx_lm.server")
    return loaded


def _prime_quietly(model, server: bool) -> None:
    """Prime the kernels (``mlx_lily.warmup``); a failure there is a notice,
    and the kernels then build at their first use as they would anyway."""
    try:
        warmup.prime(model, server=server)
    except Exception as exc:  # noqa: BLE001 - priming is an optimization only
        notice_once("prime-failed", f"priming the kernels failed ({type(exc).__name__}: {exc}); "
                                    "each kernel builds at its first use instead")


def check_checkpoint(path_or_hf_repo: str, *, revision=None, trust_remote_code: bool = False) -> None:
    """Raise lily's CheckpointError where lily would refuse this checkpoint.

    The checks are the load's own (lily's model classes check config.json,
    then the tensors against it), run on a lazy load: the model is built and
    the tensors' headers read, no weight is evaluated. A Hugging Face repo id
    is resolved as mlx-lm resolves it (downloaded if not in the cache). Any
    other failure is left to the real load that follows, which reports it as
    stock mlx-lm does.
    """
    try:
        path = mlx_utils._download(path_or_hf_repo, revision=revision)
        _stock_load_model(path, lazy=True, get_model_classes=resolve_classes,
                          trust_remote_code=trust_remote_code)
    except LilyError:
        raise
    except Exception:  # noqa: BLE001 - not lily's to report: the load says it
        return


def check_before_serving(argv) -> None:
    """For mlx_lm.server with lily: check the checkpoints its flags name
    (``--model``, ``--draft-model``) before it serves, raising lily's
    CheckpointError. The server loads its model in its generation thread
    while already answering, so a refusal there leaves a server answering
    every request with an error. Also, before its socket listens: a queue
    for a burst of connections (``server_admission.install_backlog``), and
    whether the command line sets the prefill batch
    (``server_admission.read_command_line``)."""
    import argparse

    from . import server_admission

    server_admission.install_backlog()
    server_admission.read_command_line(argv)

    if any(arg in ("-h", "--help") for arg in argv):
        return
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model")
    parser.add_argument("--draft-model")
    parser.add_argument("--trust-remote-code", action="store_true")
    try:
        args, _ = parser.parse_known_args(argv)
    except SystemExit:  # malformed flags: the server's own parser says how
        return
    for model in (args.model, args.draft_model):
        if model:
            check_checkpoint(model, trust_remote_code=args.trust_remote_code)


def enable() -> None:
    """Make mlx-lm's loaders build lily's classes (in this process), and
    mlx-lm's speculative loop (``--draft-model``) run on lily's models
    (``trimmable_cache.install``: it passes other models through, so it
    stays installed after ``disable``)."""
    mlx_utils.load_model = _lily_load_model
    trimmable_cache.install()


def disable() -> None:
    """Give mlx-lm its stock loader back (and its stock prompt cache)."""
    mlx_utils.load_model = _stock_load_model
    prefix_reuse = sys.modules.get("mlx_lily.prefix_reuse")
    if prefix_reuse is not None:
        prefix_reuse.uninstall()
    cache_prompt = sys.modules.get("mlx_lily.cache_prompt")
    if cache_prompt is not None:
        cache_prompt.uninstall()


def is_enabled() -> bool:
    return mlx_utils.load_model is _lily_load_model


@contextlib.contextmanager
def using(backend: str) -> Iterator[None]:
    """Run a block with the given backend, restoring the previous state after."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    was = is_enabled()
    enable() if backend == "lily" else disable()
    try:
        yield
    finally:
        enable() if was else disable()


def load(path_or_hf_repo: str, backend: str = "lily", **kwargs: Any):
    """``mlx_lm.load`` with the chosen backend; same arguments, same return value."""
    with using(backend):
        return mlx_utils.load(path_or_hf_repo, **kwargs)


_program = None


def running(program: str) -> None:
    """Record the mlx-lm program this process runs ('mlx_lm.server', ...),
    for ``python -m mlx_lily serve`` and the like (the startup hook records
    it for mlx-lm's own commands)."""
    global _program
    _program = program


def current_program():
    """The mlx-lm program this process runs ('mlx_lm.server', ...), or None."""
    return _program or getattr(sys.modules.get("mlx_lily_hook"), "program", None)


def _hook_requested_lily() -> bool:
    """Whether the startup hook asked for lily (an mlx-lm program run with
    ``--backend lily`` or ``MLX_LM_BACKEND=lily``); see hook/mlx_lily_hook.py."""
    hook = sys.modules.get("mlx_lily_hook")
    return bool(getattr(hook, "lily_requested", False))


# The hook may ask while this module is importing mlx_lm.utils (a program that
# imports mlx_lily first): it cannot enable a half-imported module, so the
# request is honoured here, once everything above exists.
if _hook_requested_lily():
    enable()
