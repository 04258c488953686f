"""Errors lily raises for bad input (checkpoints, flags)."""


class LilyError(ValueError):
    """Base class: a ValueError so callers that catch mlx-lm's errors catch ours."""


class CheckpointError(LilyError):
    """A checkpoint lily cannot load: names the tensor or setting at fault."""
