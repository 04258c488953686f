"""mlx-lily: a specialized mlx-lm backend for the Qwen3.5/3.6 MoE family."""

__version__ = "0.1.0"

from .backend import disable, enable, is_enabled, load  # noqa: E402

__all__ = ["__version__", "load", "enable", "disable", "is_enabled"]
