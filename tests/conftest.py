"""Shared fixtures: small random qwen3_5_moe checkpoints written once per run."""

from __future__ import annotations

import pytest

from mlx_lily import _notice
from mlx_lily.random_checkpoints import make_checkpoint
from mlx_lily.toolchain.registry import BACKEND_ENV


@pytest.fixture
def emulator_backend(monkeypatch):
    """Ops run their kernels in the CPU emulator."""
    monkeypatch.setenv(BACKEND_ENV, "emulator")
    monkeypatch.delenv("MLX_LILY_KERNELS", raising=False)


@pytest.fixture
def fresh_notices():
    """Each test sees its own one-time notices."""
    _notice.reset_notices()
    yield
    _notice.reset_notices()


@pytest.fixture
def run_as_main(monkeypatch):
    """``run_as_main(name, **attributes)``: a stand-in ``__main__`` for the
    test, as ``python -m name`` makes it (its ``__spec__`` names the module)."""
    import sys
    import types

    def stand_in(name: str, **attributes):
        main = types.ModuleType("__main__")
        main.__spec__ = types.SimpleNamespace(name=name)
        for key, value in attributes.items():
            setattr(main, key, value)
        monkeypatch.setitem(sys.modules, "__main__", main)
        return main

    return stand_in


@pytest.fixture(scope="session")
def demo_checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "demo", shape="demo")


@pytest.fixture(scope="session")
def alt_checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "small-alt", shape="small-alt", seed=1)


@pytest.fixture(scope="session")
def demo_conditioned_checkpoint(tmp_path_factory):
    return make_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "demo-conditioned", shape="demo", conditioned=True
    )


@pytest.fixture(scope="session")
def alt_conditioned_checkpoint(tmp_path_factory):
    return make_checkpoint(
        tmp_path_factory.mktemp("ckpt") / "small-alt-conditioned", shape="small-alt", seed=1,
        conditioned=True,
    )


@pytest.fixture
def record_op_paths(monkeypatch):
    """A function that starts recording {op name: set of paths it took} from
    the call on, and returns that dict."""
    from mlx_lily.toolchain.registry import LilyOp

    def start() -> dict:
        paths: dict = {}
        original = LilyOp.__call__

        def recorded(self, *args, **kwargs):
            result = original(self, *args, **kwargs)
            paths.setdefault(self.name, set()).add(self.last_path)
            return result

        monkeypatch.setattr(LilyOp, "__call__", recorded)
        return paths

    return start
