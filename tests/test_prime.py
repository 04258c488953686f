"""Priming at load: every kernel instance a server's requests meet is built
(and first-use checked) before the first request, not in the middle of one."""

from __future__ import annotations

import gc

import pytest
import mlx_lily
from mlx_lily import backend, warmup
from mlx_lily.kernels.gated_delta.recurrence import CHUNKED_FROM
from mlx_lily.kernels.linear.gemv import BATCH_BUCKETS
from mlx_lily.kernels.moe.routing import TILE_ROWS, tile_rows_for
from mlx_lily.toolchain.kernel import Kernel


def launched() -> set:
    return {(k.name,) + key for k in gc.get_objects() if isinstance(k, Kernel) for key in k.launched}


def serve(model, prompts, max_tokens=3, prefill_step_size=2048, rows=4):
    """Run prompts as mlx_lm.server does, through mlx-lm's BatchGenerator, to
    their last token."""
    steps = warmup.run_batch(model, prompts, max_tokens, prefill_step_size, rows=rows)
    assert steps >= max_tokens  # decode steps ran, not only the prefill


@pytest.mark.parametrize("experts,top_k", [(256, 8), (8, 2), (16, 4), (24, 3), (512, 10)])
def test_chunk_lengths_meet_every_tile_and_both_recurrences(experts, top_k):
    lengths = warmup.chunk_lengths(experts, top_k)
    tiles = [tile_rows_for(n * top_k, experts) for n in lengths]
    assert sorted(tiles) == sorted(TILE_ROWS)
    assert lengths[0] >= CHUNKED_FROM  # the chunked form without a state
    assert lengths[-1] < CHUNKED_FROM  # the sequential form with one


def forget_launches():
    for k in (o for o in gc.get_objects() if isinstance(o, Kernel)):
        k.launched.clear()


def test_priming_covers_a_servers_requests(demo_checkpoint, emulator_backend, monkeypatch):
    monkeypatch.delenv(warmup.PRIME_ENV, raising=False)
    monkeypatch.setattr(backend, "_program", "mlx_lm.server")  # as `python -m mlx_lily serve` records it
    forget_launches()
    model, tokenizer = mlx_lily.load(str(demo_checkpoint), backend="lily")
    primed = launched()
    tiles = {dict(key[2]).get("TILE_M") for key in primed if key[0] == "moe_gate_up"}
    assert tiles == set(TILE_ROWS)
    states = {(dict(key[2])["HAS_STATE"], dict(key[2])["HAS_MASK"]) for key in primed if key[0] == "gated_delta"}
    # The server's caches give every call a padding mask; chunks long enough
    # for the chunked kernels drop it when it masks nothing, shorter ones
    # keep it (the sequential recurrence with a mask, with and without a state).
    assert {(False, True), (True, True)} <= states
    # The batched decode step at every row bucket of its GEMV (the decode
    # batches ran to their last token, not only their prefill).
    buckets = {dict(key[2]).get("BATCH") for key in primed if key[0] == "quantized_matvec"}
    assert set(BATCH_BUCKETS) <= buckets

    # Single requests at each tile size, then a batch of mixed lengths.
    ids = lambda n: [(7 * i) % 400 + 3 for i in range(n)]  # noqa: E731
    for n in (5, 70, 200):
        serve(model, [ids(n)])
    # A prompt longer than a prefill step: its later chunks (the short tail
    # too) carry a state and the server's masks; at the real shapes a 4K
    # prompt's 10-token tail.
    serve(model, [ids(430)], prefill_step_size=210)
    serve(model, [ids(37), ids(150), ids(3)])
    # Batches of every size up to 16, mixed lengths (each size in its own bucket's kernels).
    for rows in (3, 6, 11, 16):
        serve(model, [ids(4 + 5 * r) for r in range(rows)], rows=rows)
    assert launched() - primed == set()


def test_priming_for_generate_covers_its_calls(demo_checkpoint, emulator_backend, monkeypatch):
    # MLX_LILY_PRIME=1 in another program: mlx_lm.generate's caches (no masks).
    from mlx_lm import generate
    from mlx_lm.models.cache import make_prompt_cache

    monkeypatch.setenv(warmup.PRIME_ENV, "1")
    monkeypatch.setattr(backend, "_program", "mlx_lm.generate")
    forget_launches()
    model, tokenizer = mlx_lily.load(str(demo_checkpoint), backend="lily")
    primed = launched()
    states = {(dict(key[2])["HAS_STATE"], dict(key[2])["HAS_MASK"]) for key in primed if key[0] == "gated_delta"}
    assert {(False, False), (True, False)} <= states  # generate's caches: no masks
    blocks = {(dict(key[2])["SPLIT"], dict(key[2])["BLOCK"]) for key in primed if key[0] == "attention_decode"}
    assert {(False, 0), (True, 64), (True, 128), (True, 256)} <= blocks  # (the self-check adds its own)
    # The whole decode step's forms: bounded, split by its cache's capacity.
    bounded = {dict(key[2])["BLOCK"] for key in primed if key[0] == "attention_decode" and dict(key[2])["BOUNDED"]}
    assert {64, 128, 256} <= bounded
    ids = [(7 * i) % 400 + 3 for i in range(430)]
    for n, step in ((5, 2048), (200, 2048), (430, 210)):
        generate(model, tokenizer, ids[:n], max_tokens=3, prompt_cache=make_prompt_cache(model),
                 prefill_step_size=step)
    assert launched() - primed == set()


def test_the_servers_decode_attention_is_not_the_decode_kernels():
    # Why server priming makes no attention decode calls: a request's decode
    # step carries its BatchKVCache's array mask, which the kernel leaves to sdpa.
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from mlx_lily.kernels.attention.sdpa import decode_supports

    cache = KVCache().merge([KVCache()])
    kv = mx.zeros((1, 2, 5, 64), mx.bfloat16)
    cache.update_and_fetch(kv, kv)
    mask = cache.make_mask(1)
    assert isinstance(mask, mx.array)
    q = mx.zeros((1, 4, 1, 64), mx.bfloat16)
    assert decode_supports(q, kv, kv, 0.1, mask) == "an explicit mask (decode kernel: none, or causal)"


@pytest.mark.parametrize("kv_heads", [1, 2, 8])
def test_decode_contexts_meet_every_attention_decode_form(kv_heads):
    from mlx_lily.kernels.attention.sdpa import decode_form

    def form(n):
        return decode_form(n, kv_heads)

    contexts = warmup.decode_contexts(kv_heads)
    assert len({form(n) for n in contexts}) == len(contexts)
    assert {form(n) for n in range(1, 1 << 18, 97)} <= {form(n) for n in contexts}


def test_prime_is_asked_for_by_the_server_or_the_environment(monkeypatch):
    monkeypatch.delenv(warmup.PRIME_ENV, raising=False)
    assert warmup.requested("mlx_lm.server")
    assert not warmup.requested("mlx_lm.generate")
    assert not warmup.requested(None)
    monkeypatch.setenv(warmup.PRIME_ENV, "0")
    assert not warmup.requested("mlx_lm.server")
    monkeypatch.setenv(warmup.PRIME_ENV, "1")
    assert warmup.requested(None)


def test_a_failed_prime_is_a_notice_and_the_model_loads(demo_checkpoint, monkeypatch, capsys, fresh_notices):
    monkeypatch.setenv(warmup.PRIME_ENV, "1")

    def broken(model, log=None, server=True):
        raise RuntimeError("no room")

    monkeypatch.setattr(warmup, "prime", broken)
    model, _ = mlx_lily.load(str(demo_checkpoint), backend="lily")
    assert model is not None
    err = capsys.readouterr().err
    assert "priming the kernels failed (RuntimeError: no room)" in err


def test_nothing_to_prime_on_the_reference_path(demo_checkpoint, monkeypatch):
    monkeypatch.setenv("MLX_LILY_KERNEL_BACKEND", "reference")
    model, _ = mlx_lily.load(str(demo_checkpoint), backend="lily")
    assert warmup.prime(model) is None


def test_priming_records_no_paths():
    from mlx_lily import call_trace

    call_trace.start()
    try:
        call_trace.record(layer="before")
        with call_trace.paused():
            call_trace.record(layer="primed")
            assert not call_trace.active()
        call_trace.record(layer="after")
        assert [r["layer"] for r in call_trace.seen()] == ["before", "after"]
    finally:
        call_trace.stop()


@pytest.mark.parametrize("argv,orig,program", [
    (["/usr/bin/mlx_lm.server", "--model", "m"], None, "mlx_lm.server"),
    (["/usr/bin/mlx_lm", "server", "--port", "8080"], None, "mlx_lm.server"),
    (["-m", "--model", "m"], ["python", "-m", "mlx_lm.server", "--model", "m"], "mlx_lm.server"),
    (["/usr/bin/mlx_lm.generate", "--prompt", "hi"], None, "mlx_lm.generate"),
])
def test_the_hook_names_the_mlx_lm_program(monkeypatch, argv, orig, program):
    import sys

    import mlx_lily_hook

    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "orig_argv", orig or ["python"] + argv)
    assert mlx_lily_hook._program_name() == program


def test_doctor_says_whether_the_server_primes(monkeypatch):
    from mlx_lily.doctor import server_priming

    monkeypatch.setenv("MLX_LILY_KERNEL_BACKEND", "reference")
    assert server_priming().startswith("nothing to prime")
    monkeypatch.setenv("MLX_LILY_KERNEL_BACKEND", "emulator")
    monkeypatch.delenv(warmup.PRIME_ENV, raising=False)
    assert "at load, under mlx_lm.server" in server_priming()
    monkeypatch.setenv(warmup.PRIME_ENV, "1")
    assert "in every program" in server_priming()
    monkeypatch.setenv(warmup.PRIME_ENV, "0")
    assert server_priming().startswith("not primed")


def test_python_m_mlx_lily_serve_counts_as_the_server(monkeypatch):
    import sys

    import mlx_lm.server

    from mlx_lily import __main__ as cli
    from mlx_lily import backend

    seen = []
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the command rewrites it
    monkeypatch.setattr(mlx_lm.server, "main", lambda: seen.append(backend.current_program()))
    monkeypatch.setattr(backend, "_program", None)
    was = backend.is_enabled()
    try:
        cli.main(["serve", "--model", "m"])
    finally:
        backend.enable() if was else backend.disable()
    assert seen == ["mlx_lm.server"]
    monkeypatch.delenv(warmup.PRIME_ENV, raising=False)
    assert warmup.requested(backend.current_program())


def test_priming_covers_long_prompts_arriving_together(tmp_path_factory, emulator_backend, monkeypatch):
    # Prompts of CHUNKED_FROM tokens and more arriving together run their
    # DeltaNet recurrences as one batch (gated_delta_rows: its own kernel
    # instance and self-check), on a model the chunked kernels take.
    from mlx_lily.kernels.gated_delta.rows import gated_delta_rows_kernel
    from mlx_lily.random_checkpoints import make_checkpoint

    monkeypatch.delenv(warmup.PRIME_ENV, raising=False)
    monkeypatch.setattr(backend, "_program", "mlx_lm.server")
    forget_launches()
    gated_delta_rows_kernel.forget()
    path = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "dk64",
                           shape={"linear_key_head_dim": 64, "linear_value_head_dim": 64})
    model, _ = mlx_lily.load(str(path), backend="lily")
    primed = launched()
    from mlx_lily.kernels.gated_delta.rows import gated_delta_rows
    assert any(key[0] == "gated_delta_chunk_prepare" and dict(key[2])["ROW_LENGTHS"] for key in primed), (gated_delta_rows.last_path, gated_delta_rows.last_reason)
    ids = lambda n, r: [(7 * i + r) % 400 + 3 for i in range(n)]  # noqa: E731
    serve(model, [ids(CHUNKED_FROM + 40, 0), ids(3 * CHUNKED_FROM, 1), ids(CHUNKED_FROM + 2, 2)], rows=3)
    assert launched() - primed == set()


def test_each_progress_line_says_where_its_time_went(demo_checkpoint, emulator_backend, monkeypatch):
    """Priming's progress lines carry each step's seconds and its kernels'
    first-use checks (kernels and references), and the steps' seconds add
    up to the whole."""
    import re

    from mlx_lily.toolchain.kernel import KERNELS

    # As in a fresh process: no instance checked yet (tests before this one in
    # the same process may have met every instance priming meets).
    for kernel in KERNELS.values():
        monkeypatch.setattr(kernel, "_instances", {})
    model, _ = mlx_lily.load(str(demo_checkpoint), backend="lily")
    lines = []
    assert warmup.prime(model, log=lines.append, server=True) is not None
    steps = [line for line in lines if line.startswith("  primed")]
    assert len(steps) >= 4 + len(warmup.PRIME_BATCHES)
    here = []
    for line in steps:
        found = re.search(r"; ([0-9.]+)s here; ([0-9]+) first-use checks: kernels ([0-9.]+)s, references ([0-9.]+)s",
                          line)
        assert found, line
        here.append(float(found.group(1)))
    total = float(re.search(r"primed in ([0-9.]+)s", lines[-1]).group(1))
    assert abs(sum(here) - total) <= 0.1 * len(here) + 0.5
    # Every kernel instance is checked at its first use: some step checked some.
    assert any(int(re.search(r"([0-9]+) first-use checks", line).group(1)) > 0 for line in steps)


def test_a_step_s_costs_name_compiles_and_first_uses_inside_traces(monkeypatch):
    from mlx_lily.toolchain import tracing

    # The process's counters, as they were, once the test is over.
    monkeypatch.setattr(tracing, "FIRST_USE_TIME", type(tracing.FIRST_USE_TIME)())
    monkeypatch.setattr(tracing, "_FIRST_USES_IN_TRACES", [0])
    monkeypatch.setattr(tracing, "_FIRST_USES_MET", [])
    costs = warmup._PhaseCosts()
    tracing.FIRST_USE_TIME.add(2.0, 0.5)
    tracing.count_first_use_in_trace("moe_decode_down (T=bfloat16)")
    said = costs.take()
    assert "1 first-use checks: kernels 2.0s, references 0.5s" in said and "1 first uses inside traces" in said
    assert "modules compiled" not in said  # no CUDA here: lily's module cache compiles nothing
    assert "0 first-use checks" in costs.take() and "inside traces" not in costs.take()


def test_a_step_s_costs_count_the_kernels_mlx_compiled_into_its_ptx_folder(monkeypatch, tmp_path, request):
    """On CUDA: the modules (.ptx; MLX also writes a .txt and a .cu beside each)
    MLX wrote to its PTX folder during the step, but lily's custom kernels."""
    from mlx_lily.toolchain import cuda_cache

    monkeypatch.setattr(warmup, "kernel_backend", lambda: ("cuda", None))
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    cuda_cache.ptx_dir.cache_clear()  # it keeps the folder it found first
    request.addfinalizer(cuda_cache.ptx_dir.cache_clear)
    assert cuda_cache.ptx_dir() == tmp_path
    (tmp_path / "gather_uint32_uint32_1.ptx").write_text("")
    costs = warmup._PhaseCosts()
    for name in ("scatter_axis_bfloat16_1", "compiled_fused_abc", "custom_kernel_gemv_0123_bfloat16"):
        for suffix in (".ptx", ".txt", ".cu"):
            (tmp_path / (name + suffix)).write_text("")
    (tmp_path / ("x" * 245)).mkdir()  # a long name: folders, the module's .ptx inside
    (tmp_path / ("x" * 245) / "tail.ptx").write_text("")
    assert "3 of MLX's own kernels compiled" in costs.take()
    assert "MLX's own" not in costs.take()
    for path in tmp_path.glob("*.ptx"):  # the folder emptied: no count below zero
        path.unlink()
    assert "MLX's own" not in costs.take()
    monkeypatch.setattr(warmup, "kernel_backend", lambda: ("emulator", None))
    (tmp_path / "more.ptx").write_text("")
    assert "MLX's own" not in warmup._PhaseCosts().take()
