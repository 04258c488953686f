"""Where lily keeps files it writes for later runs (checkpoints, kernel sources)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$MLX_LILY_CACHE``, else ``$XDG_CACHE_HOME/mlx_lily`` or ``~/.cache/mlx_lily``."""
    root = os.environ.get("MLX_LILY_CACHE")
    if root:
        return Path(root)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "mlx_lily"
