"""Prompt cache files on lily (mlx_lily/prefix_files.py, mlx_lily/cache_prompt.py).

Each file is written by the command line (``python -m mlx_lily cache-prompt``,
on lily or stock) and used as users use it: ``python -m mlx_lily generate
--prompt-cache-file``, or a prompt cache entry that a diverging request
resumes from. Every continuation is checked against the same continuation
computed in-process, bit for bit (reference path).
"""

from __future__ import annotations

import importlib
import random
import sys

import mlx.core as mx
import mlx_lm.utils as mlx_utils
import pytest
from mlx_lm.models.cache import LRUPromptCache, load_prompt_cache, make_prompt_cache, save_prompt_cache
from test_prefix_reuse import (  # noqa: F401
    KEY, assert_same_bits, cache_arrays, installed, lily, reused_and_cold, serve,
)

import mlx_lily
from mlx_lily import backend, cache_prompt
from mlx_lily import prefix_files as pf
from mlx_lily import prefix_reuse as pr
from mlx_lily.__main__ import main
from mlx_lily.toolchain.registry import BACKEND_ENV

mlx_generate = importlib.import_module("mlx_lm.generate")  # the module (mlx_lm.generate is also a function)
generate_step = mlx_generate.generate_step  # stock's, whatever a test spies on
TEXT = "the quick brown fox jumps over the lazy dog and runs far away " * 3


@pytest.fixture
def cli(monkeypatch):
    """``python -m mlx_lily ARGS`` in this process (reference path); returns
    its exit message (None when it finished). The backend, the program name,
    argv and the cache_prompt hooks are put back afterwards."""
    monkeypatch.setenv(BACKEND_ENV, "reference")
    monkeypatch.setattr(mlx_utils, "load_model", mlx_utils.load_model)
    monkeypatch.setattr(backend, "_program", None)
    monkeypatch.setattr(sys, "argv", list(sys.argv))

    def run(*argv):
        try:
            main([str(a) for a in argv])
        except SystemExit as exc:
            return exc.code
        return None

    yield run
    cache_prompt.uninstall()


def prompt_tokens(tokenizer):
    """The tokens mlx_lm.cache_prompt prefills for TEXT."""
    return tokenizer.apply_chat_template([{"role": "user", "content": TEXT}], add_generation_prompt=False,
                                         continue_final_message=True)


def prefill(model, tokens, step=2048):
    """cache_prompt's prefill, in-process."""
    cache = make_prompt_cache(model)
    for _ in generate_step(mx.array(tokens), model, max_tokens=0, prompt_cache=cache,
                                        prefill_step_size=step):
        pass
    return cache


def spy_generate_step(monkeypatch):
    """What ``generate`` continues with: the prompt (suffix), its settings,
    each step's log-probs."""
    seen = {"logprobs": []}
    stock = generate_step

    def spy(prompt, model, *args, **kwargs):
        seen["prompt"], seen["args"], seen["kwargs"] = prompt, args, dict(kwargs)
        for y, logprobs in stock(prompt, model, *args, **kwargs):
            seen["logprobs"].append(logprobs)
            yield y, logprobs

    monkeypatch.setattr(mlx_generate, "generate_step", spy)
    return seen


def continue_in_process(model, cache, seen):
    kwargs = {k: v for k, v in seen["kwargs"].items() if k != "prompt_cache"}
    return [lp for _, lp in generate_step(seen["prompt"], model, *seen["args"], prompt_cache=cache, **kwargs)]


@pytest.mark.parametrize("writer", ["mlx", "lily"])
def test_a_cache_prompt_file_continues_on_lily_as_in_process(writer, cli, demo_checkpoint, tmp_path, monkeypatch):
    path = tmp_path / f"{writer}.safetensors"
    assert cli("cache-prompt", "--backend", writer, "--model", demo_checkpoint, "--prompt-cache-file", path,
               "--prompt", TEXT) is None
    _, metadata = load_prompt_cache(str(path), return_metadata=True)
    assert metadata["model"] == str(demo_checkpoint) and (pf.FORMAT_KEY in metadata) == (writer == "lily")

    seen = spy_generate_step(monkeypatch)
    assert cli("generate", "--model", demo_checkpoint, "--prompt-cache-file", path, "--prompt", "and then",
               "--max-tokens", "4") is None
    assert len(seen["logprobs"]) == 4 and seen["prompt"].size > 0

    # In-process: the writer's model prefills the same prompt as cache_prompt
    # did, lily's continues with the same suffix and settings.
    lily_model, tokenizer = mlx_lily.load(str(demo_checkpoint), backend="lily")
    writer_model = lily_model if writer == "lily" else mlx_lily.load(str(demo_checkpoint), backend="mlx")[0]
    cache = prefill(writer_model, prompt_tokens(tokenizer))
    for got, want in zip(seen["logprobs"], continue_in_process(lily_model, cache, seen), strict=True):
        assert got.dtype == want.dtype and mx.array_equal(got, want).item()


def test_cache_prompt_on_lily_writes_checkpoints_a_diverging_request_resumes_from(
        cli, demo_checkpoint, lily, installed, tmp_path):  # noqa: F811 - fixtures
    step = 16
    path = tmp_path / "prompt.safetensors"
    assert cli("cache-prompt", "--model", demo_checkpoint, "--prompt-cache-file", path, "--prompt", TEXT,
               "--prefill-step-size", step) is None
    _, tokenizer = mlx_lily.load(str(demo_checkpoint), backend="lily")
    prefix = prompt_tokens(tokenizer)
    assert len(prefix) > 3 * step

    # The file: stock's loader reads the caches of an in-process prefill, bit
    # for bit; lily's also reads the tokens and a checkpoint at each chunk end.
    expected = prefill(lily, prefix, step)
    for a, b in zip(cache_arrays(load_prompt_cache(str(path))), cache_arrays(expected), strict=True):
        assert a.shape == b.shape and mx.array_equal(a, b).item()
    tokens, cache, cks = pf.load_cache_file(path, lily)
    assert tokens == prefix
    cold = pr.cold_cuts(len(prefix), None, step)
    assert [c.position for c in cks] == cold and {c.step for c in cks} == {step}
    assert [c.cuts for c in cks] == [tuple(cold[: i + 1]) for i in range(len(cold))]

    # A prompt cache entry made from it: requests diverging inside the cached
    # prompt resume at the last checkpoint before the divergence; one that
    # extends it, at the last checkpoint on its grid. Each equals a cold prefill.
    lru = LRUPromptCache(max_size=10)
    pr.add_entry(lru, KEY, tokens, cache, cks)
    rng = random.Random(11)
    for d in (5, 40, len(prefix) - 3, len(prefix)):
        prompt = prefix[:d] + [rng.randrange(1, 500) for _ in range(7)]
        got, cold = reused_and_cold(lily, lru, prompt, step)
        assert got[0] == max([p for p in pr.cold_cuts(len(prompt), None, step) if p <= d and p % step == 0],
                             default=0)
        assert_same_bits(got, cold)


def test_cache_prompt_keeps_the_states_after_its_last_whole_chunk(cli, demo_checkpoint, lily, installed,
                                                                  tmp_path):  # noqa: F811 - fixtures
    # One prefill call (the default 2048-token chunks) ending inside a
    # 64-token chunk: the file also holds the states after its last whole
    # chunk, and a request diverging past them resumes there, bit for bit a
    # cold prefill.
    path = tmp_path / "prompt.safetensors"
    assert cli("cache-prompt", "--model", demo_checkpoint, "--prompt-cache-file", path, "--prompt", TEXT) is None
    tokens, cache, cks = pf.load_cache_file(path, lily)
    n = len(tokens)
    cut = (n - 1) // 64 * 64
    assert n - 1 > 64 and (n - 1) % 64, "TEXT's prefill should end inside a chunk"
    assert [c.position for c in cks] == [cut, n - 1]
    assert [c.cuts for c in cks] == [(cut,), (n - 1,)]
    lru = LRUPromptCache(max_size=10)
    pr.add_entry(lru, KEY, tokens, cache, cks)
    rng = random.Random(12)
    prompt = tokens[: cut + 3] + [rng.randrange(1, 500) for _ in range(70)]
    got, cold = reused_and_cold(lily, lru, prompt, 2048)
    assert got[0] == cut
    assert_same_bits(got, cold)


def test_files_of_another_model_or_format_are_refused_in_one_line(cli, demo_checkpoint, alt_checkpoint, lily,
                                                                   tmp_path):  # noqa: F811 - fixture
    other, _ = mlx_lily.load(str(alt_checkpoint), backend="lily")
    tokens = list(range(1, 30))
    other_cache = prefill(other, tokens)
    # The same model path, another model's states (weights replaced since):
    # lily's file by its fingerprint, stock's by its layers' shapes.
    claims = {"model": str(demo_checkpoint), "tokenizer_config": "{}"}
    lily_file, stock_file = tmp_path / "lily-other.safetensors", tmp_path / "stock-other.safetensors"
    pf.save_cache_file(lily_file, other, tokens, other_cache, metadata=claims)
    save_prompt_cache(str(stock_file), other_cache, claims)
    junk, old = tmp_path / "junk.safetensors", tmp_path / "old.safetensors"
    junk.write_bytes(b"not a file")
    mx.save_safetensors(str(old), {"cache.0.0": mx.zeros(3)}, {"format": "lily-prefix-checkpoints/1"})
    refusals = {lily_file: "made with another model", stock_file: "states are", junk: "not a prompt cache file",
                old: "an earlier lily format"}
    for path, words in refusals.items():
        said = cli("generate", "--model", demo_checkpoint, "--prompt-cache-file", path, "--prompt", "hi",
                   "--max-tokens", "1")
        assert isinstance(said, str) and words in said and str(path) in said and "\n" not in said
        with pytest.raises(pf.PromptCacheFileError, match=words) as refused:
            (pf.load_cache_file if path != stock_file else pf.check_file)(path, lily)
        assert "\n" not in str(refused.value)
    # Stock's own loader still reads lily's file (its caches: the other model's).
    for a, b in zip(cache_arrays(load_prompt_cache(str(lily_file))), cache_arrays(other_cache), strict=True):
        assert mx.array_equal(a, b).item()


def test_the_step_flag_is_checked(cli, demo_checkpoint, tmp_path):
    said = cli("cache-prompt", "--model", demo_checkpoint, "--prompt-cache-file", tmp_path / "f.safetensors",
               "--prompt", "hi", "--prefill-step-size", "zero")
    assert isinstance(said, str) and "--prefill-step-size" in said and "'zero'" in said
