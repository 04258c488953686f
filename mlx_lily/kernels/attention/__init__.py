"""Attention kernels: ``sdpa`` (the ``attention`` op: decode in one pass or
split over key blocks then combined, prefill on matrix tiles) and
``qk_norm_rope`` (per-head RMSNorm and RoPE on queries and keys); their
``.metal`` bodies beside them."""
