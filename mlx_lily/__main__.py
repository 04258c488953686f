"""``python -m mlx_lily {generate,serve,chat,benchmark,cache-prompt,demo,doctor,graft-mtp}``.

``generate``, ``serve``, ``chat``, ``benchmark`` and ``cache-prompt`` are mlx-lm's own commands
with every flag unchanged, plus ``--backend lily|mlx`` (default: lily here).
They work whether or not the startup hook is installed.
"""

from __future__ import annotations

import sys

from . import backend
from .errors import LilyError, one_line, want_traceback

# Our command name -> mlx-lm's module that implements it.
MLX_LM_COMMANDS = {
    "generate": "mlx_lm.generate",
    "serve": "mlx_lm.server",
    "server": "mlx_lm.server",
    "chat": "mlx_lm.chat",
    "benchmark": "mlx_lm.benchmark",
    "cache-prompt": "mlx_lm.cache_prompt",
    "cache_prompt": "mlx_lm.cache_prompt",
}

USAGE = """usage: python -m mlx_lily COMMAND [options]

commands:
  generate   mlx-lm's generate, on lily's backend   (mlx_lm.generate --help)
  serve      mlx-lm's OpenAI-style server, on lily  (mlx_lm.server --help)
  chat       mlx-lm's chat REPL, on lily            (mlx_lm.chat --help)
  benchmark  mlx-lm's benchmark, on lily            (mlx_lm.benchmark --help)
  cache-prompt  mlx-lm's cache_prompt; on lily the file also keeps DeltaNet
             checkpoints (--prefill-step-size N: their spacing, default 2048)
  demo       a random Qwen3.5-MoE checkpoint, stock vs lily side by side
  doctor     platform, versions, each op's path, and a self-check of every op
  graft-mtp  add the MTP head of Qwen's original safetensors to an mlx-lm checkpoint

generate/serve/chat/benchmark/cache-prompt accept --backend lily|mlx (default lily).
generate/serve/chat also accept --mtp: speculative decoding with the checkpoint's MTP head.
"""


# The startup hook's words (hook/mlx_lily_hook.py), so that every entry point
# taking --backend says the same; exit status 2, as argparse's usage errors.
NEEDS_VALUE = "mlx-lily: --backend needs a value: lily or mlx"


def _usage_error(message: str) -> None:
    print(message, file=sys.stderr)
    sys.exit(2)


def take_backend(argv: list[str], default: str) -> str:
    """Remove --backend X / --backend=X from argv (in place); return X."""
    for i, arg in enumerate(argv):
        if arg == "--backend":
            # A following flag is not a value: '--backend --model M' forgot it.
            if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                _usage_error(NEEDS_VALUE)
            value = argv[i + 1]
            del argv[i : i + 2]
            break
        if arg.startswith("--backend="):
            value = arg.split("=", 1)[1]
            if not value:
                _usage_error(NEEDS_VALUE)
            del argv[i]
            break
    else:
        return default
    if value not in backend.BACKENDS:
        _usage_error(f"mlx-lily: unknown backend {value!r}: use lily or mlx")
    return value


BACKEND_HELP = (
    "Which backend builds the model: 'lily' (mlx-lily's kernels for the Qwen3.5/3.6 "
    "MoE family; other model types run stock) or 'mlx' (stock). Default here: lily."
)


def add_backend_to_help() -> None:
    """List --backend in mlx-lm's --help (the flag never reaches its parser)."""
    import argparse

    stock_format_help = argparse.ArgumentParser.format_help

    def format_help(self):
        if "--backend" not in self._option_string_actions:
            self.add_argument("--backend", choices=list(backend.BACKENDS), help=BACKEND_HELP)
        if "--mtp" not in self._option_string_actions:
            from .mtp_cli import HELP

            self.add_argument("--mtp", action="store_true", help=HELP)
        return stock_format_help(self)

    argparse.ArgumentParser.format_help = format_help


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return
    command, rest = argv[0], argv[1:]
    if command in MLX_LM_COMMANDS:
        import importlib

        chosen = take_backend(rest, default="lily")
        from . import mtp_cli

        if mtp_cli.take_flag(rest):
            if chosen != "lily":
                _usage_error("mlx-lily: --mtp needs --backend lily")
            mtp_cli.request(rest)
        module = importlib.import_module(MLX_LM_COMMANDS[command])
        backend.enable() if chosen == "lily" else backend.disable()
        backend.running(MLX_LM_COMMANDS[command])
        if any(arg in ("-h", "--help") for arg in rest):
            add_backend_to_help()
        sys.argv = [f"mlx_lily {command}"] + rest
        try:
            if chosen == "lily" and MLX_LM_COMMANDS[command] == "mlx_lm.server":
                # Before serving: the server loads in a background thread.
                backend.check_before_serving(rest)
            if chosen == "lily" and MLX_LM_COMMANDS[command] in ("mlx_lm.cache_prompt", "mlx_lm.generate"):
                from . import cache_prompt  # prompt cache files (docs/prefix-reuse.md)

                if command.startswith("cache"):
                    cache_prompt.take_step_flag(rest)
                else:
                    cache_prompt.check_before_generating(rest)
                sys.argv = [f"mlx_lily {command}"] + rest
            module.main()
        except LilyError as e:
            if want_traceback():
                raise
            sys.exit(one_line(e))
    elif command == "demo":
        from .demo import main as demo_main

        sys.exit(demo_main(rest))
    elif command == "doctor":
        from .doctor import main as doctor_main

        sys.exit(doctor_main(rest))
    elif command == "graft-mtp":
        from .graft_mtp import main as graft_main

        try:
            sys.exit(graft_main(rest))
        except LilyError as e:
            if want_traceback():
                raise
            sys.exit(one_line(e))
    else:
        sys.exit(f"mlx-lily: unknown command {command!r}\n\n{USAGE}")


if __name__ == "__main__":
    main()
