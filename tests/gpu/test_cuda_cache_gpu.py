"""Lily's CUDA kernel cache on an NVIDIA GPU: what one process compiles, the
next loads from MLX's folder instead of compiling, with the same results."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]

# Runs every op's sample through its kernel, then prints the cache's counts
# and a digest of the outputs.
_SCRIPT = r"""
import hashlib, json
import mlx.core as mx
import mlx_lily.kernels
from mlx_lily.toolchain import cuda_cache
from mlx_lily.toolchain.registry import OPS
digest = hashlib.sha256()
ran = []
for name in sorted(OPS):
    op = OPS[name]
    if op.kernel is None or op.sample is None:
        continue
    args, kwargs = op.sample()
    out = op(*args, **kwargs)
    outs = out if isinstance(out, (list, tuple)) else [out]
    mx.eval(outs)
    if op.last_path == "kernel":
        ran.append(name)
        for o in outs:
            if isinstance(o, mx.array):
                digest.update(memoryview(o.astype(mx.float32)))
cache = cuda_cache.module_cache()
print(json.dumps({"ran": ran, "digest": digest.hexdigest(), "compiled": cache.compiled, "found": cache.found}))
"""


def _run(tmp_path: Path) -> dict:
    env = dict(os.environ, MLX_PTX_CACHE_DIR=str(tmp_path / "ptx"), MLX_LILY_CACHE=str(tmp_path / "lily"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH", "")] if p)
    env.pop("MLX_LILY_KERNEL_BACKEND", None)
    env.pop("MLX_LILY_KERNELS", None)
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kernel cache is off" not in proc.stderr, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_second_process_compiles_nothing_and_computes_the_same(backend, tmp_path):
    if backend != "cuda":
        pytest.skip("the kernel cache is CUDA's (Metal keeps compiled kernels itself)")
    first = _run(tmp_path)
    second = _run(tmp_path)
    assert first["ran"] and first["ran"] == second["ran"]
    assert first["compiled"] > 0
    assert second["compiled"] == 0 and second["found"] >= first["compiled"]
    assert second["digest"] == first["digest"]
