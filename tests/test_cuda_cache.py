"""Lily's CUDA kernel cache (toolchain/cuda_cache.py), on a CPU: the module
names MLX 0.32 looks for, the sources it generates, the record of instances
and the parallel precompile (with NVRTC stood in for). The cache itself, with
NVRTC and MLX loading what lily wrote, runs in tests/gpu/test_cuda_cache_gpu.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_lily.kernels  # noqa: F401  (registers the ops and their kernels)
from mlx_lily.kernels.linear.gemv import quantized_matvec_kernel
from mlx_lily.toolchain import cuda_cache
from mlx_lily.toolchain.kernel import KERNELS
from mlx_lily.toolchain.kernel import Kernel, Launch

_HASH_PROGRAM = r"""
#include <cstdio>
#include <functional>
#include <string>
int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) printf("%zu\n", std::hash<std::string>{}(std::string(argv[i])));
}
"""

# libstdc++'s std::hash<std::string> on x86-64 Linux, for these strings.
_KNOWN_HASHES = {
    b"": 6142509188972423790,
    b"a": 4993892634952068459,
    b"hello": 2762169579135187400,
    b"12345678": 10113836418918046885,
    b"123456789abcdefgh": 10280977052341072324,
}


def test_std_hash_is_libstdcxx_hash():
    for text, expected in _KNOWN_HASHES.items():
        assert cuda_cache.std_hash(text) == expected, text


def test_std_hash_agrees_with_the_compiler_at_hand(tmp_path):
    """Every tail length (0..7 bytes past whole words) and a long text,
    against std::hash compiled here, where a C++ compiler exists."""
    compiler = shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler")
    program = tmp_path / "hash.cpp"
    program.write_text(_HASH_PROGRAM)
    subprocess.run([compiler, "-O1", str(program), "-o", str(tmp_path / "hash")], check=True)
    texts = ["x" * n for n in range(1, 17)] + ["namespace mlx::core::cu {\n" * 50]
    out = subprocess.run([str(tmp_path / "hash"), *texts], check=True, capture_output=True, text=True).stdout
    assert [int(v) for v in out.split()] == [cuda_cache.std_hash(t.encode()) for t in texts]


def test_template_suffix_uses_mlx_type_names():
    template = [("T", mx.bfloat16), ("H", mx.float16), ("F", mx.float32), ("I", mx.uint32), ("N", 7),
                ("B", True), ("C", False)]
    assert cuda_cache.template_suffix(template) == "_bfloat16_t_float16_t_float_uint32_t_7_t_f"


def test_generated_source_is_mlx_layout():
    source = cuda_cache.generated_source(
        "custom_kernel_k_1", "// header\n", "out[0] = x[x_strides[0]];", ["x", "w"], [2, 0], ["out", "o2"],
        [mx.float32, mx.int32], [mx.bfloat16, mx.float16], [("T", mx.float32), ("N", 1), ("B", False)])
    assert source == (
        '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
        "// header\nnamespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        "__global__ void custom_kernel_k_1(\n"
        "    const __nv_bfloat16* x,\n    const __grid_constant__ Strides x_strides,\n"
        "    const __half* w,\n"
        "    float* out,\n    int32_t* o2) {\n"
        "  using T = float;\n  constexpr int N = 1;\n  constexpr bool B = false;\n\n"
        "out[0] = x[x_strides[0]];\n}\n\n} // namespace mlx::core::cu\n")


def test_long_module_names_become_folders(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    cuda_cache.ptx_dir.cache_clear()
    try:
        assert cuda_cache.module_path("short") == tmp_path / "short.ptx"
        name = "m" * 245 + "n" * 245 + "tail"
        assert cuda_cache.module_path(name) == tmp_path / ("m" * 245) / ("n" * 245) / "tail.ptx"
    finally:
        cuda_cache.ptx_dir.cache_clear()


def test_an_instance_survives_its_record():
    launch = Launch(inputs=[mx.zeros((2, 3), mx.bfloat16), mx.zeros((4,), mx.uint32)], grid=(32, 1, 1),
                    threadgroup=(32, 1, 1), output_shapes=[(2,)], output_dtypes=[mx.float32],
                    template=[("T", mx.bfloat16), ("N", 3), ("B", True)])
    instance = cuda_cache.Instance.of(quantized_matvec_kernel, launch)
    assert cuda_cache.Instance.from_json(json.loads(json.dumps(instance.to_json()))) == instance


class _FakeNvrtc:
    """NVRTC stood in for: the 'code' is the source it was given."""

    def __init__(self):
        self.sources = []
        self.lock = threading.Lock()

    def compile(self, source, expression, file_name):
        with self.lock:
            self.sources.append(source)
        return source.encode(), "lowered_" + expression.rsplit(":", 1)[-1]


@pytest.fixture
def fake_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    monkeypatch.setenv("MLX_LILY_CACHE", str(tmp_path / "lily"))
    cuda_cache.ptx_dir.cache_clear()
    monkeypatch.setattr(cuda_cache, "SHIPPED_INSTANCES", tmp_path / "shipped.json")
    cache = cuda_cache.ModuleCache(workers=4)
    cache._nvrtc = _FakeNvrtc()
    yield cache
    cuda_cache.ptx_dir.cache_clear()


def _toy_kernel(name: str, body: str) -> Kernel:
    return Kernel(name, ("x",), ("out",), lambda x, n: Launch(
        inputs=[x], grid=(x.size, 1, 1), threadgroup=(32, 1, 1), output_shapes=[x.shape],
        output_dtypes=[x.dtype], template=[("T", x.dtype), ("N", n)]), source=body)


def test_a_module_is_compiled_once_and_written_where_mlx_reads_it(fake_cache):
    kernel = _toy_kernel("cache_toy", "uint i = thread_position_in_grid.x; out[i] = x[i] + T(N);")
    instance = cuda_cache.Instance.of(kernel, kernel.launch(mx.zeros((8,)), 2))
    function, source = kernel.cuda_function(instance)
    assert function == "custom_kernel_" + kernel.backend_name("cuda") + "_float_2"
    futures = [fake_cache.submit(function, source) for _ in range(3)]
    for f in futures:
        f.result()
    assert fake_cache.compiled == 1 and len(fake_cache._nvrtc.sources) == 1
    # Lily's compile: the ABI header in place of MLX's device headers, the rest MLX's to the byte.
    assert fake_cache._nvrtc.sources[0] == cuda_cache.ABI_HEADER + source[len(cuda_cache.MLX_DEFAULT_HEADER):]
    module = f"{function}_{cuda_cache.std_hash(source.encode()):x}"
    path = cuda_cache.module_path(module)
    assert path.read_bytes() == fake_cache._nvrtc.sources[0].encode()
    assert path.with_suffix(".txt").read_text() == f"mlx::core::cu::{function}\tlowered_{function}\n"
    # Another process (another cache object) finds it.
    other = cuda_cache.ModuleCache(workers=1)
    other._nvrtc = _FakeNvrtc()
    other.submit(function, source).result()
    assert other.found == 1 and other.compiled == 0 and not other._nvrtc.sources


def test_recorded_instances_are_precompiled_by_the_next_process(fake_cache):
    kernel = _toy_kernel("cache_toy_record", "uint i = thread_position_in_grid.x; out[i] = x[i] * T(N);")
    kernels = {kernel.name: kernel}
    launches = [kernel.launch(mx.zeros((8,), dtype), n) for dtype in (mx.float32, mx.bfloat16) for n in (1, 2)]
    for launch in launches:
        instance = cuda_cache.Instance.of(kernel, launch)
        fake_cache.submit(*kernel.cuda_function(instance)).result()
        fake_cache.record(instance)
        fake_cache.record(instance)  # once per instance
    assert len(json.loads(cuda_cache.instances_file().read_text())) == 4
    # MLX's folder emptied (a reboot clears /tmp): the next process compiles
    # every recorded instance ahead of its first launch, in parallel.
    shutil.rmtree(cuda_cache.ptx_dir())
    nxt = cuda_cache.ModuleCache(workers=4)
    nxt._nvrtc = _FakeNvrtc()
    nxt.precompile(kernels)
    nxt.precompile(kernels)  # started once per process
    for launch in launches:
        nxt.submit(*kernel.cuda_function(cuda_cache.Instance.of(kernel, launch))).result()
    assert nxt.precompiled == 4 and nxt.compiled == 4 and len(nxt._nvrtc.sources) == 4


def test_precompile_skips_changed_kernels_and_damaged_entries(fake_cache, tmp_path):
    kernel = _toy_kernel("cache_toy_changed", "uint i = thread_position_in_grid.x; out[i] = x[i];")
    entry = cuda_cache.Instance.of(kernel, kernel.launch(mx.zeros((8,)), 1)).to_json()
    stale = dict(entry, build=entry["build"] + "0")  # recorded from another version of the body
    cuda_cache.SHIPPED_INSTANCES.write_text(json.dumps([stale, {"kernel": kernel.name}, "junk"]))
    fake_cache.precompile({kernel.name: kernel})
    assert fake_cache.precompiled == 0 and not fake_cache._nvrtc.sources


def test_the_shipped_record_names_current_kernels():
    """The instances shipped for a first run are of kernels this version has;
    an entry whose body changed since is skipped (its launch compiles it)."""
    entries = cuda_cache.read_instances(cuda_cache.SHIPPED_INSTANCES)
    assert entries, f"{cuda_cache.SHIPPED_INSTANCES} is missing or empty"
    current = 0
    for entry in entries:
        instance = cuda_cache.Instance.from_json(entry)
        assert instance.to_json() == entry
        assert instance.kernel in KERNELS, instance.kernel
        kernel = KERNELS[instance.kernel]
        current += kernel.backend_name("cuda", instance.absent) == instance.build
    # Kernels changed since the record was made compile at their first use,
    # as without the record; say so when most of it is stale.
    assert current >= len(entries) // 2, f"{len(entries) - current} of {len(entries)} shipped instances are stale: " \
        "record them again (python -m bench.diagnostics.tuning.first_instances --against ... --write)"


def test_the_cache_is_off_with_its_switch(monkeypatch):
    monkeypatch.setenv(cuda_cache.CACHE_ENV, "0")
    assert cuda_cache._make_cache() is None
