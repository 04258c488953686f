"""The kernel toolchain: backend selection, launches, the lint, the CUDA prelude.

Runs on a CPU. The CUDA prelude is compile-checked with nvcc when nvcc is on
PATH (as MLX's cuda_kernel would generate the translation unit); the subset
probe runs in the CPU emulator when it is importable.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest

from mlx_lily.toolchain import cuda_cache, lint, probe, sources
from mlx_lily.kernels.gated_delta.recurrence import gated_delta_kernel
from mlx_lily.toolchain.registry import BACKEND_ENV, LilyOp, kernel_backend
from mlx_lily.kernels.moe.router import router_topk_kernel
from mlx_lily.toolchain.kernel import Kernel, Launch, whole_threadgroups

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def auto_backend(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.delenv("MLX_LILY_KERNELS", raising=False)


def emulator_or_skip():
    try:
        from mlx_lily.emulator import EmulatorError, metal_kernel  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"the CPU emulator is not importable: {exc}")


# -- backend selection ----------------------------------------------------------


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, None),
        ({BACKEND_ENV: "auto"}, None),
        ({BACKEND_ENV: "emulator"}, "emulator"),
        ({BACKEND_ENV: "EMULATOR"}, "emulator"),
        ({BACKEND_ENV: "reference"}, None),
        ({BACKEND_ENV: "cuda"}, None),
        ({BACKEND_ENV: "bogus"}, None),
        ({BACKEND_ENV: "emulator", "MLX_LILY_KERNELS": "0"}, None),
    ],
)
def test_kernel_backend_on_a_cpu(monkeypatch, auto_backend, env, expected):
    if mx.default_device() == mx.gpu:
        pytest.skip("checks the CPU answers")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    backend, why = kernel_backend()
    assert backend == expected
    assert why  # always says why
    if env.get(BACKEND_ENV) == "bogus":
        assert "bogus" in why


class FakeKernel:
    def __init__(self, ok=True):
        self.ok = ok
        self.calls = 0

    def ready_on(self, backend):
        return self.ok, "fake ready"

    def run_on(self, backend, x):
        self.calls += 1
        return x + 1


def test_op_paths_follow_the_backend(monkeypatch, auto_backend):
    if mx.default_device() == mx.gpu:
        pytest.skip("checks the CPU answers")
    kernel = FakeKernel()
    op = LilyOp("fake", lambda x: x, kernel=kernel, supports=lambda x: None if x.ndim else "scalar")
    x = mx.array([1.0])
    assert op(x).item() == 1.0 and (op.last_path, op.last_reason) == ("reference", "no GPU")
    assert op.planned_path() == ("reference", "no GPU (the reference runs on the CPU)")
    monkeypatch.setenv(BACKEND_ENV, "emulator")
    assert op(x).item() == 2.0 and op.last_path == "kernel"
    assert op.planned_path() == ("kernel", "fake ready")
    assert op(mx.array(1.0)).item() == 1.0 and op.last_reason == "scalar"
    monkeypatch.setenv("MLX_LILY_KERNELS", "0")
    assert op(x).item() == 1.0 and op.last_reason == "MLX_LILY_KERNELS=0"
    monkeypatch.delenv("MLX_LILY_KERNELS")
    monkeypatch.setenv(BACKEND_ENV, "reference")
    assert op(x).item() == 1.0 and op.last_reason == f"{BACKEND_ENV}=reference"
    assert kernel.calls == 1


# -- launches -------------------------------------------------------------------


@pytest.mark.parametrize(
    "grid, group, expected",
    [
        ((32, 1, 1), (128, 1, 1), ((32, 1, 1), (32, 1, 1))),  # MLX clips the group to the grid
        ((160, 1, 1), (64, 1, 1), ((192, 1, 1), (64, 1, 1))),  # whole threadgroups
        ((256, 3, 1), (128, 2, 1), ((256, 4, 1), (128, 2, 1))),
    ],
)
def test_whole_threadgroups(grid, group, expected):
    assert whole_threadgroups(grid, group) == expected


def _copy_launch(x):
    return Launch(
        inputs=[x], grid=(x.size, 1, 1), threadgroup=(48, 1, 1),
        output_shapes=[x.shape], output_dtypes=[x.dtype],
    )


def test_launch_needs_whole_simd_groups_for_simd_bodies():
    body = "uint i = thread_position_in_grid.x;\nfloat s = simd_sum(x[i]);\nout[i] = s;\n"
    kernel = Kernel("needs_simd", ("x",), ("out",), _copy_launch, source=body)
    with pytest.raises(ValueError, match="whole number of 32-lane SIMD groups"):
        kernel.run_on("emulator", mx.zeros((96,)))


def test_kernel_takes_exactly_one_body():
    with pytest.raises(ValueError, match="exactly one"):
        Kernel("none", ("x",), ("out",), _copy_launch)
    with pytest.raises(ValueError, match="exactly one"):
        Kernel("both", ("x",), ("out",), _copy_launch, body="router_topk.metal", source="x;")


def test_a_kernel_that_fails_its_self_check_is_off_with_one_notice(capsys, fresh_notices):
    # Building for CUDA works everywhere; running it on a CPU fails, which is the
    # self-check failing: the kernel is off, the reason says why, one notice.
    failing = Kernel(
        "always_fails", ("x",), ("out",), _copy_launch, source="out[0] = x[0];",
        reference=lambda x: x, sample=lambda: ((mx.zeros((48,)),), {}),
    )
    if mx.default_device() == mx.gpu:
        pytest.skip("needs a device that cannot run CUDA kernels")
    for _ in range(3):
        ok, why = failing.ready_on("cuda")
        assert not ok and why.startswith("cuda")
    err = capsys.readouterr().err
    assert err.count("kernel always_fails is off on cuda") == 1, err


# -- the lint -------------------------------------------------------------------


def test_every_kernel_source_passes_the_lint():
    result = subprocess.run(
        [sys.executable, "-m", "mlx_lily.toolchain.lint"], cwd=ROOT, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert {p.name for p in lint.kernel_sources()} >= {"router_topk.metal", "subset_probe.metal"}


GOOD_LINES = "uint i = thread_position_in_grid.x;\nfloat v = x[i];\n"


@pytest.mark.parametrize(
    "snippet, rule",
    [
        ("__syncthreads();", "cuda-only"),
        ("uint j = threadIdx.x;", "cuda-only"),
        ("uint j = blockIdx.x * blockDim.x;", "cuda-only"),
        ("v = __shfl_xor_sync(0xffffffffu, v, 1);", "cuda-only"),
        ("atomicAdd(&out[0], v);", "cuda-only"),
        ("__shared__ float tile[32];", "cuda-only"),
        ("printf(\"%f\", v);", "printf"),
        ("#include <metal_stdlib>", "directive"),
        ("#pragma unroll", "directive"),
        ("float* p = new float[4];", "dynamic-memory"),
        ("goto done;", "goto"),
        ("v = std::max(v, 0.0f);", "std"),
        ("auto f = [&](float a) { return a; };", "lambda"),
        ("[[maybe_unused]] float w = 0.0f;", "attribute"),
        ("double d = v;", "double"),
        ("texture2d<float> tex;", "metal-only"),
        ("float m = metal::numeric_limits<float>::max();", "metal-only"),
        ("float q = quad_sum(v);", "metal-only"),
        ("uint3 g = grid_size;", "metal-only"),
        ("simdgroup_float8x8 m;", "simdgroup-matrix"),
        ("float s = simd_shuffle_and_fill_down(v, v, 1u);", "simd"),
        ("float e = metal::erf(v);", "metal-ns"),
        ("float f = fract(v);", "metal-builtin"),
        ("float4 q = float4(0.0f);", "vector-constructor"),
        ("float2 q = {v, v}; float2 r = q.yx;", "swizzle"),
        ("half4 h;", "vector-type"),
        ("bfloat b = bfloat(v);", "bfloat"),
        ("v = v * 0.5;", "double-literal"),
        ("v = v * 1e-6;", "double-literal"),
        ("threadgroup float* p;", "threadgroup"),
        ("threadgroup float tile[32] = {0};", "threadgroup"),
        ("if (v > 0.0f) { threadgroup float tile[32]; }", "threadgroup"),
        ("if (i >= 8) { return; }\nthreadgroup_barrier(mem_flags::mem_threadgroup);", "early-return"),
    ],
)
def test_the_lint_rejects(snippet, rule):
    found = lint.lint_source(GOOD_LINES + snippet + "\nout[i] = v;\n", "bad.metal")
    assert rule in {v.rule for v in found}, found
    assert all(v.line >= 3 for v in found if v.rule == rule)


@pytest.mark.parametrize(
    "snippet",
    [
        "v = v * 0.5f + 1.0e-3f + 2.f;  // 0.5 in a comment is fine",
        "uint k = 0x7f800000u + 10u; float s = simd_sum(v);",
        "threadgroup float tile[32];\nthreadgroup atomic_uint counts[4][2];",
        "float4 q = {v, v, v, v}; q = q * 2.0f; v = q.x + q.w;",
        "v = metal::fast::exp(v) + metal::precise::log(v) + metal::max(v, 0.0f);",
        "uint64_t b = static_cast<uint64_t>(simd_ballot(v > 0.0f));",
        "bfloat16_t b = static_cast<bfloat16_t>(v); half h = static_cast<half>(v);",
        "float s = simd_sum(v);\nif (i >= 8) { return; }\nout[i] = s;",
        'const char* name = "__syncthreads";',
    ],
)
def test_the_lint_accepts(snippet):
    assert lint.lint_source(GOOD_LINES + snippet + "\nout[i] = v;\n", "good.metal") == []


def test_the_lint_checks_headers():
    header = (
        "#include <metal_stdlib>\n"
        "float twice(float v) { return twice(v) * 2.0f; }\n"
        "void fill(threadgroup float* t) { t[0] = 0.0f; }\n"
        "#define LILY_TILE 32\n"
    )
    rules = [(v.line, v.rule) for v in lint.lint_source(header, "helpers.metal.h", "header")]
    assert rules == [(1, "directive"), (2, "recursion"), (3, "threadgroup")]


def test_the_lint_cli_reports_file_and_line(tmp_path, capsys):
    bad = tmp_path / "bad.metal"
    bad.write_text("// a kernel\nuint i = threadIdx.x;\nout[i] = x[i];\n")
    assert lint.main([str(bad)]) == 1
    out = capsys.readouterr().out
    assert re.search(r"bad\.metal:2: \[cuda-only\] CUDA-only name 'threadIdx'", out), out
    good = tmp_path / "good.metal"
    good.write_text(GOOD_LINES + "out[i] = v;\n")
    assert lint.main([str(good)]) == 0


def test_the_lint_allowlists_match_the_cuda_prelude():
    prelude = sources.cuda_prelude()
    for name in sorted(lint.SIMD_FUNCTIONS | lint.ATOMIC_NAMES):
        assert re.search(rf"\b{name}\b", prelude), name
    namespaces = {
        "fast": prelude.split("namespace fast {")[1].split("} // namespace fast")[0],
        "precise": prelude.split("namespace precise {")[1].split("} // namespace precise")[0],
        "": prelude.split("} // namespace fast")[1].split("} // namespace metal")[0],
    }
    for qualified in sorted(lint.METAL_MATH):
        flavour, _, name = qualified.rpartition("::")
        assert re.search(rf"\b{name}\b", namespaces[flavour]), qualified
    for vector in sorted(lint.VECTOR_TYPES - {"half2"}):
        assert f", {vector}," in prelude, vector


# -- CUDA: compile the generated translation unit with nvcc ------------------------

# Stand-in for MLX's own device header when the installed MLX does not ship it
# (its CPU wheels do not): the names MLX's generated signature uses.
_STAND_IN_UTILS = "#pragma once\n" + cuda_cache.ABI_HEADER

# Device-memory atomics need atomic_outputs=True on Metal, so they get a body of
# their own (compile-checked only).
_ATOMIC_BODY = """uint i = thread_position_in_grid.x;
if (i < x_shape[0]) {
  atomic_fetch_add_explicit(&total[0], x[i], memory_order_relaxed);
  atomic_fetch_max_explicit(&counts[0], i, memory_order_relaxed);
  atomic_fetch_min_explicit(&counts[1], i, memory_order_relaxed);
  atomic_fetch_or_explicit(&counts[2], 1u << (i % 32u), memory_order_relaxed);
  uint seen = atomic_load_explicit(&counts[3], memory_order_relaxed);
  atomic_compare_exchange_weak_explicit(&counts[3], &seen, seen + 1u, memory_order_relaxed, memory_order_relaxed);
  atomic_exchange_explicit(&counts[4], i, memory_order_relaxed);
  atomic_fetch_sub_explicit(&counts[5], 1u, memory_order_relaxed);
}
"""


def _mlx_cuda_include(tmp_path: Path) -> tuple[Path, str]:
    import mlx

    # LILY_MLX_INCLUDE: a folder holding mlx/backend/cuda/device/utils.cuh (an
    # MLX checkout's root, say) when the installed MLX has no CUDA headers.
    candidates = [os.environ.get("LILY_MLX_INCLUDE", "")]
    candidates += [str(Path(p) / "include") for p in mlx.__path__]
    for root in filter(None, candidates):
        if (Path(root) / "mlx/backend/cuda/device/utils.cuh").exists():
            return Path(root), "MLX's device headers"
    stand_in = tmp_path / "include"
    (stand_in / "mlx/backend/cuda/device").mkdir(parents=True)
    (stand_in / "mlx/backend/cuda/device/utils.cuh").write_text(_STAND_IN_UTILS)
    return stand_in, "a stand-in for MLX's device headers"


def nvcc_ptx(tmp_path: Path, units: dict, *, warnings_ok: bool = True) -> dict:
    """Each CUDA translation unit of ``units`` ({name: source}) compiled by
    nvcc to PTX for sm_90a, all at once: {name: PTX text}. Skips the test
    where nvcc is not on PATH; a unit that does not compile (or, with
    ``warnings_ok=False``, warns) fails it."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    include, which = _mlx_cuda_include(tmp_path)
    runs = {}
    for name, unit in units.items():
        source, ptx = tmp_path / f"{name}.cu", tmp_path / f"{name}.ptx"
        source.write_text(unit)
        runs[name] = (ptx, subprocess.Popen(
            [nvcc, "-std=c++17", "-arch=sm_90a", "-ptx", f"-I{include}", str(source), "-o", str(ptx)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        ))
    texts = {}
    for name, (ptx, run) in runs.items():
        _, stderr = run.communicate()
        assert run.returncode == 0, f"{name}, nvcc with {which}:\n{stderr[-6000:]}"
        if not warnings_ok:
            assert "warning" not in stderr, stderr[-3000:]
        texts[name] = ptx.read_text()
    return texts


def _kernel_section(unit: str) -> str:
    marker = "namespace mlx::core::cu {\n\nnamespace cg"
    return unit[unit.index(marker):]


def test_the_cuda_translation_units_compile_with_nvcc(tmp_path):
    units = [probe.subset_probe_kernel.cuda_translation_unit(probe.subset_probe_input())]
    shapes = [(256, 8, True), (16, 4, False), (8, 2, True), (40, 3, True), (1024, 32, False)]
    for dtype in (mx.bfloat16, mx.float16, mx.float32):
        for experts, k, normalize in shapes:
            units.append(
                router_topk_kernel.cuda_translation_unit(mx.zeros((3, experts), dtype), k, normalize)
            )
    units += _gated_delta_units()
    atomics = Kernel(
        "atomics", ("x",), ("total", "counts"),
        lambda x: Launch([x], (x.size, 1, 1), (32, 1, 1), [(1,), (6,)], [mx.float32, mx.uint32]),
        source=_ATOMIC_BODY, atomic_outputs=True,
    )
    units.append(atomics.cuda_translation_unit(mx.zeros((64,))))
    # One prelude (the first unit's), then every kernel; the router's top-k
    # header once, at global scope, before the kernels that expand it.
    sections = "\n".join(_kernel_section(u) for u in units[1:])
    source = units[0] + router_topk_kernel.header + sections
    text = nvcc_ptx(tmp_path, {"lily_kernels": source}, warnings_ok=False)["lily_kernels"]
    entries = re.findall(r"\.entry (\w+)\(", text)
    assert len(entries) == len(units)
    # The router keeps each lane's probabilities in registers, and the gated
    # delta rule its state row and its q and k.
    for entry, body in zip(entries, re.split(r"\.entry \w+\(", text)[1:]):
        if "router_topk" in entry or "gated_delta" in entry:
            assert "ld.local" not in body and "st.local" not in body, entry


def _gated_delta_units() -> list[str]:
    """The gated delta rule at the real shape, the test models' and Dk=256, per dtype."""
    units = []
    shapes = [(16, 32, 128, 128, True), (2, 4, 32, 32, False), (1, 3, 64, 32, True), (1, 2, 256, 5, False)]
    for dtype in (mx.bfloat16, mx.float16, mx.float32):
        for Hk, Hv, Dk, Dv, with_state in shapes:
            qk = mx.zeros((1, 3, Hk, Dk), dtype)
            gate = mx.zeros((1, 3, Hv), dtype)
            state = mx.zeros((1, Hv, Dv, Dk)) if with_state else None
            units.append(
                gated_delta_kernel.cuda_translation_unit(
                    qk, qk, mx.zeros((1, 3, Hv, Dv), dtype), gate, gate,
                    mx.zeros((Hv,)), mx.zeros((Hv,), dtype), state,
                )
            )
    # Several state rows per SIMD group: the real shape at two, Dk 64 at four.
    for Hk, Hv, Dk, Dv, rows in [(16, 32, 128, 128, 2), (1, 3, 64, 32, 4)]:
        qk = mx.zeros((1, 3, Hk, Dk), mx.bfloat16)
        gate = mx.zeros((1, 3, Hv), mx.bfloat16)
        units.append(
            gated_delta_kernel.cuda_translation_unit(
                qk, qk, mx.zeros((1, 3, Hv, Dv), mx.bfloat16), gate, gate,
                mx.zeros((Hv,)), mx.zeros((Hv,), mx.bfloat16), mx.zeros((1, Hv, Dv, Dk)), rows=rows,
            )
        )
    return units


# -- the subset probe in the emulator ----------------------------------------------


def test_the_subset_probe_runs_right_in_the_emulator():
    emulator_or_skip()
    assert probe.run_subset_probe("emulator") == []


def test_each_distinct_source_gets_its_own_backend_name():
    # MLX caches built kernels by name (on CUDA also on disk, across
    # processes): a changed body under the same name must not reuse a binary.
    def kernel(source, header=""):
        return Kernel(
            name="same_name", input_names=("x",), output_names=("y",),
            source=source, header=header, launch=lambda x: None,
        )

    a = kernel("y[0] = x[0];")
    assert a.backend_name("metal") == kernel("y[0] = x[0];").backend_name("metal")
    assert a.backend_name("metal").startswith("same_name_")
    assert a.backend_name("metal") != kernel("y[0] = 2 * x[0];").backend_name("metal")
    assert a.backend_name("metal") != kernel("y[0] = x[0];", header="// h\n").backend_name("metal")
    # The CUDA build also compiles the prelude, so its name covers it too.
    assert a.backend_name("cuda") != a.backend_name("metal")


# -- each instantiation checked at its first use --------------------------------

# Right for SCALE == 1 (a copy), wrong for any other value: the sample's
# instantiation passes, another one used later must not be trusted.
_SCALED_COPY = """
uint i = thread_position_in_grid.x;
if (i < x_shape[0]) {
  out[i] = static_cast<T>(static_cast<float>(x[i]) * float(SCALE));
}
"""


def _scaled_copy_launch(x, scale):
    return Launch(
        inputs=[x], grid=(x.size, 1, 1), threadgroup=(32, 1, 1),
        output_shapes=[x.shape], output_dtypes=[x.dtype],
        template=[("T", x.dtype), ("SCALE", scale)],
        finish=lambda outputs: outputs[0],
    )


def test_each_instantiation_is_checked_at_first_use(emulator_backend, fresh_notices, capsys):
    references = []

    def reference(x, scale):
        references.append(scale)
        return x

    kernel = Kernel(
        "scaled_copy", ("x",), ("out",), _scaled_copy_launch, source=_SCALED_COPY,
        reference=reference, sample=lambda: ((mx.arange(8, dtype=mx.float32), 1), {}),
    )
    op = LilyOp("scaled_copy_test", reference, kernel=kernel)
    x = mx.arange(40, dtype=mx.float32)
    # The sample's instantiation (SCALE=1): its first use on these inputs is checked once.
    for _ in range(3):
        assert mx.array_equal(op(x, 1), x).item() and op.last_path == "kernel"
    assert references == [1, 1]  # the sample's self-check, then this call's first use
    # SCALE=3 computes x * 3: off at its first use, the call gets the reference's result.
    for _ in range(3):
        assert mx.array_equal(op(x, 3), x).item()
        assert op.last_path == "reference" and "SCALE=3" in op.last_reason
    # Another dtype is another instantiation, checked afresh (and right).
    xb = x.astype(mx.bfloat16)
    assert mx.array_equal(op(xb, 1), xb).item() and op.last_path == "kernel"
    assert op(x, 1) is not None and op.last_path == "kernel"  # SCALE=1 is still on
    lines = [l for l in capsys.readouterr().err.splitlines() if l.startswith("[mlx-lily]")]
    assert len(lines) == 1 and "scaled_copy" in lines[0] and "SCALE=3" in lines[0], lines


def test_a_first_use_inside_a_trace_answers_with_the_reference_and_checks_later(emulator_backend, fresh_notices,
                                                                                  capsys):
    """A first use can come inside mx.compile's trace (a compiled decode step
    whose eager first run left an instantiation unchecked: a reference with
    inf or NaN), where nothing can be evaluated. The reference answers that
    call; the instantiation is not turned off, and the next call outside a
    trace checks it and runs the kernel."""
    kernel = Kernel(
        "scaled_copy_traced", ("x",), ("out",), _scaled_copy_launch, source=_SCALED_COPY,
        reference=lambda x, scale: x * 1, sample=lambda: ((mx.arange(8, dtype=mx.float32), 1), {}),
    )
    op = LilyOp("scaled_copy_traced_test", lambda x, scale: x * 1, kernel=kernel)
    x = mx.arange(40, dtype=mx.float32)
    assert kernel.ready_on("emulator")[0]  # the self-check, eagerly
    from mlx_lily.toolchain import tracing

    met = tracing.first_uses_in_traces()
    traced = mx.compile(lambda x: op(x, 1))
    assert mx.array_equal(traced(x), x).item()
    assert op.last_path == "reference" and "graph transformation" in op.last_reason
    # Named for the compiled step's notice: the kernel and its instance.
    (what,) = tracing.first_uses_met_since(met)
    assert what.startswith("scaled_copy_traced (") and "SCALE=1" in what
    assert not kernel._instances  # no verdict
    assert mx.array_equal(op(x, 1), x).item() and op.last_path == "kernel"
    assert not [l for l in capsys.readouterr().err.splitlines() if "kernel off" in l]


def test_an_input_that_fails_to_evaluate_raises_and_leaves_the_kernel_on(emulator_backend, fresh_notices, capsys):
    """An op's input that the device cannot compute (CPU MLX's float16
    GatherMM) fails as it would on the reference path; the first-use check
    does not blame the kernel, and its next call with good inputs runs it."""
    kernel = Kernel(
        "scaled_copy_bad_input", ("x",), ("out",), _scaled_copy_launch, source=_SCALED_COPY,
        reference=lambda x, scale: x * 1, sample=lambda: ((mx.arange(8, dtype=mx.float32), 1), {}),
    )
    op = LilyOp("scaled_copy_bad_input_test", lambda x, scale: x * 1, kernel=kernel)
    assert kernel.ready_on("emulator")[0]
    a = mx.ones((2, 4, 8), dtype=mx.float16)
    b = mx.ones((3, 8, 4), dtype=mx.float16)
    upstream = mx.gather_mm(a, b, rhs_indices=mx.array([0, 1])).reshape(-1)
    with pytest.raises(RuntimeError, match="GatherMM"):
        mx.eval(op(upstream, 1))
    with pytest.raises(RuntimeError, match="GatherMM"):  # the reference path fails alike
        mx.eval(upstream * 1)
    assert not kernel._instances  # no verdict on the kernel
    x = mx.arange(32, dtype=mx.float16)
    assert mx.array_equal(op(x, 1), x).item() and op.last_path == "kernel"
    assert not [l for l in capsys.readouterr().err.splitlines() if "kernel off" in l]


def test_an_instantiation_that_fails_to_run_falls_back_without_raising(emulator_backend, fresh_notices):
    kernel = Kernel(
        "scaled_copy_bad_group", ("x",), ("out",),
        lambda x, scale: Launch(
            inputs=[x], grid=(x.size, 1, 1), threadgroup=(2048, 1, 1),  # too many threads
            output_shapes=[x.shape], output_dtypes=[x.dtype],
            template=[("T", x.dtype), ("SCALE", scale)], finish=lambda o: o[0],
        ) if scale == 2 else _scaled_copy_launch(x, scale),
        source=_SCALED_COPY, reference=lambda x, scale: x,
        sample=lambda: ((mx.arange(8, dtype=mx.float32), 1), {}),
    )
    op = LilyOp("scaled_copy_bad_group_test", lambda x, scale: x, kernel=kernel)
    x = mx.arange(4096, dtype=mx.float32)
    assert mx.array_equal(op(x, 2), x).item()
    assert op.last_path == "reference" and "threadgroup" in op.last_reason


def test_unknown_kernel_backend_says_so_once(monkeypatch, auto_backend, fresh_notices, capsys):
    # A misspelt backend must not silently run the references.
    monkeypatch.setenv(BACKEND_ENV, "bogus")
    for _ in range(3):
        assert kernel_backend()[0] is None
    err = capsys.readouterr().err
    assert err.count("MLX_LILY_KERNEL_BACKEND='bogus' is not one of") == 1, err
    assert "run their references" in err


# -- the CUDA build's compact source --------------------------------------------------


def test_compact_source_drops_comments_and_keeps_the_program():
    text = (
        "// a comment line\n"
        "#define TWICE(x) \\\n"
        "    ((x) + (x))  // trailing\n"
        "\n"
        "    constexpr int N = 4; /* a block\n"
        "   comment */ int m = N;\n"
        '    asm("mma // not a comment /* either */\\n" : "+f"(d));\n'
        "    char c = '/'; char q = '\"';\n"
    )
    assert sources.compact_source(text) == (
        "#define TWICE(x) \\\n"
        "((x) + (x))\n"
        "constexpr int N = 4;   int m = N;\n"
        'asm("mma // not a comment /* either */\\n" : "+f"(d));\n'
        "char c = '/'; char q = '\"';\n"
    )


def test_the_cuda_build_gets_the_compact_source(monkeypatch):
    seen = {}

    def cuda_kernel(**kwargs):
        seen.update(kwargs)
        return lambda **kw: None

    monkeypatch.setattr(mx.fast, "cuda_kernel", cuda_kernel, raising=False)
    monkeypatch.setattr(sources, "cuda_includes_work", lambda: False)
    gated_delta_kernel.forget()
    try:
        gated_delta_kernel._make("cuda", row_contiguous=True)
        full = gated_delta_kernel.full_header("cuda") + gated_delta_kernel.body_text()
        assert seen["header"] + seen["source"] == (
            sources.compact_source(gated_delta_kernel.full_header("cuda"))
            + sources.compact_source(gated_delta_kernel.body_text()))
        # What MLX hashes at every launch: under two thirds of the commented text.
        assert len(seen["header"]) + len(seen["source"]) < 0.67 * len(full)
        monkeypatch.setenv(sources.FULL_SOURCE_ENV, "1")
        gated_delta_kernel._make("cuda", row_contiguous=True)
        assert seen["header"] + seen["source"] == full
    finally:
        gated_delta_kernel.forget()


def _mlx_shape_infos(source: str, input_names) -> list:
    # What MLX's cuda_kernel derives from the source it is given (a substring search).
    return [tuple(f"{n}{s}" in source for s in ("_shape", "_strides", "_ndim")) for n in input_names]


def test_the_cuda_build_passes_its_text_by_include(monkeypatch, tmp_path):
    seen = {}

    def cuda_kernel(**kwargs):
        seen.update(kwargs)
        return lambda **kw: None

    monkeypatch.setenv("MLX_LILY_CACHE", str(tmp_path))
    monkeypatch.setattr(mx.fast, "cuda_kernel", cuda_kernel, raising=False)
    monkeypatch.setattr(sources, "cuda_includes_work", lambda: True)
    gated_delta_kernel.forget()
    try:
        gated_delta_kernel._make("cuda", row_contiguous=True)
    finally:
        gated_delta_kernel.forget()
    header = sources.compact_source(gated_delta_kernel.full_header("cuda"))
    body = sources.compact_source(gated_delta_kernel.body_text())
    folder = tmp_path / "cuda-sources"
    # Two include lines name files that hold the compacted header and body.
    (header_file,) = re.findall(r'^#include "([^"]+)"$', seen["header"], re.M)
    (body_file,) = re.findall(r'^#include "([^"]+)"$', seen["source"], re.M)
    assert Path(header_file).parent == folder and Path(header_file).read_text() == header
    assert Path(body_file).parent == folder and Path(body_file).read_text() == body
    # MLX passes the same shapes and strides as it would for the body itself.
    names = gated_delta_kernel.input_names
    assert _mlx_shape_infos(seen["source"], names) == _mlx_shape_infos(body, names)
    assert any(any(info) for info in _mlx_shape_infos(body, names))
    # What MLX rebuilds and hashes at every launch: a few hundred bytes, not ~20 KB.
    assert len(seen["header"]) + len(seen["source"]) < 0.05 * (len(header) + len(body))
    # The same text is written once: a second build finds its files; a
    # damaged one is written again, not compiled.
    files = sorted(folder.iterdir())
    Path(body_file).write_text(body[:100])
    gated_delta_kernel._make("cuda", row_contiguous=True)
    gated_delta_kernel.forget()
    assert sorted(folder.iterdir()) == files and len(files) == 2
    assert Path(body_file).read_text() == body


def test_cuda_includes_fall_back_to_inline_text_with_one_notice(monkeypatch, tmp_path, capsys, fresh_notices):
    def broken(**kwargs):
        raise RuntimeError("cannot open source file")

    monkeypatch.setenv("MLX_LILY_CACHE", str(tmp_path))
    monkeypatch.setattr(mx.fast, "cuda_kernel", broken, raising=False)
    sources.cuda_includes_work.cache_clear()
    try:
        assert sources.cuda_includes_work() is False
        assert sources.cuda_includes_work() is False
        err = capsys.readouterr().err
        assert err.count("CUDA kernels get their source inline") == 1 and "cannot open source file" in err
        sources.cuda_includes_work.cache_clear()
        monkeypatch.setenv(sources.CUDA_INCLUDES_ENV, "0")
        assert sources.cuda_includes_work() is False
        assert "inline" not in capsys.readouterr().err  # asked for: no notice
    finally:
        sources.cuda_includes_work.cache_clear()


def test_cuda_kernels_by_include_compile_to_the_same_ptx(tmp_path, monkeypatch):
    monkeypatch.setenv("MLX_LILY_CACHE", str(tmp_path / "cache"))
    from mlx_lily.kernels import OPS

    units = {}
    for name in ("quantized_matvec", "gated_delta_decode", "router_topk"):
        op = OPS[name]
        args, kwargs = op.sample()
        for form in (False, True):
            units[f"{name}_{int(form)}"] = op.kernel.cuda_translation_unit(*args, by_include=form, **kwargs)
    assert all("#include" in units[f"{n}_1"] and len(units[f"{n}_1"]) < len(units[f"{n}_0"]) / 4
               for n in ("quantized_matvec", "gated_delta_decode", "router_topk"))
    ptx = nvcc_ptx(tmp_path, units)
    for name in ("quantized_matvec", "gated_delta_decode", "router_topk"):
        # Internal symbols carry the file's name and a digest of its path.
        same = [re.sub(rf"_[0-9a-f]{{8}}_\d+_{name}_[01]_cu_", "_FILE_", ptx[f"{name}_{form}"])
                for form in (0, 1)]
        assert same[1] == same[0], name


def test_the_cuda_prelude_leaves_out_atomics_only_where_unused():
    full = sources.cuda_prelude()
    assert "atomic_fetch_add_explicit" in full
    without = sources.cuda_prelude("float y = simd_sum(x);")
    assert "atomic_fetch_add_explicit" not in without and "simd_sum" in without
    assert len(without) < len(full)
    assert sources.cuda_prelude("atomic_fetch_add_explicit(&c[0], 1u, memory_order_relaxed);") == full
    # The other sections stay whole and in order.
    assert without == full[:full.index("// Atomics") - 80] + full[full.index("// Math:") - 80:]


def test_every_kernel_computes_the_same_from_its_compact_source(monkeypatch):
    """The GPU builds compile compacted text: run every op's sample in the
    emulator from the compacted body and header, and from the full ones."""
    emulator_or_skip()
    from mlx_lily.kernels import OPS

    def flat(out):
        return [o for o in (out if isinstance(out, (list, tuple)) else [out])]

    def run_all():
        for k in (o for o in __import__("gc").get_objects() if isinstance(o, Kernel)):
            k.forget()
        results = {}
        for name, op in OPS.items():
            if op.kernel is None or op.sample is None:
                continue
            args, kwargs = op.sample()
            results[name] = flat(op.kernel.run_on("emulator", *args, **kwargs))
            mx.eval(results[name])
        return results

    full = run_all()
    body, header = Kernel.body_text, Kernel.full_header
    monkeypatch.setattr(Kernel, "body_text", lambda self, absent=(): sources.compact_source(body(self, absent)))
    monkeypatch.setattr(Kernel, "full_header", lambda self, backend: sources.compact_source(header(self, backend)))
    compact = run_all()
    monkeypatch.undo()
    run_all()  # leave the kernels built from their own text
    assert set(compact) == set(full) and len(full) >= 10
    for name in full:
        for got, want in zip(compact[name], full[name]):
            assert mx.array_equal(got, want, equal_nan=True).item(), name


def test_doctor_says_how_kernels_get_their_source(monkeypatch, tmp_path):
    from mlx_lily import doctor
    from mlx_lily.toolchain import registry

    monkeypatch.setenv("MLX_LILY_CACHE", str(tmp_path))
    monkeypatch.setattr(registry, "kernel_backend", lambda: ("cuda", "test"))
    monkeypatch.setattr(sources, "cuda_includes_work", lambda: True)
    assert doctor.kernel_sources() == (
        f"compacted, by #include from {tmp_path / 'cuda-sources'} (MLX rebuilds and hashes less per launch)")
    monkeypatch.setattr(sources, "cuda_includes_work", lambda: False)
    assert doctor.kernel_sources().startswith("compacted, inline (by #include is off")
    monkeypatch.setattr(registry, "kernel_backend", lambda: ("emulator", "test"))
    assert doctor.kernel_sources() == "emulator: full text"
