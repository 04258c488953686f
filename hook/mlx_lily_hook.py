"""mlx-lily's startup hook (installed as mlx_lily_hook.pth + this module).

At interpreter start it only puts a tiny import finder first in sys.meta_path;
nothing heavy is imported. When ``mlx_lm.utils`` is imported later, the finder
lets it load normally and then, only in an mlx-lm command-line program
(``mlx_lm.generate``, ``mlx_lm.server``, ``mlx_lm chat``,
``python -m mlx_lm.generate`` ...):

* takes ``--backend lily|mlx`` out of ``sys.argv`` so mlx-lm's own argument
  parser never sees it, and adds it to that parser's ``--help``;
* takes ``--mtp`` out too (speculative decoding with the checkpoint's MTP
  head; lily only: ``mlx_lily.mtp_cli``);
* if the backend asked for (the flag, else ``MLX_LM_BACKEND``) is ``lily``,
  asks mlx_lily to enable itself, and makes lily's errors one line; in
  ``mlx_lm.server`` it also checks the ``--model`` checkpoint before the
  server starts, and exits with lily's one-line error if lily refuses it.

Any other program that imports mlx_lm is left alone, whatever the environment
says: it chooses lily with ``mlx_lily.load`` or ``mlx_lily.enable()``.
``MLX_LILY_HOOK=0`` switches the hook off entirely.
"""

import os
import sys

_TARGET = "mlx_lm.utils"
BACKEND_ENV = "MLX_LM_BACKEND"
BACKEND_HELP = (
    "Which backend builds the model: 'lily' (mlx-lily's kernels for the Qwen3.5/3.6 "
    "MoE family; other model types run stock) or 'mlx' (stock). Default: "
    f"${BACKEND_ENV}, else mlx."
)

# Set when the hook asked for lily; mlx_lily.backend reads it when it finishes
# importing, which is how a request made while mlx_lily is itself importing
# mlx_lm.utils still takes effect (no circular import).
lily_requested = False
# The mlx-lm program this process runs ("mlx_lm.server", "mlx_lm.generate",
# ...), or None; mlx_lily reads it (e.g. to prime its kernels for a server).
program = None


def _program_name():
    """'mlx_lm.server', 'mlx_lm.generate', ...: the console script, the module
    run with -m, or the umbrella command ``mlx_lm <subcommand>``; None if none."""
    if not sys.argv:
        return None
    name = os.path.basename(sys.argv[0])
    if not name.startswith("mlx_lm"):
        # python -m mlx_lm[.X]: mlx_lm.utils is imported while argv[0] is still '-m'.
        orig = getattr(sys, "orig_argv", [])
        name = orig[orig.index("-m") + 1] if "-m" in orig and orig.index("-m") + 1 < len(orig) else ""
    if name == "mlx_lm" and len(sys.argv) > 1 and not sys.argv[1].startswith("-"):
        name = f"mlx_lm.{sys.argv[1]}"
    return name or None


def _is_mlx_lm_program(name):
    """Console scripts mlx_lm, mlx_lm.generate, mlx_lm.server, ... and python -m mlx_lm[.X]."""
    return name is not None and name.split(".")[0] == "mlx_lm"


NEEDS_VALUE = "--backend needs a value: lily or mlx"
MTP_HELP = ("Speculative decoding with the checkpoint's MTP head (--backend lily): --num-draft-tokens "
            "drafts per step (1 to 3; default 1 with --mtp).")


def _take_backend_flag(argv):
    """Remove --backend X / --backend=X from argv; return X or None."""
    for i, arg in enumerate(argv):
        if arg == "--backend":
            # A following flag is not a value: '--backend --model M' forgot it.
            if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                _fail(NEEDS_VALUE)
            value = argv[i + 1]
            del argv[i : i + 2]
            return value
        if arg.startswith("--backend="):
            value = arg.split("=", 1)[1]
            if not value:
                _fail(NEEDS_VALUE)
            del argv[i]
            return value
    return None


def _fail(message):
    sys.stderr.write(f"mlx-lily: {message}\n")
    raise SystemExit(2)


def add_backend_to_help(default_text=BACKEND_HELP):
    """Make every argparse --help in this process list --backend.

    The flag is taken out of sys.argv before mlx-lm parses it, so mlx-lm's
    parsers never declare it; they only learn of it when printing help.
    """
    import argparse

    stock_format_help = argparse.ArgumentParser.format_help

    def format_help(self):
        if "--backend" not in self._option_string_actions:
            self.add_argument("--backend", choices=["lily", "mlx"], help=default_text)
        if "--mtp" not in self._option_string_actions:
            self.add_argument("--mtp", action="store_true", help=MTP_HELP)
        return stock_format_help(self)

    argparse.ArgumentParser.format_help = format_help


def request_lily():
    """Enable lily now, or as soon as mlx_lily.backend finishes importing."""
    global lily_requested
    lily_requested = True
    if "mlx_lily.backend" not in sys.modules:
        import mlx_lily.backend  # noqa: F401  (enables lily as it finishes)
    import mlx_lily.errors

    mlx_lily.errors.install_one_line_errors()


def _after_mlx_lm_utils():
    global program
    name = _program_name()
    if not _is_mlx_lm_program(name):
        return
    program = name
    backend = _take_backend_flag(sys.argv)
    mtp = "--mtp" in sys.argv
    sys.argv[:] = [a for a in sys.argv if a != "--mtp"]
    if any(arg in ("-h", "--help") for arg in sys.argv[1:]):
        add_backend_to_help()
    if backend is None:
        backend = os.environ.get(BACKEND_ENV) or "mlx"
    if backend not in ("lily", "mlx"):
        _fail(f"unknown backend {backend!r}: use lily or mlx")
    if mtp and backend != "lily":
        _fail("--mtp needs --backend lily")
    if backend == "lily":
        request_lily()
        if mtp:
            import mlx_lily.mtp_cli

            mlx_lily.mtp_cli.request(sys.argv)
        if name == "mlx_lm.server":
            _check_before_serving()


def _check_before_serving():
    """Refuse a checkpoint lily cannot load before the server starts: it loads
    its model in a background thread while answering, so a refusal there
    leaves a server that fails every request."""
    backend = sys.modules.get("mlx_lily.backend")
    check = getattr(backend, "check_before_serving", None)
    if check is None:  # mlx_lily.backend is still importing (it came first)
        return
    import mlx_lily.errors as errors

    try:
        check(sys.argv[1:])
    except errors.LilyError as e:
        if errors.want_traceback():
            raise
        sys.stderr.write(errors.one_line(e) + "\n")
        raise SystemExit(1)


class _Loader:
    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _after_mlx_lm_utils()


class _Finder:
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(cls)  # one shot
        from importlib.machinery import PathFinder

        spec = PathFinder.find_spec(name, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


if os.environ.get("MLX_LILY_HOOK", "1") != "0" and _TARGET not in sys.modules:
    sys.meta_path.insert(0, _Finder)
