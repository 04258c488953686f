"""Lily's kernel toolchain, apart from the kernels themselves.

* ``registry``: lily ops (a pure-MLX reference plus an optional kernel) and the
  choice of kernel backend (Metal, CUDA, the CPU emulator, or none).
* ``build``: a kernel body written once in the portable Metal subset, built for
  the active backend, launched, and self-checked against its op's reference.
* ``lint``: the portable subset, documented and checked.
* ``prelude_cuda.h``: the subset's Metal names defined for CUDA.
* ``probe``: a body that uses every subset feature once, checked against numpy.

Kernel families (their launchers and bodies) live in ``mlx_lily/kernels/``.
"""
