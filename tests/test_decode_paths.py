"""bench.diagnostics.decode.decode_paths: every decode path runs and is the one named."""

from __future__ import annotations

import os

import pytest

from bench.diagnostics.decode import decode_paths
from mlx_lily.layers.decoder import COMPILE_ENV
from mlx_lily.toolchain.registry import BACKEND_ENV


@pytest.fixture(autouse=True)
def reference_backend(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "reference")


def test_each_path_runs_the_layers_it_names(tmp_path, monkeypatch):
    monkeypatch.delenv(COMPILE_ENV, raising=False)
    assert decode_paths.main(["--shape", "demo", "--context", "40", "--steps", "2", "--out", str(tmp_path)]) == 0
    rows = (tmp_path / "decode_paths.txt").read_text().splitlines()[3:]
    by_path = {row[:16].strip(): row for row in rows if row.strip()}
    assert list(by_path) == list(decode_paths.PATHS)
    assert by_path["stock"].endswith("stock")
    assert by_path["lily eager"].endswith("lily fused decode")
    assert by_path["lily layers"].endswith("lily fused decode")
    assert by_path["lily segments"].endswith("lily decode segments")
    # On the reference backend the whole step stands aside for the segments.
    assert by_path["lily whole step"].endswith("lily decode segments")
    for row in by_path.values():
        host, step, tps = (float(x) for x in row[16:].split()[:3])
        assert 0 < host <= step and tps > 0
    assert COMPILE_ENV not in os.environ  # the diagnostic leaves the setting as it found it
