"""The MoE decode router's launch (mlx_lily/kernels/moe/decode_router.py),
in the CPU emulator: the bits of the two launches it replaces (the row
GEMV's router logits and shared-gate logit, route's picks, weights and xn)
at every batch size, shape, bit width and launch shape; its contract and
limits; and the model's decode: the same log-probabilities, bit for bit,
with the launch and without it, alone and in a batch.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_lily import kernels as K
from mlx_lily.kernels.linear.gemv import quantized_matvec_kernel
from mlx_lily.kernels.moe import decode_router
from mlx_lily.kernels.moe.decode import MAX_BATCH, moe_decode_route_kernel
from mlx_lily.kernels.moe.decode_router import (
    moe_decode_router_agree,
    moe_decode_router_kernel,
    moe_decode_router_reference,
    moe_decode_router_supports,
)
from mlx_lily.kernels.moe.testing import moe_router_inputs

from test_batch_invariance import generate
from test_toolchain import emulator_or_skip


def bits(a: mx.array) -> np.ndarray:
    return np.array(a if a.dtype == mx.uint32 else a.view(mx.uint16))


def two_launches(h, norm_weight, eps, gate, shared_gate, top_k, normalize):
    """What the launch stands for: the row GEMV, then route."""
    logits, shared_logit = quantized_matvec_kernel.emulate(h, (gate, shared_gate), norm_weight, eps)
    xn, inds, scores = moe_decode_route_kernel.emulate(h, logits, norm_weight, eps, top_k, normalize)
    return logits, shared_logit, xn, inds, scores


NAMES = ("logits", "shared_logit", "xn", "inds", "scores")


def assert_same_bits(got, want, what=""):
    for name, g, w in zip(NAMES, got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (what, name)
        assert np.array_equal(bits(g), bits(w)), f"{what}: {name} differs"


@pytest.mark.parametrize("rows, D, E, k, gate_bits, dtype", [
    (1, 128, 24, 3, (8, 8), mx.bfloat16),
    (2, 192, 40, 4, (4, 8), mx.bfloat16),
    (3, 64, 7, 2, (4, 4), mx.float16),
    (5, 320, 65, 8, (8, 4), mx.bfloat16),
    (MAX_BATCH, 128, 33, 5, (8, 8), mx.float16),
])
def test_the_launch_gives_the_gemv_and_route_bits(rows, D, E, k, gate_bits, dtype):
    emulator_or_skip()
    args, _ = moe_router_inputs(D, E, k, seed=rows, rows=rows, bits=gate_bits, dtype=dtype,
                                normalize=rows % 2 == 1)
    assert moe_decode_router_supports(*args) is None
    got = moe_decode_router_kernel.emulate(*args)
    assert_same_bits(got, two_launches(*args), f"B={rows}")
    assert moe_decode_router_agree(got, moe_decode_router_reference(*args), *args) is None


def test_a_row_is_the_same_bits_alone_and_in_any_batch():
    emulator_or_skip()
    (h, *rest), _ = moe_router_inputs(128, 24, 3, seed=7, rows=MAX_BATCH)
    together = moe_decode_router_kernel.emulate(h, *rest)
    for rows in (2, 5):
        part = moe_decode_router_kernel.emulate(h[rows - 1:2 * rows - 1], *rest)
        # Row rows - 1 of the 16 is row 0 of this batch.
        assert_same_bits([a[:1] for a in part], [a[rows - 1:rows] for a in together], f"in {rows}")
    alone = moe_decode_router_kernel.emulate(h[MAX_BATCH - 1:], *rest)
    assert_same_bits(alone, [a[MAX_BATCH - 1:] for a in together], "alone")


@pytest.mark.parametrize("simdgroups, rows_per_sg", [(16, 1), (16, 2), (32, 4), (9, 4)])
def test_the_launch_shapes_give_the_same_bits(simdgroups, rows_per_sg, monkeypatch):
    emulator_or_skip()
    args, _ = moe_router_inputs(192, 40, 4, seed=9, rows=3, bits=(8, 4))
    want = moe_decode_router_kernel.emulate(*args)
    monkeypatch.setattr(decode_router, "SIMD_GROUPS", simdgroups)
    monkeypatch.setattr(decode_router, "ROWS_PER_SG", rows_per_sg)
    assert_same_bits(moe_decode_router_kernel.emulate(*args), want, f"{simdgroups} x {rows_per_sg}")


def test_a_launch_with_fewer_simd_groups_than_the_norms_is_refused(monkeypatch):
    args, _ = moe_router_inputs(128, 24, 3, seed=1)
    monkeypatch.setattr(decode_router, "SIMD_GROUPS", 4)
    with pytest.raises(ValueError, match="both norms"):
        decode_router._launch(*args)


def test_agree_rejects_wrong_outputs():
    emulator_or_skip()
    args, _ = moe_router_inputs(128, 24, 3, seed=2, rows=2)
    got = list(moe_decode_router_kernel.emulate(*args))
    want = moe_decode_router_reference(*args)
    assert moe_decode_router_agree(got, want, *args) is None
    bad_logits = [got[0] * 1.5, *got[1:]]
    assert "router GEMV" in moe_decode_router_agree(bad_logits, want, *args)
    lowest = mx.argsort(got[0].reshape(2, -1), axis=-1)[:, :3].astype(mx.uint32)
    assert "top-k" in moe_decode_router_agree([*got[:3], lowest, got[4]], want, *args)
    assert "xn" in moe_decode_router_agree([*got[:2], got[2] * 1.25, *got[3:]], want, *args)


def test_supports_refuses_what_the_launch_does_not_take():
    (h, w, eps, gate, shared, k, normalize), _ = moe_router_inputs(128, 24, 3, seed=4, rows=2)
    ok = (w, eps, gate, shared, k, normalize)
    assert moe_decode_router_supports(h, *ok) is None
    big = mx.zeros((MAX_BATCH + 1, 1, 128), h.dtype)
    assert f"B <= {MAX_BATCH}" in moe_decode_router_supports(big, *ok)
    assert "float32" in moe_decode_router_supports(h.astype(mx.float32), *ok)
    assert "norm_weight dtype" in moe_decode_router_supports(h, w.astype(mx.float32), *ok[1:])
    two_rows = tuple(mx.concatenate([a, a]) for a in shared)
    assert "shared gate of 2 rows" in moe_decode_router_supports(h, w, eps, gate, two_rows, k, normalize)
    assert "top_k=25" in moe_decode_router_supports(h, w, eps, gate, shared, 25, normalize)
    three_bit = tuple(mx.quantize(mx.zeros((24, 128), h.dtype), group_size=64, bits=3))
    assert "3-bit" in moe_decode_router_supports(h, w, eps, three_bit, shared, k, normalize)


def test_the_model_decodes_the_same_bits_with_and_without_the_launch(demo_checkpoint, emulator_backend,
                                                                     monkeypatch):
    import mlx_lily

    model, _ = mlx_lily.load(str(demo_checkpoint), backend="lily")
    schedule, steps = {0: [0, 1, 2, 3, 4]}, {i: 3 for i in range(5)}
    monkeypatch.setattr(decode_router, "MIN_ROWS", 1)  # every call takes the launch
    with_launch = generate(model, schedule, steps)
    assert K.moe_decode_router.last_path == "kernel", K.moe_decode_router.last_reason
    alone = generate(model, {0: [3]}, {3: 3})[3]
    monkeypatch.setattr(decode_router, "MIN_ROWS", MAX_BATCH + 1)  # none does
    K.moe_decode_router.last_path = None
    without = generate(model, schedule, steps)
    assert K.moe_decode_router.last_path is None  # not called
    for i in range(5):
        for (tg, lg), (tw, lw) in zip(with_launch[i], without[i]):
            assert tg == tw and np.array_equal(lg, lw), f"row {i}"
    for (tg, lg), (tw, lw) in zip(alone, without[3]):
        assert tg == tw and np.array_equal(lg, lw), "row 3 alone"


def test_compiles_for_cuda_without_local_memory(tmp_path):
    """At the real shape (D 2048, 256 experts top-8; 8-bit gates as the
    checkpoints have them, and 4-bit), bf16 and fp16: no local memory, and
    the threadgroup memory is the staged input, the row's logits and the
    two norms' partial sums."""
    import re

    from test_toolchain import nvcc_ptx

    units = {}
    for dtype, gate_bits in ((mx.bfloat16, (8, 8)), (mx.float16, (8, 8)), (mx.bfloat16, (4, 4))):
        D, E = 2048, 256

        def triple(n, b):
            return (mx.zeros((n, D * b // 32), mx.uint32), mx.zeros((n, D // 64), dtype), mx.zeros((n, D // 64), dtype))

        name = f"{str(dtype).rsplit('.', 1)[-1]}_{gate_bits[0]}bit"
        units[name] = moe_decode_router_kernel.cuda_translation_unit(
            mx.zeros((1, 1, D), dtype), mx.zeros((D,), dtype), 1e-6, triple(E, gate_bits[0]),
            triple(1, gate_bits[1]), 8, True)
    launch = decode_router._launch(*moe_router_inputs(2048, 256, 8)[0])
    gemv_norm_sg = dict(launch.template)["GEMV_NORM_SG"]
    for name, text in nvcc_ptx(tmp_path, units, warnings_ok=False).items():
        assert "ld.local" not in text and "st.local" not in text, name
        shared = sorted(int(n) for n in re.findall(r"\.shared[^;]*\[(\d+)\]", text))
        assert shared == sorted([2 * 2048, 2 * 256, 4 * gemv_norm_sg, 4 * decode_router.ROUTE_NORM_SG]), (name, shared)


def test_the_default_launch_fits_an_sm90_multiprocessor(tmp_path):
    """Its threads times the registers nvcc gives each (sm_90) within the
    65,536 registers a threadgroup may take: more fails at launch."""
    import re
    import shutil
    import subprocess

    from test_toolchain import _mlx_cuda_include

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    include, _ = _mlx_cuda_include(tmp_path)
    D, E = 2048, 256
    gate = (mx.zeros((E, D // 4), mx.uint32), mx.zeros((E, D // 64), mx.bfloat16), mx.zeros((E, D // 64), mx.bfloat16))
    shared = tuple(a[:1] for a in gate)
    source = tmp_path / "router.cu"
    source.write_text(moe_decode_router_kernel.cuda_translation_unit(
        mx.zeros((1, 1, D), mx.bfloat16), mx.zeros((D,), mx.bfloat16), 1e-6, gate, shared, 8, True))
    run = subprocess.run([nvcc, "-std=c++17", "-arch=sm_90a", "-cubin", f"-I{include}", "-Xptxas", "-v",
                          str(source), "-o", str(tmp_path / "router.cubin")], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    registers = int(re.search(r"Used (\d+) registers", run.stderr).group(1))
    threads = decode_router.SIMD_GROUPS * 32
    assert registers * threads <= 65536, (registers, threads)
    assert "cumulative stack" not in run.stderr and "0 bytes spill stores" in run.stderr, run.stderr
