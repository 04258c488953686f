"""Shared fixtures: small random qwen3_5_moe checkpoints written once per run."""

from __future__ import annotations

import pytest

from mlx_lily.checkpoints import make_checkpoint


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "demo", shape="demo")


@pytest.fixture(scope="session")
def alt_checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "small-alt", shape="small-alt", seed=1)
