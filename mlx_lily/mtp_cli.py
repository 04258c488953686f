"""``--mtp`` on mlx-lm's commands (and ``python -m mlx_lily generate|serve|chat
--mtp``): speculative decoding with the checkpoint's MTP head.

The flag is taken out of argv before mlx-lm parses it (as ``--backend``: the
startup hook for mlx-lm's own commands, ``mlx_lily.__main__`` for ours).
Drafts per round: mlx-lm's own ``--num-draft-tokens`` where given (read, left
in argv for its parser), else 1; at most 3.

When lily loads the model (``backend._lily_load_model`` calls ``loaded``):

* mlx-lm's ``generate_step`` is wrapped (``mtp_decode.install``), so every
  single-stream decode drafts: ``mlx_lm.generate``, ``mlx_lm.chat``, the
  server's one-request path;
* their ``make_sampler`` is lily's (``mtp_sampling``: the same draws, and
  the distribution a draw comes from, for rejection sampling);
* a checkpoint without a head: one line saying so and how to graft one;
  decoding proceeds without drafts;
* in ``mlx_lm.server``: requests are served one at a time, drafting (as
  mlx-lm serves ``--draft-model``: its batch generator does not draft), with
  one notice saying so.
"""

from __future__ import annotations

import json
import re
import struct
import sys
from pathlib import Path
from typing import Any, List, Optional

FLAG = "--mtp"
HELP = ("Speculative decoding with the checkpoint's MTP head (lily only): --num-draft-tokens "
        "drafts per step (1 to 3; default here 1). A checkpoint without a head decodes "
        "without drafts (python -m mlx_lily graft-mtp adds one).")


def take_flag(argv: List[str]) -> bool:
    """Remove every --mtp from argv (in place); whether there was one."""
    found = FLAG in argv
    argv[:] = [a for a in argv if a != FLAG]
    return found


def draft_tokens_in(argv: List[str]) -> int:
    """mlx-lm's --num-draft-tokens N / --num-draft-tokens=N in argv, else 1."""
    for i, arg in enumerate(argv):
        value = None
        if arg == "--num-draft-tokens" and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith("--num-draft-tokens="):
            value = arg.split("=", 1)[1]
        if value is not None:
            try:
                return max(int(value), 0)
            except ValueError:
                return 1  # mlx-lm's parser says what is wrong with it
    return 1


def request(argv: List[str]) -> None:
    """Draft with the MTP head in this process (the commands' --mtp), with
    the drafts per round argv's --num-draft-tokens asks for."""
    from . import mtp_decode

    mtp_decode.cli_draft_tokens = draft_tokens_in(argv)


def requested() -> bool:
    from . import mtp_decode

    return bool(mtp_decode.cli_draft_tokens)


def loaded(model: Any, model_path: Any, program: Optional[str]) -> None:
    """After lily loads a model in a process run with --mtp."""
    if not requested():
        return
    from . import mtp, mtp_decode
    from ._notice import notice_once

    mtp_decode.install()
    _samplers_that_say_their_law()
    if mtp.head_of(model) is None:
        # Said here, with the checkpoint's path; generate_step then stays quiet.
        notice_once("mtp-no-head", f"--mtp: {model_path} has no MTP head (no mtp.* tensors): decoding "
                                   f"without drafts; add one: python -m mlx_lily graft-mtp {model_path} "
                                   "ORIGINAL (a folder of Qwen's original safetensors)")
        return
    if program == "mlx_lm.server" and _serve_one_at_a_time():
        notice_once("mtp-server", f"--mtp: drafting {min(mtp_decode.cli_draft_tokens, mtp_decode.MAX_DRAFT)} "
                                  "token(s) per step with the MTP head; requests are served one at a "
                                  "time (mlx-lm's batched decoding does not draft)")


def _samplers_that_say_their_law() -> None:
    """mlx-lm's commands and server make their samplers with lily's
    ``make_sampler`` (the same draws; a ``Sampler`` also says its law, so the
    loop can draft from the head's distribution)."""
    from . import mtp_sampling
    from ._patches import loaded_program_module

    for name in ("mlx_lm.generate", "mlx_lm.server"):
        module = loaded_program_module(name)
        if module is not None and hasattr(module, "make_sampler"):
            module.make_sampler = mtp_sampling.make_sampler


def _serve_one_at_a_time() -> bool:
    """Make mlx_lm.server's requests non-batchable while the loaded model has
    a head (its ``ResponseGenerator._is_batchable``, as stock's answer for a
    draft model); whether the server could be patched."""
    from ._patches import loaded_program_module

    server = loaded_program_module("mlx_lm.server")
    generator = getattr(server, "ResponseGenerator", None)
    stock = getattr(generator, "_is_batchable", None)
    if stock is None:
        return False
    if getattr(stock, "_lily_mtp", False):
        return True

    def _is_batchable(self, args):
        from . import mtp

        model = getattr(self.model_provider, "model", None)
        if requested() and model is not None and mtp.head_of(model) is not None:
            return False
        return stock(self, args)

    _is_batchable._lily_mtp = True
    generator._is_batchable = _is_batchable
    return True


# ------------------------------------------------------------ doctor's line

_HEAD_LAYER = re.compile(r"(?:^|\.)mtp\.layers\.(\d+)\.")


def checkpoint_head_layers(path: Path) -> Optional[int]:
    """The MTP head's layer count in a checkpoint folder's safetensors
    (headers only; 0: no head); None where the folder has no safetensors."""
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        return None
    layers = set()
    any_mtp = False
    for f in files:
        with open(f, "rb") as fh:
            (size,) = struct.unpack("<Q", fh.read(8))
            names = json.loads(fh.read(size)).keys()
        for name in names:
            if name.startswith("mtp.") or ".mtp." in name:
                any_mtp = True
                m = _HEAD_LAYER.search(name)
                if m:
                    layers.add(int(m.group(1)))
    return max(len(layers), 1) if any_mtp else 0


def head_line(model: str) -> str:
    """doctor's line: whether the checkpoint has an MTP head."""
    path = Path(model)
    if not path.is_dir():
        try:
            from mlx_lm.utils import _download

            path = Path(_download(model))
        except Exception as e:  # noqa: BLE001 - doctor reports, never crashes
            return f"{model}: cannot read ({type(e).__name__}: {e})"
    layers = checkpoint_head_layers(path)
    if layers is None:
        return f"{path}: no safetensors"
    if layers:
        return f"{path}: MTP head ({layers} layer{'s' * (layers > 1)}): --mtp drafts with it"
    return f"{path}: no MTP head (no mtp.* tensors); python -m mlx_lily graft-mtp {path} ORIGINAL adds one"
