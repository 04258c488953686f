"""The package's layout stays readable: no Python module under mlx_lily/ over
600 lines, and every kernel body lives in a family package beside the module
that builds it."""

from __future__ import annotations

from pathlib import Path

import mlx_lily

ROOT = Path(mlx_lily.__file__).parent
MAX_LINES = 600


def test_no_module_is_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in ROOT.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_every_kernel_body_is_in_a_family_package():
    kernels = ROOT / "kernels"
    assert not list(kernels.glob("*.metal")) and not list(kernels.glob("*.metal.h"))
    for body in kernels.rglob("*.metal"):
        assert (body.parent / "__init__.py").exists(), body
