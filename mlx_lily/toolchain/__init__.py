"""Lily's kernel toolchain, apart from the kernels themselves.

``registry`` (lily ops and the kernel backend), ``kernel`` (a body written
once, built, launched and self-checked; kernel groups), ``sources`` (what each
backend compiles), ``contracts`` (judging kernels against references),
``tracing`` (kernels in traced graphs), ``cuda_cache`` (CUDA modules once per
machine), ``type_names``, ``lint`` (the portable subset), ``prelude_cuda.h``
and ``tiles_*.h`` (the subset's Metal names and tile API per backend), and
``probe`` (every subset feature once, checked against numpy). Kernel families
live in ``mlx_lily/kernels/``. Module by module: docs/kernel-notes.md#toolchain.
"""
