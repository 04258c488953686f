"""The decode GEMV with merged projections, fused prologues and the residual
epilogue (quantized_matvec).

In the CPU emulator against the contract at small odd shapes (K 64 to 1088,
rows not multiples of the row blocking, 1 to 4 segments, 4/8-bit mixes, each
prologue, the strided gate view, a strided x, the residual); supports()'s
refusals; the reference against stock's own modules to the bit; the contract
rejecting wrong results; compiled for CUDA with nvcc at the model's shapes.
"""

from __future__ import annotations


import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_lily import kernels as K
from mlx_lily.kernels.linear.gemv import (
    MAX_K,
    precise_reference,
    quantized_matvec_agree,
    quantized_matvec_compare,
    quantized_matvec_kernel,
    quantized_matvec_reference,
    quantized_matvec_supports,
)
from mlx_lily.kernels.linear.testing import gemv_call, gemv_weights

from test_toolchain import emulator_or_skip, nvcc_ptx

# (K, rows per segment, bits per segment, prologue, residual)
CASES = [
    (192, (1,), (4,), "none", False),
    (192, (7,), (8,), "norm", True),
    (320, (33,), (4,), "gate", True),
    (320, (7, 33, 1), (8, 4, 4), "norm", False),
    (192, (33, 1, 7, 5), (4, 8, 8, 4), "gate", False),
    (64, (5, 2), (8, 4), "none", False),
    (1088, (9, 3), (4, 8), "norm", False),  # more than one step of K per lane
]


def check(args, kwargs):
    assert quantized_matvec_supports(*args, **kwargs) is None
    got = quantized_matvec_kernel.emulate(*args, **kwargs)
    want = quantized_matvec_reference(*args, **kwargs)
    mx.eval(got, want)
    mismatch = quantized_matvec_agree(got, want, *args, **kwargs)
    assert mismatch is None, mismatch
    return got, want


@pytest.mark.parametrize("K_, rows, bits, prologue, residual", CASES)
def test_matches_the_reference_in_the_emulator(K_, rows, bits, prologue, residual):
    emulator_or_skip()
    args, kwargs = gemv_call(K_, rows, bits, prologue, residual, seed=K_ + sum(rows))
    got, want = check(args, kwargs)
    assert [g.shape for g in got] == [(1, 1, n) for n in rows]
    assert all(g.dtype == mx.bfloat16 for g in got)
    # Each row is its fp32 sum rounded once: all but a rare few equal the
    # fp32-summed reference's to the bit.
    precise, _ = precise_reference(*args, **kwargs)
    rows = sum(n for n in rows)
    same = sum(int(mx.sum(g == p).item()) for g, p in zip(got, precise))
    assert same >= rows - max(1, rows // 20)


@pytest.mark.parametrize("K_, rows, bits, prologue, residual", CASES)
def test_fp16_matches_the_reference_in_the_emulator(K_, rows, bits, prologue, residual):
    # fp16 activations, scales and biases: judged by the contract's fp16 bound
    # (2^-10 |expected|, one fp16 step, + 2^-12 A; module docstring), and
    # all but a rare few rows equal the fp32-summed reference's to the bit.
    emulator_or_skip()
    args, kwargs = gemv_call(K_, rows, bits, prologue, residual, seed=K_ + sum(rows) + 1, dtype=mx.float16)
    got, want = check(args, kwargs)
    assert all(g.dtype == w.dtype == mx.float16 for g, w in zip(got, want))
    precise, _ = precise_reference(*args, **kwargs)
    n = sum(rows)
    same = sum(int(mx.sum(g == p).item()) for g, p in zip(got, precise))
    assert same >= n - max(1, n // 20)


def test_fp16_rows_are_within_one_fp16_step_of_an_fp32_oracle():
    # The whole call in fp32 from the same fp16 values: the kernel's rows
    # differ by the prologue's fp16 roundings (half a step of each input,
    # 2^-11 A at most in all) and the output's (half a step).
    emulator_or_skip()
    args, kwargs = gemv_call(320, (33, 7), (4, 8), "norm", False, seed=5, dtype=mx.float16)
    got, _ = check(args, kwargs)
    x, weights = args
    f32 = lambda a: a.astype(mx.float32)  # noqa: E731
    oracle = quantized_matvec_reference(
        f32(x), tuple((w, f32(s), f32(b)) for w, s, b in weights), norm_weight=f32(kwargs["norm_weight"]), eps=1e-6)
    _, sizes = precise_reference(*args, **kwargs)
    for g, o, (A, _) in zip(got, oracle, sizes):
        err = mx.abs(f32(g) - o)
        assert mx.all(err <= 2.0**-11 * mx.abs(o) + 2.0**-10 * f32(A)).item()


@pytest.mark.parametrize("rows_per_simdgroup", [1, 2, 4])
@pytest.mark.parametrize("simdgroups", [1, 3, 8, 16])
def test_every_tuning_choice_computes_the_same_rows(rows_per_simdgroup, simdgroups):
    # The launch's tuning choices (bench/diagnostics/tuning/gemv_sweep.py) move rows
    # between SIMD groups and threadgroups, never their sums.
    emulator_or_skip()
    args, kwargs = gemv_call(320, (37, 5, 70), (4, 8, 4), "norm", seed=rows_per_simdgroup + simdgroups)
    tuned = quantized_matvec_kernel.emulate(
        *args, rows_per_simdgroup=rows_per_simdgroup, simdgroups=simdgroups, **kwargs)
    default = quantized_matvec_kernel.emulate(*args, **kwargs)
    assert all(mx.array_equal(t, d).item() for t, d in zip(tuned, default))
    assert quantized_matvec_agree(tuned, quantized_matvec_reference(*args, **kwargs), *args, **kwargs) is None


def test_the_launch_choice_follows_the_rows_on_cuda_only():
    from mlx_lily.kernels.linear.gemv import DEFAULT_LAUNCH, launch_choice

    # The model's calls: router + shared gate, the output projections, the
    # merged input projections (bench/results/2026-11-30-nvidia-h200-ee721d4d52).
    assert launch_choice(257, "cuda") == (1, 16)
    assert launch_choice(1023, "cuda") == (1, 16)
    assert launch_choice(2048, "cuda") == (2, 8)
    assert launch_choice(12352, "cuda") == (4, None)
    assert launch_choice(257, "metal") == launch_choice(12352, None) == DEFAULT_LAUNCH == (4, None)
    args, kwargs = gemv_call(64, (300, 20), (4, 4))
    launch = quantized_matvec_kernel.launch(*args, **kwargs)
    assert ("ROWS", 4) in launch.template  # no GPU here: the default


def test_tuning_choices_out_of_range_are_refused():
    args, kwargs = gemv_call(64, (5,), (4,))
    with pytest.raises(ValueError, match="rows_per_simdgroup"):
        quantized_matvec_kernel.launch(*args, rows_per_simdgroup=8, **kwargs)
    with pytest.raises(ValueError, match="simdgroups"):
        quantized_matvec_kernel.launch(*args, simdgroups=33, **kwargs)


def test_fp32_norm_weight_keeps_fp32_like_stock():
    emulator_or_skip()
    args, kwargs = gemv_call(192, (9,), (4,), "norm", residual=True, norm_dtype=mx.float32, seed=3)
    got, want = check(args, kwargs)
    assert got[0].dtype == want[0].dtype == mx.float32
    args, kwargs = gemv_call(192, (9,), (4,), "norm", residual=True, norm_dtype=mx.float32, seed=3,
                             dtype=mx.float16)
    got, want = check(args, kwargs)
    assert got[0].dtype == want[0].dtype == mx.float32


def test_strided_inputs_are_read_through_their_strides():
    emulator_or_skip()
    args, kwargs = gemv_call(128, (6, 3), (4, 8), "gate", seed=4)
    x, weights = args
    # x and the gate with an inner stride of 2; the gate also half of each row.
    x = mx.repeat(x, 2, axis=-1)[..., ::2]
    wide = mx.repeat(mx.concatenate([kwargs["gate"], kwargs["gate"]], axis=-1), 2, axis=-1)
    kwargs["gate"] = mx.split(wide, 2, axis=-1)[1][..., ::2]
    check((x, weights), kwargs)
    residual = mx.repeat(mx.ones((1, 1, 6), mx.bfloat16), 3, axis=-1)[..., ::3]
    check((x, weights[:1]), {"residual": residual})


def test_a_wrong_result_fails_the_contract():
    args, kwargs = gemv_call(320, (12, 5), (4, 8), "norm", seed=5)
    want = quantized_matvec_reference(*args, **kwargs)
    precise, _ = precise_reference(*args, **kwargs)
    assert quantized_matvec_agree(precise, want, *args, **kwargs) is None
    # One group's scale 50% off in one row.
    x, weights = args
    w, scales, biases = weights[0]
    bumped = mx.array(np.array(scales.astype(mx.float32)))
    bumped[3, 2] = bumped[3, 2] * 1.5
    wrong, _ = precise_reference(x, ((w, bumped.astype(mx.bfloat16), biases), weights[1]), **kwargs)
    assert "segment 0: 1 of 12 rows off, e.g. row 3" in quantized_matvec_agree(wrong, want, *args, **kwargs)
    # No prologue, a zeroed segment, a missing one, the wrong dtype.
    plain, _ = precise_reference(*args)
    assert quantized_matvec_agree(plain, want, *args, **kwargs) is not None
    assert "segment 1" in quantized_matvec_agree((precise[0], precise[1] * 0), want, *args, **kwargs)
    assert "outputs" in quantized_matvec_agree(precise[:1], want, *args, **kwargs)
    as_f32 = tuple(p.astype(mx.float32) for p in precise)
    assert "float32" in quantized_matvec_agree(as_f32, want, *args, **kwargs)
    # doctor's judge, which has no inputs.
    assert quantized_matvec_compare(precise, want)[0]
    assert not quantized_matvec_compare((precise[0] * 1.2, precise[1]), want)[0]


def test_supports_refuses_what_the_kernel_does_not_take():
    args, kwargs = gemv_call(128, (8, 4), (4, 8), seed=6)
    x, weights = args
    assert quantized_matvec_supports(x, weights) is None
    assert "one token" in quantized_matvec_supports(mx.concatenate([x, x], axis=1), weights)
    assert quantized_matvec_supports(mx.concatenate([x, x], axis=0), weights) is None  # B = 2 rows
    assert "at most 16" in quantized_matvec_supports(mx.concatenate([x] * 17, axis=0), weights)
    assert "bfloat16" in quantized_matvec_supports(x.astype(mx.float16), weights)
    w2 = gemv_weights(128, (8,), (2,))
    assert "2-bit" in quantized_matvec_supports(x, w2)
    dense = mx.zeros((8, 128), mx.bfloat16)
    g32 = tuple(mx.quantize(dense, group_size=32, bits=4))
    assert "group 64" in quantized_matvec_supports(x, (g32,))
    assert "triple" in quantized_matvec_supports(x, ((weights[0][0], weights[0][1], None),))
    assert "for K=192" in quantized_matvec_supports(mx.zeros((1, 1, 192), mx.bfloat16), weights)
    assert "scales (8, 2)" in quantized_matvec_supports(x[..., :64], weights)
    assert "1 to 4" in quantized_matvec_supports(x, weights * 3)
    assert "1 to 4" in quantized_matvec_supports(x, ())
    res = mx.zeros((1, 1, 8), mx.bfloat16)
    assert "residual with 2" in quantized_matvec_supports(x, weights, residual=res)
    assert "residual (1, 1, 4)" in quantized_matvec_supports(x, weights[:1], residual=res[..., :4])
    assert "at most one" in quantized_matvec_supports(
        x, weights, norm_weight=mx.ones((128,)), gate=mx.zeros((1, 1, 2, 64), mx.bfloat16)
    )
    assert "G * D" in quantized_matvec_supports(x, weights, gate=mx.zeros((1, 1, 3, 64), mx.bfloat16))
    assert "float16" in quantized_matvec_supports(x, weights, norm_weight=mx.ones((128,), mx.float16))
    assert quantized_matvec_supports(x, weights, norm_weight=mx.ones((128,), mx.float32)) is None
    big = MAX_K + 64
    wide = (mx.zeros((1, big // 8), mx.uint32), mx.zeros((1, big // 64), mx.bfloat16), mx.zeros((1, big // 64), mx.bfloat16))
    assert f"at most {MAX_K}" in quantized_matvec_supports(mx.zeros((1, 1, big), mx.bfloat16), (wide,))
    mid = (mx.zeros((1, 8192 // 8), mx.uint32), mx.zeros((1, 128), mx.bfloat16), mx.zeros((1, 128), mx.bfloat16))
    x8k = mx.zeros((1, 1, 8192), mx.bfloat16)
    assert quantized_matvec_supports(x8k, (mid,), norm_weight=mx.ones((8192,), mx.bfloat16)) is None
    assert "at most 4096" in quantized_matvec_supports(x8k, (mid,), norm_weight=mx.ones((8192,), mx.float32))


def test_the_reference_is_stock_s_modules_to_the_bit():
    rng = np.random.default_rng(7)
    Kd, D = 256, 64
    x = mx.array(rng.standard_normal((1, 1, Kd)).astype(np.float32)).astype(mx.bfloat16)

    def qlinear(n, bits):
        layer = nn.Linear(Kd, n, bias=False)
        layer.weight = mx.array(rng.standard_normal((n, Kd)).astype(np.float32) * 0.05).astype(mx.bfloat16)
        return nn.QuantizedLinear.from_linear(layer, group_size=64, bits=bits)

    def triple(layer):
        return (layer.weight, layer.scales, layer.biases)

    norm = nn.RMSNorm(Kd, eps=1e-6)
    norm.weight = (1 + 0.1 * mx.array(rng.standard_normal(Kd).astype(np.float32))).astype(mx.bfloat16)
    q, k, r = qlinear(48, 4), qlinear(17, 4), qlinear(5, 8)
    got = quantized_matvec_reference(x, (triple(q), triple(k), triple(r)), norm_weight=norm.weight, eps=norm.eps)
    h = norm(x)
    for g, layer in zip(got, (q, k, r)):
        assert mx.array_equal(g, layer(h)).item() and g.dtype == mx.bfloat16
    # Attention's output gate and o_proj with the residual, as stock writes them.
    o = qlinear(40, 4)
    both = mx.array(rng.standard_normal((1, 1, Kd // D, 2 * D)).astype(np.float32)).astype(mx.bfloat16)
    _, gate = mx.split(both, 2, axis=-1)
    resid = mx.array(rng.standard_normal((1, 1, 40)).astype(np.float32)).astype(mx.bfloat16)
    (got,) = quantized_matvec_reference(x, (triple(o),), gate=gate, residual=resid)
    stock = resid + o(x * mx.sigmoid(gate.reshape(1, 1, -1)))
    assert mx.array_equal(got, stock).item()


def test_the_op_returns_one_output_per_projection_and_is_registered():
    assert K.OPS["quantized_matvec"] is K.quantized_matvec
    assert K.quantized_matvec.in_model and K.quantized_matvec.fuzz is not None
    args, kwargs = gemv_call(128, (5, 3), (4, 8), seed=8)
    launch = quantized_matvec_kernel.launch(*args, **kwargs)
    # One output per projection, each already in the op's shape (no view
    # nodes in a decode graph), and none for segments the call lacks: their
    # weights are not passed either.
    assert launch.output_shapes == [(1, 1, 5), (1, 1, 3)]
    assert launch.absent == ("w2", "scales2", "biases2", "out2", "w3", "scales3", "biases3", "out3")
    (x, weights), _ = args, kwargs
    assert launch.inputs[:7] == [x, *weights[0], *weights[1]] and len(launch.inputs) == 12
    outs = [mx.zeros(s) for s in launch.output_shapes]
    a, b = launch.finish(outs)
    assert a is outs[0] and b is outs[1]


def test_each_segment_count_is_its_own_build_with_fewer_arrays(emulator_backend):
    """A call of S projections builds a kernel whose inputs and outputs are
    those of S segments; the names past S are stand-ins in its source."""
    for S in range(1, 5):
        args, kwargs = gemv_call(64, (7,) * S, (4,) * S, seed=S)
        launch = quantized_matvec_kernel.launch(*args, **kwargs)
        names = quantized_matvec_kernel.present(quantized_matvec_kernel.input_names, launch.absent)
        assert len(names) == len(launch.inputs) == 1 + 3 * S + 5
        assert quantized_matvec_kernel.present(quantized_matvec_kernel.output_names, launch.absent) == [
            f"out{s}" for s in range(S)]
        text = quantized_matvec_kernel.body_text(launch.absent)
        assert ("auto out3 = out0;" in text) == (S < 4)
        assert text.count("\n") == quantized_matvec_kernel.body_text().count("\n")  # the body's lines
    assert len({quantized_matvec_kernel.backend_name("metal", quantized_matvec_kernel.launch(
        *gemv_call(64, (7,) * S, (4,) * S)[0]).absent) for S in range(1, 5)}) == 4
    with pytest.raises(ValueError, match="no stand-in for absent norm_weight"):
        quantized_matvec_kernel.body_text(("norm_weight",))


def test_the_op_takes_the_kernel_through_the_registry(emulator_backend, fresh_notices):
    args, kwargs = gemv_call(128, (3, 9), (8, 4), "gate", seed=9)
    got = K.quantized_matvec(*args, **kwargs)
    assert K.quantized_matvec.last_path == "kernel", K.quantized_matvec.last_reason
    assert quantized_matvec_agree(got, quantized_matvec_reference(*args, **kwargs), *args, **kwargs) is None
    # A call the kernel does not take runs the reference, and says why.
    x, weights = args
    K.quantized_matvec(mx.concatenate([x, x], axis=1), weights)
    assert K.quantized_matvec.last_path == "reference" and "one token" in K.quantized_matvec.last_reason


def _zeros_weights(Kd, rows, bits, dtype=mx.bfloat16):
    return tuple(
        (mx.zeros((n, Kd * b // 32), mx.uint32), mx.zeros((n, Kd // 64), dtype), mx.zeros((n, Kd // 64), dtype))
        for n, b in zip(rows, bits)
    )


def test_compiles_for_cuda_without_local_memory(tmp_path):
    x2k, x4k = mx.zeros((1, 1, 2048), mx.bfloat16), mx.zeros((1, 1, 4096), mx.bfloat16)
    norm = {"norm_weight": mx.ones((2048,), mx.bfloat16), "eps": 1e-6}
    calls = {
        # DeltaNet qkv/z/b/a (attention's q/k/v and lm_head differ only in
        # rows, which the kernel reads from its layout input), the router with
        # the shared gate, out_proj and o_proj with the residual, o_proj's gate.
        "deltanet": (x2k, _zeros_weights(2048, (8192, 4096, 32, 32), (4, 4, 4, 4)), norm),
        "router": (x2k, _zeros_weights(2048, (256, 1), (8, 8)), norm),
        "out_proj": (x4k, _zeros_weights(4096, (2048,), (4,)), {"residual": mx.zeros((1, 1, 2048), mx.bfloat16)}),
        "o_proj": (
            x4k,
            _zeros_weights(4096, (2048,), (4,)),
            {
                "gate": mx.split(mx.zeros((1, 1, 16, 512), mx.bfloat16), 2, axis=-1)[1],
                "residual": mx.zeros((1, 1, 2048), mx.bfloat16),
            },
        ),
        "fp32_norm": (x2k, _zeros_weights(2048, (64, 7), (8, 4)), {"norm_weight": mx.ones((2048,)), "eps": 1e-6}),
        # The tuning choices' extremes (bench/diagnostics/tuning/gemv_sweep.py).
        "rows_1": (x2k, _zeros_weights(2048, (8192, 4096, 32, 32), (4, 4, 4, 4)),
                   {**norm, "rows_per_simdgroup": 1, "simdgroups": 16}),
        "rows_2": (x2k, _zeros_weights(2048, (8192, 4096, 32, 32), (4, 4, 4, 4)),
                   {**norm, "rows_per_simdgroup": 2, "simdgroups": 32}),
        # fp16 activations: the norm, the gate and the residual.
        "fp16_norm": (x2k.astype(mx.float16), _zeros_weights(2048, (8192, 4096, 32, 32), (4, 4, 4, 4), mx.float16),
                      {"norm_weight": mx.ones((2048,), mx.float16), "eps": 1e-6}),
        "fp16_o_proj": (
            x4k.astype(mx.float16),
            _zeros_weights(4096, (2048,), (4,), mx.float16),
            {
                "gate": mx.split(mx.zeros((1, 1, 16, 512), mx.float16), 2, axis=-1)[1],
                "residual": mx.zeros((1, 1, 2048), mx.float16),
            },
        ),
    }
    units = {}
    for name, (x, weights, kwargs) in calls.items():
        tuning = ("rows_per_simdgroup", "simdgroups")
        assert quantized_matvec_supports(x, weights, **{k: v for k, v in kwargs.items() if k not in tuning}) is None
        units[name] = quantized_matvec_kernel.cuda_translation_unit(x, weights, **kwargs)
    for name, text in nvcc_ptx(tmp_path, units).items():
        # A lane's values and rows stay in registers; weights move 16 bytes a load.
        assert "ld.local" not in text and "st.local" not in text, name
        assert "ld.global.v4.u32" in text or "ld.global.nc.v4.u32" in text, name


def test_the_sweep_diagnostic_times_every_choice_and_checks_it(tmp_path, monkeypatch):
    emulator_or_skip()
    from bench.diagnostics.tuning import gemv_sweep

    monkeypatch.setattr(gemv_sweep, "CALLS", {"small": (128, (9, 3), (4, 8), "norm", False)})
    monkeypatch.setattr(gemv_sweep, "SIMDGROUPS", (1, 2))
    monkeypatch.setattr(gemv_sweep, "time_call", lambda fn, args, kwargs: {"ms": 0.01})
    monkeypatch.setattr(gemv_sweep, "time_in_graph", lambda fn, args, kwargs: 10.0)
    assert gemv_sweep.main(["--out", str(tmp_path), "--backend", "emulator"]) == 0
    (row,) = __import__("json").loads((tmp_path / "gemv-sweep.json").read_text())["rows"]
    variants = {v for v in row if isinstance(row[v], dict)} - {"copy"}
    assert variants == {"chosen", "r1x1", "r1x2", "r2x1", "r2x2", "r4x1", "r4x2"}
    assert all(row[v]["agrees"] for v in variants)
    assert row["copy"]["gb_s"] > 0 and row["one_eval_us"] > 0
    assert "| small |" in (tmp_path / "gemv-sweep.md").read_text()
    # Batches of x: every choice checked against the contract at B rows.
    assert gemv_sweep.main(["--out", str(tmp_path / "b5"), "--backend", "emulator", "--batch", "5"]) == 0
    data = __import__("json").loads((tmp_path / "b5" / "gemv-sweep.json").read_text())
    (row,) = data["rows"]
    assert data["settings"]["batch"] == row["batch"] == 5 and all(row[v]["agrees"] for v in variants)
    with pytest.raises(SystemExit):
        gemv_sweep.main(["--out", str(tmp_path), "--backend", "emulator", "--batch", "17"])
    # --tiles: the tile kernel's choices beside, where it takes the call (4-bit here).
    monkeypatch.setattr(gemv_sweep, "CALLS", {"small": (128, (9, 3), (4, 8), "norm", False),
                                              "four": (128, (9, 16), (4, 4), "norm", False)})
    assert gemv_sweep.main(["--out", str(tmp_path / "t"), "--backend", "emulator", "--batch", "1,3", "--tiles"]) == 0
    doc = __import__("json").loads((tmp_path / "t" / "gemv-sweep.json").read_text())
    assert doc["settings"]["batch"] == [1, 3] and doc["calls_asked"] == 4
    assert [(r["call"], r["batch"]) for r in doc["rows"]] == [("small", 1), ("small", 3), ("four", 1), ("four", 3)]
    small, four = doc["rows"][1], doc["rows"][3]
    assert not any(v.startswith("tiles") for v in small)
    assert {"tiles1", "tiles2", "tiles4"} <= set(four) and all(four[v]["agrees"] for v in ("tiles1", "tiles4"))
    table = (tmp_path / "t" / "gemv-sweep.md").read_text()
    assert "tiles4" in table and "| four (B = 3) |" in table
    # --no-grid: stock, the chosen launch and the tile form only.
    assert gemv_sweep.main(["--out", str(tmp_path / "n"), "--backend", "emulator", "--calls", "four",
                            "--tiles", "--no-grid"]) == 0
    (row,) = __import__("json").loads((tmp_path / "n" / "gemv-sweep.json").read_text())["rows"]
    assert {v for v in row if isinstance(row[v], dict)} - {"copy"} == {
        "chosen", "tiles1", "tiles2", "tiles4", "tiles4x2", "tiles4x4", "tiles_default"}
    # Several tiles a threadgroup, and the default launch: tiles4's bits.
    assert all(row[v]["same_bits_as_tiles4"] is True for v in ("tiles4x2", "tiles4x4", "tiles_default"))
    # Only the tile form, at one K split: stock, tiles2 and its several-tile launches.
    assert gemv_sweep.main(["--out", str(tmp_path / "o"), "--backend", "emulator", "--calls", "four",
                            "--tiles", "--no-row-gemv", "--tile-splits", "2", "--batch", "16"]) == 0
    (row,) = __import__("json").loads((tmp_path / "o" / "gemv-sweep.json").read_text())["rows"]
    assert {v for v in row if isinstance(row[v], dict)} - {"copy"} == {
        "tiles2", "tiles4x2", "tiles4x4", "tiles_default"}
    assert all(row[v]["agrees"] for v in ("tiles2", "tiles4x2", "tiles4x4", "tiles_default"))
    assert "| four |" in (tmp_path / "o" / "gemv-sweep.md").read_text()
    with pytest.raises(SystemExit):
        gemv_sweep.main(["--out", str(tmp_path), "--backend", "emulator", "--no-row-gemv"])
    # --prologue: the same calls with another prologue (here none instead of the norm).
    assert gemv_sweep.main(["--out", str(tmp_path / "p"), "--backend", "emulator", "--calls", "four",
                            "--tiles", "--no-row-gemv", "--tile-splits", "2", "--prologue", "none"]) == 0
    doc = __import__("json").loads((tmp_path / "p" / "gemv-sweep.json").read_text())
    (row,) = doc["rows"]
    assert row["call"] == "four [none prologue]" and doc["settings"]["prologue"] == "none"
    assert row["tiles2"]["agrees"]
    assert doc["settings"]["tile_splits"] == [2] and doc["settings"]["row_gemv"] is False
    assert doc["settings"]["grid"] is False
    with pytest.raises(SystemExit):  # 8 SIMD groups: CUDA's only
        gemv_sweep.main(["--out", str(tmp_path), "--backend", "emulator", "--tiles", "--tile-splits", "8"])
    with pytest.raises(SystemExit):
        gemv_sweep.main(["--out", str(tmp_path), "--backend", "emulator", "--batch", "1,x"])


def test_a_sweep_variant_that_cannot_launch_is_recorded_not_fatal(tmp_path, monkeypatch):
    # On CUDA a launch of too many threads for the body's registers fails
    # ("too many resources requested for launch"); the sweep goes on.
    emulator_or_skip()
    from bench.diagnostics.tuning import gemv_sweep

    monkeypatch.setattr(gemv_sweep, "CALLS", {"small": (128, (9, 3), (4, 8), "norm", False)})
    monkeypatch.setattr(gemv_sweep, "SIMDGROUPS", (1, 2))
    monkeypatch.setattr(gemv_sweep, "time_call", lambda fn, args, kwargs: {"ms": 0.01})

    def time_in_graph(fn, args, kwargs):
        if (fn.__kwdefaults__ or {}).get("options") == {"rows_per_simdgroup": 4, "simdgroups": 2}:
            raise RuntimeError("too many resources requested for launch")
        return 10.0

    monkeypatch.setattr(gemv_sweep, "time_in_graph", time_in_graph)
    assert gemv_sweep.main(["--out", str(tmp_path), "--backend", "emulator"]) == 0
    (row,) = __import__("json").loads((tmp_path / "gemv-sweep.json").read_text())["rows"]
    assert row["r4x2"]["us"] is None and "too many resources" in row["r4x2"]["error"]
    assert row["r1x1"]["agrees"] and row["best"] != "r4x2"
    table = (tmp_path / "gemv-sweep.md").read_text()
    assert "did not run" in table and "DISAGREES" not in table


def test_the_sweep_keeps_what_it_measured_when_cut_and_takes_a_subset(tmp_path, monkeypatch):
    from bench.diagnostics.tuning import gemv_sweep

    calls = {"first": (128, (9,), (4,), "norm", False), "second": (128, (3,), (8,), "none", False),
             "third": (128, (5,), (4,), "none", False)}
    monkeypatch.setattr(gemv_sweep, "CALLS", calls)
    done = []

    def sweep(name, spec, backend, device_time=False, batch=1, tiles=False, grid=True, tile_splits=None, chosen=True):
        if len(done) == 1:
            raise KeyboardInterrupt  # the run is cut during its second call
        done.append(name)
        return {"call": name, "weight_bytes": 1, "stock_us": 1.0, "one_eval_us": 1.0,
                "copy": {"us": 1.0, "gb_s": 1.0}, "chosen": {"us": 1.0, "gb_s": 1.0, "agrees": True},
                "best": "chosen"}

    monkeypatch.setattr(gemv_sweep, "sweep", sweep)
    with pytest.raises(KeyboardInterrupt):
        gemv_sweep.main(["--out", str(tmp_path), "--backend", "emulator", "--calls", "first,third"])
    doc = __import__("json").loads((tmp_path / "gemv-sweep.json").read_text())
    assert [r["call"] for r in doc["rows"]] == ["first"] and doc["calls_asked"] == 2
    with pytest.raises(SystemExit, match="matches none"):
        gemv_sweep.main(["--out", str(tmp_path), "--backend", "emulator", "--calls", "nothing"])


def test_the_sweep_times_only_the_evaluation_of_calls_built_before():
    from bench.diagnostics.tuning import gemv_sweep

    built = []

    def call(x):
        built.append(1)
        return x + 1

    us = gemv_sweep.time_in_graph(call, (mx.zeros((4,)),), {})
    # One warm-up graph and GRAPHS_TIMED timed ones, each of CALLS_PER_GRAPH calls.
    assert len(built) == gemv_sweep.CALLS_PER_GRAPH * (gemv_sweep.GRAPHS_TIMED + 1)
    assert us > 0


def test_no_call_touches_the_segments_it_leaves_out(emulator_backend, monkeypatch):
    """In the emulator, each left-out name stands for an empty range at the
    start of segment 0's buffer, so any read or write of it would fail as out
    of bounds: calls of 1 to 3 projections, each prologue and the residual,
    still agree with the reference."""
    empty = {n: f"auto {n} = decltype({n[:-1]}0)({n[:-1]}0.p_, {n[:-1]}0.lo_, {n[:-1]}0.lo_);"
             for n in quantized_matvec_kernel.stand_ins}
    quantized_matvec_kernel.forget()
    monkeypatch.setattr(quantized_matvec_kernel, "stand_ins", empty)
    try:
        for S, prologue, residual in ((1, "norm", True), (2, "gate", False), (3, "none", False), (1, "gate", True)):
            args, kwargs = gemv_call(128, (9, 5, 3)[:S], (4, 8, 4)[:S], prologue, residual, seed=20 + S)
            got = quantized_matvec_kernel.emulate(*args, **kwargs)
            want = quantized_matvec_reference(*args, **kwargs)
            assert quantized_matvec_agree(got, want, *args, **kwargs) is None, (S, prologue)
    finally:
        monkeypatch.undo()
        quantized_matvec_kernel.forget()
