"""Every op with a kernel against its reference on random shapes and dtypes.

Generic over the op registry: an op joins by declaring ``fuzz(rng) -> (args,
kwargs)``, a random call its kernel supports; the kernel's result must meet the
op's contract (its kernel's ``agree``, the same judge as its self-check).
Seeded, so a failure names a case that reproduces. In CI the kernels run in the
CPU emulator on FUZZ_CASES cases per op (each new instantiation costs the
emulator a few seconds of compiling once, cached after: under a minute cold);
``MLX_LILY_FUZZ_CASES=N`` asks for more, and the gpu-marked test runs
GPU_FUZZ_CASES per op on the machine's GPU (``python -m pytest -m gpu``).
"""

from __future__ import annotations

import os

import mlx.core as mx
import numpy as np
import pytest

from mlx_lily.kernels import OPS
from mlx_lily.toolchain.registry import BACKEND_ENV, gpu_backend

FUZZ_CASES = int(os.environ.get("MLX_LILY_FUZZ_CASES", "8"))
GPU_FUZZ_CASES = int(os.environ.get("MLX_LILY_FUZZ_CASES", "48"))
SEED = int(os.environ.get("MLX_LILY_FUZZ_SEED", "0"))

KERNEL_OPS = sorted(name for name, op in OPS.items() if op.kernel is not None)


def describe(args, kwargs) -> str:
    def one(a):
        if isinstance(a, mx.array):
            return f"{tuple(a.shape)} {str(a.dtype).rsplit('.', 1)[-1]}"
        return repr(a)

    parts = [one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return ", ".join(parts)


def fuzz_op(name: str, cases: int, run) -> None:
    op = OPS[name]
    rng = np.random.default_rng([SEED, sum(map(ord, name))])
    for case in range(cases):
        args, kwargs = op.fuzz(rng)
        where = f"{name} case {case} (seed {SEED}): {describe(args, kwargs)}"
        assert op.supports is None or op.supports(*args, **kwargs) is None, where
        got = run(op, args, kwargs)
        mx.eval(got)
        want = op.reference(*args, **kwargs)
        mx.eval(want)
        mismatch = op.kernel.agree(got, want, *args, **kwargs)
        assert mismatch is None, f"{where}: {mismatch}"


def test_every_kernel_op_declares_a_fuzz_generator():
    assert KERNEL_OPS, "no op has a kernel"
    missing = [name for name in KERNEL_OPS if OPS[name].fuzz is None]
    assert not missing, f"ops with a kernel but no fuzz generator: {missing}"


@pytest.mark.parametrize("name", KERNEL_OPS)
def test_kernel_matches_reference_on_random_calls_in_the_emulator(name):
    pytest.importorskip("mlx_lily.emulator")
    fuzz_op(name, FUZZ_CASES, lambda op, a, kw: op.kernel.emulate(*a, **kw))


@pytest.mark.gpu
@pytest.mark.parametrize("name", KERNEL_OPS)
def test_kernel_matches_reference_on_random_calls_on_the_gpu(name, monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    backend = gpu_backend()
    if backend is None:
        pytest.skip("no GPU: the default device is not a Metal or CUDA GPU")
    ok, why = OPS[name].kernel.ready_on(backend)
    assert ok, why
    fuzz_op(name, GPU_FUZZ_CASES, lambda op, a, kw: op.kernel.run_on(backend, *a, **kw))


@pytest.mark.parametrize("name", KERNEL_OPS)
def test_path_for_takes_the_backend_then_the_call(name):
    # bench --ops asks every op's kernels which of them a call runs as
    # path_for(backend, *args); one kernel object with another signature lost
    # the attention rows of an H200 run.
    kernels = OPS[name].kernel
    if not hasattr(kernels, "path_for"):
        pytest.skip(f"{name}: one kernel, no path to name")
    args, kwargs = OPS[name].sample()
    path = kernels.path_for("emulator", *args, **kwargs)
    assert path is None or isinstance(path, str)
