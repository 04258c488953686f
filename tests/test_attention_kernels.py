"""The attention kernels in the CPU emulator against float64 attention of the
same bf16 inputs, the op's routing, and their CUDA build with nvcc.

Tolerance: the kernels compute scores, softmax and the weighted sum in fp32
and round the output to bf16 once, so they must be within one bf16 step of the
exact result (2^-7 of the value's binade; a floor of 1% of the largest output
for values that cancel), the same bound as the tiled GEMM's tests.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

import mlx_lily.kernels  # noqa: F401  (registers the ops)
from mlx_lily.toolchain import cuda_cache, lint
from mlx_lily.toolchain.kernel import Kernel, Launch

from test_toolchain import _mlx_cuda_include, emulator_or_skip

A = sys.modules["mlx_lily.kernels.attention.sdpa"]


def attention_exact(q, k, v, scale, mask=None) -> np.ndarray:
    """Softmax attention of the bf16 values in float64; causal aligned at the end."""
    q, k, v = (np.array(a.astype(mx.float32)).astype(np.float64) for a in (q, k, v))
    groups = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, groups, axis=1), np.repeat(v, groups, axis=1)
    s = q @ k.swapaxes(-1, -2) * scale
    if mask == "causal":
        L, S = s.shape[-2:]
        visible = np.arange(S)[None, :] <= np.arange(L)[:, None] + (S - L)
        s = np.where(visible, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v


def assert_within_one_step(got, exact, mantissa_bits: int = 7, name: str = "bf16"):
    """Every element within one rounding step of ``exact`` at ``got``'s
    precision (2^-7 of the value's binade for bf16, 2^-10 for fp16, 8 times
    finer): fp32 scores, softmax and sums are ~1e-6 relative, below either."""
    got = np.array(got.astype(mx.float32)).astype(np.float64)
    assert got.shape == exact.shape
    step = np.maximum(np.abs(exact), 1e-2 * np.abs(exact).max()) * 2.0**-mantissa_bits
    bad = np.abs(got - exact) > step
    assert not bad.any(), (
        f"{int(bad.sum())} of {bad.size} off by more than one {name} step; first at "
        f"{np.argwhere(bad)[0].tolist()}: {got[bad][0]} vs {exact[bad][0]}"
    )


def assert_within_one_bf16_step(got, exact):
    assert_within_one_step(got, exact, 7, "bf16")


def assert_within_one_fp16_step(got, exact):
    assert_within_one_step(got, exact, 10, "fp16")


def decode_inputs(S, Hq, Hkv, D, seed=0, spare=5, dtype=mx.bfloat16):
    """One query token against the first S rows of a cache of S + spare rows:
    the strided view mlx-lm's KVCache hands the attention."""
    keys = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((1, Hq, 1, D), key=keys[0]).astype(dtype)
    cache_k = (2 * mx.random.normal((1, Hkv, S + spare, D), key=keys[1])).astype(dtype)
    cache_v = mx.random.normal((1, Hkv, S + spare, D), key=keys[2]).astype(dtype)
    return q, cache_k[:, :, :S, :], cache_v[:, :, :S, :], D**-0.5


class Spy:
    """Counts a kernel's runs (to see which decode path ran)."""

    def __init__(self, monkeypatch, kernel):
        self.calls = 0
        run_on = kernel.run_on

        def counted(*args, **kwargs):
            self.calls += 1
            return run_on(*args, **kwargs)

        monkeypatch.setattr(kernel, "run_on", counted)


# -- decode ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "S, Hq, Hkv, D",
    [
        (1, 2, 2, 64),     # one key; GQA ratio 1
        (37, 6, 2, 64),    # ratio 3; keys not a multiple of a pass (4 rows x 8 SIMD groups)
        (21, 8, 1, 256),   # ratio 8 at the model's head dim
        (5, 3, 1, 128),    # fewer keys than SIMD groups: most of them see none
        (50, 2, 1, 32),    # 8 rows per pass (the demo checkpoint's head dim)
    ],
)
def test_decode_single_pass_matches_exact_attention(S, Hq, Hkv, D):
    emulator_or_skip()
    q, k, v, scale = decode_inputs(S, Hq, Hkv, D, seed=S + D)
    got = A.run_decode("emulator", q, k, v, scale, None, split_from=1 << 30)
    assert got.shape == (1, Hq, 1, D) and got.dtype == mx.bfloat16
    assert_within_one_bf16_step(got, attention_exact(q, k, v, scale))


@pytest.mark.parametrize("S, Hq, Hkv, D", [(37, 6, 2, 64), (21, 8, 1, 256), (50, 2, 1, 32)])
@pytest.mark.parametrize("split", [False, True])
def test_fp16_decode_matches_exact_attention_and_the_reference(monkeypatch, S, Hq, Hkv, D, split):
    # fp16 queries and cache, single pass and split (three key blocks or more):
    # one fp16 step of the exact (float64) attention of the fp16 inputs, and
    # within attention_agree's fp16 bound (2^-8 of the output's scale) of
    # MLX's sdpa in fp16.
    emulator_or_skip()
    q, k, v, scale = decode_inputs(S, Hq, Hkv, D, seed=S + D + 1, dtype=mx.float16)
    assert A.attention_supports(q, k, v, scale, None) is None
    got = A.run_decode("emulator", q, k, v, scale, None, split_from=1 if split else 1 << 30, key_block=8)
    assert got.shape == (1, Hq, 1, D) and got.dtype == mx.float16
    assert_within_one_fp16_step(got, attention_exact(q, k, v, scale))
    assert A.attention_agree(got, A.attention_reference(q, k, v, scale, None)) is None


def test_fp16_prompt_calls_run_the_reference_and_say_why(emulator_backend):
    # The prefill kernel's matrix tiles multiply bf16 only.
    q, k, v, scale, mask = A._prefill_check_inputs(7, 30, 4, 2, 64)
    q, k, v = (a.astype(mx.float16) for a in (q, k, v))
    why = A.attention_supports(q, k, v, scale, mask)
    assert why is not None and "prefill kernel: bfloat16" in why


@pytest.mark.parametrize(
    "S, Hq, Hkv, D, blocks",
    [
        (8, 8, 1, 256, 1),   # exactly one key block
        (20, 6, 2, 64, 3),   # three blocks, the last partial
        (24, 3, 1, 64, 3),   # three whole blocks
        (17, 8, 2, 64, 3),   # the last block holds a single key
    ],
)
def test_decode_split_matches_exact_attention(monkeypatch, S, Hq, Hkv, D, blocks):
    emulator_or_skip()
    combine = Spy(monkeypatch, A.attention_combine_kernel)
    q, k, v, scale = decode_inputs(S, Hq, Hkv, D, seed=S * 3 + D)
    launch = A._launch_decode(q, k, v, scale, None, split=True, key_block=8)
    assert launch.output_shapes[2] == (Hq, blocks)
    got = A.run_decode("emulator", q, k, v, scale, None, split_from=1, key_block=8)
    assert combine.calls == 1
    assert_within_one_bf16_step(got, attention_exact(q, k, v, scale))


@pytest.mark.parametrize(
    "length, capacity, split",
    [
        (1, 40, True),    # one key; four of five blocks see none
        (19, 45, True),   # a partial block, then empty ones
        (24, 24, True),   # full
        (13, 30, False),  # the single pass stops at the length
    ],
)
def test_a_bounded_decode_reads_only_the_filled_rows(monkeypatch, length, capacity, split):
    """A cache of fixed capacity filled to ``length`` (on the device): rows
    past it hold large values, which any read of them would show."""
    emulator_or_skip()
    combine = Spy(monkeypatch, A.attention_combine_kernel)
    q, k, v, scale, mask, bound = A._bounded_check_inputs(length, capacity, 8, 2, 64)
    split_from = 1 if split else 1 << 30
    got = A.run_decode("emulator", q, k, v, scale, mask, bound, split_from=split_from, key_block=8)
    assert combine.calls == int(split)
    filled = (q, k[:, :, :length], v[:, :, :length], scale)
    assert_within_one_bf16_step(got, attention_exact(*filled))
    # The reference bounds the keys the same way.
    want = A.attention_reference(q, k, v, scale, None, bound)
    assert A.attention_agree(got, want) is None
    # The launch passes the length only when bounded: a build of its own
    # (a start only when batched, a gate only when gated).
    assert A._launch_decode(q, k, v, scale, None, bound).absent_set == ("gate", "start")
    assert A._launch_decode(q, k, v, scale, None).absent_set == ("gate", "length", "start")


def test_the_op_takes_a_length_bound_for_decode_only(emulator_backend):
    q, k, v, scale, _, bound = A._bounded_check_inputs(5, 12, 8, 2, 64)
    assert A.attention_supports(q, k, v, scale, None, bound) is None
    assert "no mask" in A.decode_supports(q, k, v, scale, "causal", bound)
    assert "int32 lengths" in A.decode_supports(q, k, v, scale, None, bound.astype(mx.int64))
    assert A.attention_supports(q, k, v, scale, "causal", bound) is not None
    with pytest.raises(ValueError, match="takes no mask"):  # not a silently dropped mask
        A.attention(q, k, v, scale, "causal", length=bound)
    prefill = mx.concatenate([q, q], axis=2)
    assert "decode only" in A.attention_supports(prefill, k, v, scale, None, bound)


@pytest.mark.parametrize("S, split", [(15, False), (16, True), (17, True)])
def test_the_split_starts_at_the_threshold(monkeypatch, S, split):
    # The module's threshold and block, made small so the emulator reaches them.
    emulator_or_skip()
    monkeypatch.setattr(A, "SPLIT_FROM", 16)
    monkeypatch.setattr(A, "KEY_BLOCK", 8)
    combine = Spy(monkeypatch, A.attention_combine_kernel)
    q, k, v, scale = decode_inputs(S, 8, 2, 64, seed=S)
    got = A.run_decode("emulator", q, k, v, scale, None)
    assert combine.calls == int(split)
    assert_within_one_bf16_step(got, attention_exact(q, k, v, scale))


@pytest.mark.parametrize(
    "S, Hkv, block",
    [
        (1024, 2, 64),     # 32 threadgroups: the smallest block
        (4096, 2, 64),     # 128 threadgroups
        (4097, 2, 128),    # one key more would make 130 at 64
        (8192, 2, 128),    # 128 threadgroups at 128 keys
        (8193, 2, 256),    # from here on the fixed block (64 threadgroups here)
        (16384, 2, 256),   # 128 threadgroups at the fixed block
        (32768, 2, 256),   # more, whatever the count
        (131072, 2, 256),
        (4096, 8, 256),    # more KV heads: larger blocks sooner
    ],
)
def test_the_decode_key_block_spreads_a_context_over_the_threadgroups(S, Hkv, block):
    assert A.decode_key_block(S, Hkv) == block
    assert A.MIN_KEY_BLOCK <= block <= A.KEY_BLOCK


def test_decode_reads_a_transposed_cache_element_by_element():
    # A layout whose dims are not contiguous takes the body's unaligned path.
    emulator_or_skip()
    keys = mx.random.split(mx.random.key(4), 3)
    q = mx.random.normal((1, 4, 1, 64), key=keys[0]).astype(mx.bfloat16)
    k = mx.random.normal((1, 2, 64, 11), key=keys[1]).astype(mx.bfloat16).swapaxes(2, 3)
    v = mx.random.normal((1, 2, 64, 11), key=keys[2]).astype(mx.bfloat16).swapaxes(2, 3)
    for split_from in (1 << 30, 1):
        got = A.run_decode("emulator", q, k, v, 0.125, None, split_from=split_from, key_block=4)
        assert_within_one_bf16_step(got, attention_exact(q, k, v, 0.125))


def test_decode_kernel_sees_the_cache_view_in_place():
    # row_contiguous=False: the emulator passes the view's own strides (as MLX
    # does), so the body reads rows S_alloc apart per head, not a copy.
    q, k, v, _ = decode_inputs(6, 2, 2, 64, spare=10)
    assert A.attention_decode_kernel.row_contiguous is False
    launch = A._launch_decode(q, k, v, 0.125, None)
    assert launch.inputs[1] is k and launch.inputs[2] is v
    probe = Kernel(
        "strides_probe", ("keys",), ("out",),
        lambda x: Launch([x], (32, 1, 1), (32, 1, 1), [(4,)], [mx.int32]),
        source="uint i = thread_position_in_grid.x;\nif (i < 4) { out[i] = int(keys_strides[i]); }\n",
        row_contiguous=False,
    )
    emulator_or_skip()
    assert np.array(probe.emulate(k)[0]).tolist() == [2 * 16 * 64, 16 * 64, 64, 1]


def test_causal_mask_with_one_query_sees_every_key():
    emulator_or_skip()
    q, k, v, scale = decode_inputs(13, 4, 2, 64, seed=2)
    got = A.run_decode("emulator", q, k, v, scale, "causal")
    assert_within_one_bf16_step(got, attention_exact(q, k, v, scale, "causal"))


# -- prefill ------------------------------------------------------------------------


def assert_prefill_close(got, exact, v):
    # One bf16 step, plus P's rounding to bf16 before P V: each weight moves
    # by at most 2^-9 of itself, so the output by at most 2^-9 max|v| (2^-8 kept).
    got = np.array(got.astype(mx.float32)).astype(np.float64)
    step = np.maximum(np.abs(exact), 1e-2 * np.abs(exact).max()) * 2.0**-7
    slack = 2.0**-8 * np.abs(np.array(v.astype(mx.float32))).max()
    bad = np.abs(got - exact) > step + slack
    assert not bad.any(), f"{int(bad.sum())} of {bad.size}; max error {np.abs(got - exact).max()}"


@pytest.mark.parametrize(
    "L, S, Hq, Hkv, D, mask",
    [
        (11, 45, 4, 2, 64, "causal"),   # a chunk after 34 cached keys; keys not a multiple of 32
        (5, 5, 8, 1, 64, None),         # GQA 8, no mask
        (40, 70, 6, 2, 64, "causal"),   # GQA 3: 21 positions per threadgroup, 2 threadgroups
        (3, 20, 2, 1, 256, "causal"),   # the model's head dim
        (70, 70, 1, 1, 32, "causal"),   # GQA 1: 64 positions per threadgroup; a whole causal prompt
    ],
)
def test_prefill_matches_exact_attention(L, S, Hq, Hkv, D, mask):
    emulator_or_skip()
    q, k, v, scale, _ = A._prefill_check_inputs(L, S, Hq, Hkv, D, seed=L + S)
    got = A.run_prefill("emulator", q, k, v, scale, mask)
    assert got.shape == (1, Hq, L, D) and got.dtype == mx.bfloat16
    assert_prefill_close(got, attention_exact(q, k, v, scale, mask), v)


def test_prefill_reads_a_transposed_cache_element_by_element():
    emulator_or_skip()
    keys = mx.random.split(mx.random.key(6), 3)
    q = mx.random.normal((1, 4, 6, 64), key=keys[0]).astype(mx.bfloat16)
    k = mx.random.normal((1, 2, 64, 37), key=keys[1]).astype(mx.bfloat16).swapaxes(2, 3)
    v = mx.random.normal((1, 2, 64, 37), key=keys[2]).astype(mx.bfloat16).swapaxes(2, 3)
    got = A.run_prefill("emulator", q, k, v, 0.125, "causal")
    assert_prefill_close(got, attention_exact(q, k, v, 0.125, "causal"), v)


# -- the op --------------------------------------------------------------------------


def test_the_op_routes_decode_to_its_kernel(emulator_backend, monkeypatch):
    emulator_or_skip()
    A.attention_kernels.forget()
    q, k, v, scale = decode_inputs(12, 8, 2, 64, seed=1)
    fn, path, why = A.attention.choose(q, k, v, scale, None)
    assert path == "kernel", why
    assert "decode" in why and "self-check passed" in why
    got = A.attention(q, k, v, scale, None)
    assert A.attention.last_path == "kernel"
    assert_within_one_bf16_step(got, attention_exact(q, k, v, scale))
    # The kernel agrees with the reference too (its self-check's contract).
    assert A.attention_agree(got, A.attention_reference(q, k, v, scale, None)) is None
    # A prefill chunk takes the prefill kernel.
    q, k, v, scale, mask = A._prefill_check_inputs(7, 30, 8, 2, 64)
    assert "prefill" in why and A.attention_supports(q, k, v, scale, mask) is None
    got = A.attention(q, k, v, scale, mask)
    assert A.attention.last_path == "kernel"
    assert_prefill_close(got, attention_exact(q, k, v, scale, mask), v)


@pytest.mark.parametrize("backend", ["cuda", "metal", "emulator"])
def test_large_prefill_calls_take_mlx_s_fused_sdpa_on_cuda_only(backend):
    few = A._prefill_check_inputs(A.CUDA_REFERENCE_QUERIES - 1, 256, 16, 2, 64)
    small = A._prefill_check_inputs(256, 256, 16, 2, 64)
    large = A._prefill_check_inputs(2048, 4096, 16, 2, 64)
    assert small[0].shape[2] * small[1].shape[2] < A.CUDA_PREFILL_REFERENCE_FROM
    # The kernels take all three (capability); the choice is per backend.
    assert all(A.attention_supports(*x) is None for x in (few, small, large))
    assert A.attention_prefers_reference(backend, *few) is None
    # On CUDA every call from 64 queries takes sdpa (a query's bits then do
    # not depend on its call: prefix reuse), and every call that large.
    for x in (small, large):
        why = A.attention_prefers_reference(backend, *x)
        assert (why is not None and "fused sdpa" in why) if backend == "cuda" else why is None
    # Decode keeps its kernel, however long the cache.
    q, k, v, scale = decode_inputs(40000, 16, 2, 64, seed=2)
    assert A.attention_prefers_reference(backend, q, k, v, scale, None) is None


def test_the_op_runs_the_reference_where_it_prefers_it(monkeypatch):
    monkeypatch.setattr(A.attention, "prefers_reference", lambda backend, *a: "measured faster")
    monkeypatch.setattr(A.attention_kernels, "ready_on", lambda backend: (True, "ready"))
    monkeypatch.setenv("MLX_LILY_KERNEL_BACKEND", "emulator")
    q, k, v, scale, mask = A._prefill_check_inputs(7, 30, 8, 2, 64)
    fn, path, why = A.attention.choose(q, k, v, scale, mask)
    assert (fn, path, why) == (A.attention_reference, "reference", "measured faster")


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda q, k, v: (q.astype(mx.float32), k.astype(mx.float32), v.astype(mx.float32), None), "bfloat16"),
        (lambda q, k, v: (q.astype(mx.float16), k, v, None), "dtypes"),
        (lambda q, k, v: (q, k, v, mx.zeros((1, 1, 1, k.shape[2]), mx.bfloat16)), "explicit mask"),
        (lambda q, k, v: (mx.concatenate([q, q], 0), mx.concatenate([k, k], 0),
                          mx.concatenate([v, v], 0), None), "batch"),
        (lambda q, k, v: (q[..., :48], k[..., :48], v[..., :48], None), "head dims"),
        (lambda q, k, v: (mx.concatenate([q] * 9, 1), k[:, :1], v[:, :1], None), "query heads"),
        (lambda q, k, v: (mx.concatenate([q, q], 2), k[:, :, :1], v[:, :, :1], "causal"), "fewer keys"),
    ],
)
def test_the_op_declines_what_its_kernels_do_not_take(emulator_backend, change, reason):
    q, k, v, scale = decode_inputs(12, 8, 2, 64, seed=1)
    q, k, v, mask = change(q, k, v)
    why = A.attention_supports(q, k, v, scale, mask)
    assert why is not None and reason in why, why
    # Unsupported calls run the reference.
    got = A.attention_kernels.run_on("emulator", q, k, v, scale, mask)
    assert mx.array_equal(got, A.attention_reference(q, k, v, scale, mask)).item()


def test_a_failing_path_turns_off_with_the_reference_kept(monkeypatch, fresh_notices, capsys):
    emulator_or_skip()
    kernels = A.AttentionKernels()

    def broken(backend, *args, **kwargs):
        return A.attention_reference(*args[:3], args[3] * 2, *args[4:])  # a wrong scale

    monkeypatch.setattr(A, "run_decode", broken)
    ok, why = kernels.ready_on("emulator")
    # The prefill path still passes; decode is off with one notice.
    assert ok and "prefill" in why and "decode" not in why
    assert "kernel attention (decode) is off" in capsys.readouterr().err
    q, k, v, scale = decode_inputs(12, 8, 2, 64, seed=1)
    got = kernels.run_on("emulator", q, k, v, scale, None)
    assert mx.array_equal(got, A.attention_reference(q, k, v, scale, None)).item()


# -- portability -------------------------------------------------------------------


def test_the_attention_bodies_are_in_the_portable_subset():
    bodies = [k.body for k in (A.attention_decode_kernel, A.attention_combine_kernel, A.attention_prefill_kernel)]
    assert lint.lint_paths(bodies) == []


@pytest.mark.parametrize("prefetch", [2, 4])
def test_decode_gives_the_same_bits_whatever_passes_it_fetches_ahead(prefetch, monkeypatch):
    # DECODE_PREFETCH moves loads earlier, not a score or an update: the
    # single pass, the split (bounded by a length inside the capacity) and
    # the batched rows give the bits they give at 1.
    emulator_or_skip()
    rng = np.random.default_rng(prefetch)

    def arr(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.bfloat16)

    q, k, v = arr(1, 8, 1, 128), arr(1, 2, 77, 128), arr(1, 2, 77, 128)
    qs, ks, vs = arr(1, 16, 1, 256), arr(1, 2, 1024, 256), arr(1, 2, 1024, 256)
    qb, kb, vb = arr(3, 16, 1, 256), arr(3, 2, 1024, 256), arr(3, 2, 1024, 256)
    calls = [
        lambda: A.run_decode("emulator", q, k, v, 128 ** -0.5, None),
        lambda: A.run_decode("emulator", qs, ks, vs, 0.0625, None, length=mx.array([300], mx.int32)),
        lambda: A.run_decode("emulator", qb, kb, vb, 0.0625, None, length=mx.array([300], mx.int32),
                             start=mx.array([0, 7, 200], mx.int32)),
    ]
    want = [call() for call in calls]
    monkeypatch.setattr(A, "DECODE_PREFETCH", prefetch)
    for i, call in enumerate(calls):
        assert mx.array_equal(call(), want[i]).item(), i


def test_the_attention_kernels_compile_with_nvcc_and_fit_their_threadgroups(tmp_path):
    # ptxas must keep everything in registers (no stack frame: queries,
    # accumulators and row words are register arrays indexed by unrolled
    # loops), and a threadgroup's registers must fit an SM's 64K, or the
    # launch fails on the GPU.
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not on PATH")
    include, which = _mlx_cuda_include(tmp_path)
    units, threads = [], {}
    for D, Hq in ((256, 16), (128, 8), (64, 6), (256, 2)):
        q = mx.zeros((1, Hq, 1, D), mx.bfloat16)
        k = mx.zeros((1, 2, 64, D), mx.bfloat16)
        for split in (False, True):
            launch = A._launch_decode(q, k, k, 0.1, None, split=split)
            suffix = cuda_cache.template_suffix(launch.template)
            threads[f"attention_decode_{suffix}"] = launch.threadgroup[0]
            units.append(A.attention_decode_kernel.cuda_translation_unit(q, k, k, 0.1, None, split=split))
        prefill_q = mx.zeros((1, Hq, 2048, D), mx.bfloat16)
        launch = A._launch_prefill(prefill_q, k, k, 0.1, "causal")
        suffix = cuda_cache.template_suffix(launch.template)
        threads[f"attention_prefill_{suffix}"] = launch.threadgroup[0]
        units.append(A.attention_prefill_kernel.cuda_translation_unit(prefill_q, k, k, 0.1, "causal"))
        combine = A.attention_combine_kernel.cuda_translation_unit(mx.zeros((Hq, 3, D)), mx.zeros((Hq, 3)))
        if combine not in units:  # one per head dim
            units.append(combine)
    # fp16 decode at the model's shape: both forms and the combine.
    q, k = mx.zeros((1, 16, 1, 256), mx.float16), mx.zeros((1, 2, 64, 256), mx.float16)
    for split in (False, True):
        launch = A._launch_decode(q, k, k, 0.1, None, split=split)
        threads["attention_decode_" + cuda_cache.template_suffix(launch.template)] = launch.threadgroup[0]
        units.append(A.attention_decode_kernel.cuda_translation_unit(q, k, k, 0.1, None, split=split))
    units.append(A.attention_combine_kernel.cuda_translation_unit(
        mx.zeros((16, 3, 256)), mx.zeros((16, 3)), mx.float16))
    # The model's shape with four passes of keys and values fetched ahead.
    q, k = mx.zeros((1, 16, 1, 256), mx.bfloat16), mx.zeros((1, 2, 64, 256), mx.bfloat16)
    held, A.DECODE_PREFETCH = A.DECODE_PREFETCH, 4
    try:
        for split in (False, True):
            launch = A._launch_decode(q, k, k, 0.1, None, split=split)
            threads["attention_decode_" + cuda_cache.template_suffix(launch.template)] = launch.threadgroup[0]
            units.append(A.attention_decode_kernel.cuda_translation_unit(q, k, k, 0.1, None, split=split))
    finally:
        A.DECODE_PREFETCH = held
    assert_units_fit(units, threads, tmp_path / "attention", include, which)


def assert_units_fit(units, threads, stem, include, which):
    """nvcc (sm_90a) builds the translation units into one cubin: every entry
    without a stack frame, and every launch's threadgroup (``threads``: the
    kernel's name and template suffix -> threads) within an SM's 64K registers."""
    nvcc = shutil.which("nvcc")
    marker = "namespace mlx::core::cu {\n\nnamespace cg"
    source = stem.with_suffix(".cu")
    source.write_text(units[0] + "\n".join(u[u.index(marker):] for u in units[1:]))
    result = subprocess.run(
        [nvcc, "-std=c++17", "-arch=sm_90a", "-cubin", "-Xptxas", "-v", f"-I{include}",
         str(source), "-o", str(stem.with_suffix(".cubin"))],
        capture_output=True, text=True,
    )
    assert result.returncode == 0, f"nvcc with {which}:\n{result.stderr[-6000:]}"
    entries = re.findall(
        r"Compiling entry function '(\w+)'.*?(\d+) bytes stack frame.*?Used (\d+) registers",
        result.stderr, re.S,
    )
    assert len(entries) == len(units), result.stderr
    checked = 0
    for entry, stack, registers in entries:
        assert stack == "0", (entry, result.stderr)
        for name, count in threads.items():
            # The digest sits between the kernel's name and its template suffix.
            pattern = re.sub(r"^(attention_(?:decode|prefill))_", r"\1_[0-9a-f]+", name)
            if re.search(pattern + "E", entry):
                assert (int(registers) + 7) // 8 * 8 * count <= 65536, (entry, registers, count)
                checked += 1
    assert checked == len(threads)
