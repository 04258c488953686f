"""Linear-layer kernels: ``gemv`` (quantized matrix-vector products with
fused prologues) and ``matmul`` (a tiled ``x @ w.T``); their ``.metal``
bodies beside them."""
