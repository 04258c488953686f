"""Lily's layers: subclasses of stock mlx-lm's Qwen3.5 layers that add no
parameters and route their math through lily's ops when the call is on the
fast path (batch 1, no padding mask, a plain cache, not sharded, inference).
Every other call runs the stock layer's own code, unchanged."""

from .attention import LilyAttention
from .gated_deltanet import LilyGatedDeltaNet
from .moe import LilySparseMoeBlock

__all__ = ["LilyAttention", "LilyGatedDeltaNet", "LilySparseMoeBlock"]
