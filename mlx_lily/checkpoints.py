"""Alias of ``mlx_lily.random_checkpoints`` (its old name, kept because the
README and scripts import ``mlx_lily.checkpoints.make_checkpoint``,
``build_model`` and ``SHAPES``): importing it gives that very module."""

import sys

from . import random_checkpoints

sys.modules[__name__] = random_checkpoints
