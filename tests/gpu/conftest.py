"""Shared fixtures of the GPU tests."""

from __future__ import annotations

import pytest

from mlx_lily.toolchain.registry import BACKEND_ENV, gpu_backend


@pytest.fixture
def backend(monkeypatch):
    """The GPU backend ('metal' or 'cuda'), with kernels on their default settings."""
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.delenv("MLX_LILY_KERNELS", raising=False)
    name = gpu_backend()
    if name is None:
        pytest.skip("no GPU: the default device is not a Metal or CUDA GPU")
    return name
