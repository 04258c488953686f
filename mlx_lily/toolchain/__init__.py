"""Lily's kernel toolchain, apart from the kernels themselves.

* ``registry``: lily ops (a pure-MLX reference plus an optional kernel) and the
  choice of kernel backend (Metal, CUDA, the CPU emulator, or none).
* ``kernel``: a kernel body written once in the portable Metal subset, built
  for the active backend, launched, and self-checked against its op's
  reference; kernel groups (one op, several kernels).
* ``sources``: what each backend compiles (CUDA prelude, tile API, compacted
  text, CUDA include lines).
* ``contracts``: how kernels are judged against references.
* ``tracing``: kernels in traced graphs; first-use counters.
* ``cuda_cache``: CUDA modules compiled once per machine.
* ``type_names``: dtypes as MLX, Metal and CUDA spell them.
* ``lint``: the portable subset, documented and checked.
* ``prelude_cuda.h``, ``tiles_*.h``: the subset's Metal names and the tile API on each backend.
* ``probe``: a body that uses every subset feature once, checked against numpy.

Kernel families (their launchers and bodies) live in ``mlx_lily/kernels/``.
"""
