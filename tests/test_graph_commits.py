"""MLX's CUDA graph commit bound: lily relaxes the byte bound on CUDA only,
keeps a value the user set, and says which it is."""

import os
import subprocess
import sys

from mlx_lily import graph_commits


def test_sets_the_byte_bound_on_cuda_unless_the_user_did(monkeypatch):
    monkeypatch.setattr(graph_commits, "_cuda_build", lambda: True)
    monkeypatch.setattr(graph_commits, "_set_by_lily", False)
    monkeypatch.delenv(graph_commits.BYTES_ENV, raising=False)
    assert graph_commits.relax_byte_bound() == str(graph_commits.RELAXED_MB)
    assert "set by lily" in graph_commits.describe()

    monkeypatch.setattr(graph_commits, "_set_by_lily", False)
    monkeypatch.setenv(graph_commits.BYTES_ENV, "1000")
    assert graph_commits.relax_byte_bound() == "1000"
    assert "MLX_MAX_MB_PER_BUFFER=1000, set by the user" in graph_commits.describe()


def test_leaves_other_backends_alone(monkeypatch):
    monkeypatch.setattr(graph_commits, "_cuda_build", lambda: False)
    monkeypatch.delenv(graph_commits.BYTES_ENV, raising=False)
    assert graph_commits.relax_byte_bound() is None
    assert graph_commits.BYTES_ENV not in os.environ
    assert graph_commits.describe().startswith("not CUDA")


def test_importing_lily_sets_it_only_where_mlx_runs_cuda():
    """In a fresh process, as mlx-lm's commands import lily: the variable
    after ``import mlx_lily`` is the relaxed bound exactly when this MLX is a
    CUDA build."""
    code = ("import os, mlx.core as mx, mlx_lily; from mlx_lily import graph_commits as g; "
            "print(g._cuda_build(), os.environ.get(g.BYTES_ENV))")
    env = {k: v for k, v in os.environ.items() if k != graph_commits.BYTES_ENV}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    cuda, value = out.stdout.split()
    assert value == (str(graph_commits.RELAXED_MB) if cuda == "True" else "None")


def test_the_bench_imports_lily_before_anything_else():
    """Every bench tool runs under the same bound as lily: importing the
    bench package alone imports lily (and so sets it where MLX runs CUDA)."""
    code = "import sys, bench; print('mlx_lily' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
