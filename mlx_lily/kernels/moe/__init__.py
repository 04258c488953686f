"""Sparse-MoE kernels: ``router`` (top-k routing), ``routing`` (expert-order
rows and tile map), ``experts`` (the ``moe_experts`` op: grouped 4-bit
expert GEMMs), ``combine`` (routing weights + shared expert) and ``decode``
(a decode token's whole MoE block in two launches); their ``.metal`` bodies
beside them."""
