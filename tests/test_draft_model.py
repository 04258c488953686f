"""mlx-lm's speculative decoding (``--draft-model``) on lily's model: the Gated
DeltaNet caches become trimmable while mlx-lm's loop runs
(``mlx_lily.trimmable_cache``), and greedy output with any draft is greedy
output without one, token for token."""

from __future__ import annotations

import importlib
import subprocess
import sys

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

import mlx_lily
from mlx_lily import trimmable_cache
from mlx_lily.random_checkpoints import make_checkpoint
from mlx_lily.trimmable_cache import TrimmableArraysCache, make_trimmable

generate_module = importlib.import_module("mlx_lm.generate")

PROMPT = "The quick brown fox jumps over the lazy dog. Hello"
TOKENS = 32


def assert_caches_equal(first, second):
    """Two prompt caches hold the same tokens: KV caches the same keys and
    values up to their offsets, DeltaNet caches the same states, bit for bit."""
    assert len(first) == len(second)
    for a, b in zip(first, second):
        if isinstance(a, KVCache):
            assert a.offset == b.offset
            assert mx.array_equal(a.keys[..., : a.offset, :], b.keys[..., : b.offset, :])
            assert mx.array_equal(a.values[..., : a.offset, :], b.values[..., : b.offset, :])
        else:
            assert all(mx.array_equal(x, y) for x, y in zip(a.cache, b.cache))


@pytest.fixture(scope="module")
def models(demo_checkpoint, tmp_path_factory):
    draft_path = make_checkpoint(tmp_path_factory.mktemp("draft") / "draft", seed=1)
    model, tokenizer = mlx_lily.load(str(demo_checkpoint))
    draft, _ = mlx_lily.load(str(draft_path))
    # A draft that agrees with the model on some tokens only: the model
    # itself with its head's biases disturbed.
    near, _ = mlx_lily.load(str(demo_checkpoint))
    head = near.language_model.lm_head
    noise = mx.random.normal(head.biases.shape, key=mx.random.key(3))
    head.biases = head.biases + (0.02 * noise).astype(head.biases.dtype)
    # The model itself: every draft accepted.
    same, _ = mlx_lily.load(str(demo_checkpoint))
    prompt = mx.array(tokenizer.encode(PROMPT))
    greedy = [int(t) for t, _ in generate_module.generate_step(prompt, model, max_tokens=TOKENS)]
    return dict(model=model, tokenizer=tokenizer, prompt=prompt, greedy=greedy, other=draft, near=near,
                same=same, draft_path=draft_path)


def _speculative(models, draft, k):
    out = list(generate_module.speculative_generate_step(
        models["prompt"], models["model"], models[draft], num_draft_tokens=k, max_tokens=TOKENS))
    return [int(t) for t, _, _ in out], sum(bool(d) for _, _, d in out)


@pytest.mark.parametrize("draft, k", [("other", 1), ("other", 3), ("near", 2), ("near", 3), ("same", 2)])
def test_greedy_with_a_draft_is_greedy_without(models, draft, k):
    tokens, accepted = _speculative(models, draft, k)
    assert tokens == models["greedy"]
    full = TOKENS - TOKENS // (k + 1)  # every draft accepted
    if draft == "same":
        assert accepted == full
    elif draft == "near":
        assert 0 < accepted < full  # some drafts taken, some rolled back


def test_stock_loop_alone_refuses_the_cache(models):
    """Without lily's wrapper, stock's loop refuses the DeltaNet caches."""
    stock = trimmable_cache._stock_speculative
    with pytest.raises(ValueError, match="requires a trimmable prompt cache"):
        next(stock(models["prompt"], models["model"], models["other"], num_draft_tokens=2, max_tokens=4))


def test_caller_cache_is_plain_again_and_continues(models):
    """A prompt cache passed in (the server's) is trimmable while the loop
    runs, plain ArraysCache after, and holds the state a plain run holds."""
    model, draft = models["model"], models["other"]
    cache = make_prompt_cache(model) + make_prompt_cache(draft)
    seen = []
    for _ in generate_module.speculative_generate_step(models["prompt"], model, draft, prompt_cache=cache,
                                                        num_draft_tokens=2, max_tokens=6):
        seen.append({type(c) for c in cache})
    assert all(TrimmableArraysCache in kinds for kinds in seen)
    assert {type(c) for c in cache} == {ArraysCache, KVCache}


def test_generate_with_draft_model(models):
    """mlx_lm's generate (stream_generate) with draft_model takes lily's wrapper."""
    from mlx_lm import generate

    text = generate(models["model"], models["tokenizer"], PROMPT, max_tokens=12)
    with_draft = generate(models["model"], models["tokenizer"], PROMPT, max_tokens=12, draft_model=models["near"],
                          num_draft_tokens=3)
    assert with_draft == text


def test_trim_restores_the_caches_bit_for_bit(models):
    """After a call of several tokens and a trim, every cache equals, bit for
    bit, the cache of a run that fed only the kept tokens, one at a time."""
    model = models["model"]
    prompt = models["prompt"].tolist()

    def run(calls, trim=0):
        cache = make_prompt_cache(model)
        make_trimmable(cache, depth=4)
        for tokens in calls:
            mx.eval(model(mx.array(tokens)[None], cache=cache), [c.state for c in cache])
        for c in cache:
            assert c.trim(trim) == trim
        return cache

    alone = run([prompt[:-1], [prompt[-1]], [5], [7]])
    drafted = run([prompt[:-1], [prompt[-1], 5, 7, 9, 11]], trim=2)
    assert_caches_equal(alone, drafted)


def test_trim_into_a_prompt_is_refused(models):
    cache = make_prompt_cache(models["model"])
    make_trimmable(cache, depth=2)
    models["model"](models["prompt"][None], cache=cache)
    deltanet = next(c for c in cache if isinstance(c, TrimmableArraysCache))
    with pytest.raises(ValueError, match=r"can go back 0 token\(s\) here, not 1"):
        deltanet.trim(1)
    models["model"](mx.array([[1]]), cache=cache)
    models["model"](mx.array([[2, 3, 4]]), cache=cache)
    assert deltanet.trimmable_tokens() == 2  # depth 2: the last two tokens
    with pytest.raises(ValueError, match="not 3"):
        deltanet.trim(3)


def test_command_line_draft_model(models, demo_checkpoint):
    """``python -m mlx_lily generate --draft-model`` prints what it prints without."""

    def run(*extra):
        out = subprocess.run(
            [sys.executable, "-m", "mlx_lily", "generate", "--model", str(demo_checkpoint), "--prompt", PROMPT,
             "--max-tokens", "10", "--ignore-chat-template", *extra],
            capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return out.stdout.split("==========")[1]

    assert run("--draft-model", str(models["draft_path"]), "--num-draft-tokens", "3") == run()


def test_python_m_mlx_lm_generate_gets_the_speculative_loop_at_model_load(demo_checkpoint, monkeypatch, run_as_main):
    """``python -m mlx_lm.generate --draft-model``: the program is
    ``__main__``, which the startup hook meets before its functions exist;
    once lily loads the model, ``__main__``'s speculative loop is wrapped
    too (the imported copy, wrapped by ``enable``, is one it never calls)."""
    from mlx_lily import backend, cache_prompt, trimmable_cache

    def speculative_generate_step(prompt, model, draft_model, *args, **kwargs):  # the program's own
        yield from ()

    main = run_as_main("mlx_lm.generate", speculative_generate_step=speculative_generate_step)
    monkeypatch.setattr(trimmable_cache, "_stock_speculative", trimmable_cache._stock_speculative)
    monkeypatch.setattr(backend, "current_program", lambda: "mlx_lm.generate")
    monkeypatch.setattr(cache_prompt, "_settings", {})  # the load's own check of generate's flags, kept apart
    monkeypatch.setenv("MLX_LILY_PRIME", "0")
    backend._lily_load_model(demo_checkpoint)
    wrapped = main.speculative_generate_step
    assert getattr(wrapped, "_lily", False) and wrapped.__wrapped__ is speculative_generate_step
    assert trimmable_cache._stock_speculative is speculative_generate_step
