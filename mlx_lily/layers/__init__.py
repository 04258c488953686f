"""Lily's layers: subclasses of stock mlx-lm's Qwen3.5 layers that add no
parameters and route their math through lily's ops for every inference call
mlx-lm makes (any batch, padding masks, KVCache / BatchKVCache, padded
ArraysCache); see stock_gate.py for what still runs the stock layer's code."""

from .attention import LilyAttention
from .decoder import LilyDecoderLayer
from .gated_deltanet import LilyGatedDeltaNet
from .language_model import LilyLanguageModel
from .mlp import LilyDenseMLP
from .moe import LilySparseMoeBlock
from .text_model import LilyTextModel

__all__ = [
    "LilyAttention", "LilyDecoderLayer", "LilyDenseMLP", "LilyGatedDeltaNet", "LilySparseMoeBlock", "LilyTextModel",
]
