"""The verification pass on the decode kernels (mlx_lily/layers/verify_step.py),
every kernel on in the CPU emulator: k + 1 positions in one pass give, bit
for bit, the hidden states, logits and caches of k + 1 decode steps one at a
time (the layers' fused steps; the whole step's form, run eagerly), so
speculative greedy output (the MTP loop, --draft-model) is plain greedy
decoding's token for token, and a rollback leaves the caches of a run that
never drafted."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, make_prompt_cache

import mlx_lily
from mlx_lily import call_trace
from mlx_lily.layers import text_model as T
from mlx_lily.layers import verify_step
from mlx_lily.mtp_decode import mtp_generate_step
from mlx_lily.random_checkpoints import make_checkpoint
from mlx_lily.toolchain.registry import BACKEND_ENV
from mlx_lily.trimmable_cache import make_trimmable

from test_draft_model import assert_caches_equal

PROMPT = [5, 17, 301, 45, 499, 2, 77]
DRAFTS = [212, 8, 64, 123]
TOKENS = 9
VERIFY = "lily verify pass"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(BACKEND_ENV, "emulator")
        mp.delenv("MLX_LILY_KERNELS", raising=False)
        path = make_checkpoint(tmp_path_factory.mktemp("verify") / "head", shape="demo", mtp=True)
        model, _ = mlx_lily.load(str(path))
        prompt = mx.array(PROMPT)
        greedy = [int(t) for t, _ in generate_step(prompt, model, max_tokens=TOKENS)]
        yield dict(model=model, prompt=prompt, greedy=greedy)


@pytest.fixture
def emulated(setup, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "emulator")
    monkeypatch.delenv("MLX_LILY_KERNELS", raising=False)
    return setup


def _paths(fn):
    call_trace.start()
    try:
        out = fn()
        return out, {r["path"] for r in call_trace.seen()}
    finally:
        call_trace.stop()


def _prefilled(model, prompt=PROMPT):
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt]), cache=cache))
    make_trimmable(cache, depth=len(DRAFTS) + 1)
    return cache


def _compare(model, positions, form, prompt=PROMPT):
    """The pass over ``positions`` positions against as many decode steps
    (hidden states, logits, caches, bit for bit) -> (the decode steps'
    paths, the pass's caches, the steps' caches)."""
    text, language = model.language_model.model, model.language_model
    tokens = DRAFTS[:positions]
    alone = _prefilled(model, prompt)

    def steps():
        hidden = [text(mx.array([[t]]), cache=alone) for t in tokens]
        return hidden, [language.head(h, alone) for h in hidden]

    (hidden, logits), alone_paths = _paths(steps)
    passed = _prefilled(model, prompt)
    assert verify_step.verify_form(text, passed, positions) == form
    got, pass_paths = _paths(lambda: verify_step.verify(text, mx.array(tokens), passed))
    assert pass_paths == {VERIFY}
    want = mx.concatenate(hidden, axis=0)
    assert got.shape == want.shape and mx.array_equal(got, want).item()
    assert mx.array_equal(language.head(got, passed), mx.concatenate(logits, axis=0)).item()
    assert_caches_equal(passed, alone)
    return alone_paths, passed, alone


def test_the_pass_declines_what_a_decode_step_alone_would_not_run_fused(emulated):
    # verify_form holds its per-layer verdict across rounds; each change that
    # takes a layer off its fused path, or a cache off one stream's form,
    # turns the pass down (the caller then runs the model's own call).
    model = emulated["model"]
    text = model.language_model.model
    cache = _prefilled(model)
    assert verify_step.verify_form(text, cache, 2) == "view"
    assert verify_step.verify_form(text, cache, verify_step.MAX_BATCH + 1) is None
    layer = text.layers[0]
    before = layer.__dict__.get("_lily_decode_ok")
    layer._lily_decode_ok = False  # its fused step failed: unfused ops from now on
    try:
        assert verify_step.verify_form(text, cache, 2) is None
    finally:
        layer._lily_decode_ok = before
    assert verify_step.verify_form(text, cache, 2) == "view"
    linear = next(i for i, l in enumerate(text.layers) if l.is_linear)
    attn = next(i for i, l in enumerate(text.layers) if not l.is_linear)
    held = cache[linear].left_padding
    cache[linear].left_padding = mx.array([1])  # a server row's cache
    assert verify_step.verify_form(text, cache, 2) is None
    cache[linear].left_padding = held
    other = list(cache)
    other[attn] = make_prompt_cache(model)[attn]  # empty: no keys yet
    assert verify_step.verify_form(text, other, 2) is None
    assert verify_step.verify_form(text, cache, 2) == "view"
    from mlx_lily.models.qwen3_5_moe import specialize

    specialize(model, lily=False)  # the layers on stock's classes (the bench's switch)
    try:
        assert verify_step.verify_form(text, cache, 2) is None
    finally:
        specialize(model, lily=True)
    assert verify_step.verify_form(text, cache, 2) == "view"


def test_push_steps_keeps_each_state_before_its_token(emulated):
    from mlx_lily.trimmable_cache import TrimmableArraysCache

    states = [(mx.array([float(i)]), mx.array([10.0 + i])) for i in range(5)]
    pushed, stepped = TrimmableArraysCache(2, depth=3), TrimmableArraysCache(2, depth=3)
    for c in (pushed, stepped):
        c[0], c[1] = mx.array([-1.0]), mx.array([-2.0])
        c.advance(1)
    pushed.push_steps(states)
    for conv, state in states:
        stepped[0], stepped[1] = conv, state
        stepped.advance(1)
    assert pushed.trimmable_tokens() == stepped.trimmable_tokens() == 3
    for n in (1, 2):
        assert pushed.trim(n) == stepped.trim(n)
        assert all(mx.array_equal(a, b).item() for a, b in zip(pushed.cache, stepped.cache))


def test_push_stacked_keeps_what_push_steps_keeps(emulated):
    # The verification pass hands a layer its states after each position
    # stacked, [P, ...]: the cache holds the last one, and going back gives
    # the state push_steps would have given (sliced out only then), whatever
    # the depth cuts off.
    from mlx_lily.trimmable_cache import TrimmableArraysCache

    convs = mx.arange(5, dtype=mx.float32).reshape(5, 1) * 3
    states = mx.arange(5, dtype=mx.float32).reshape(5, 1) + 10
    for depth in (2, 5, 7):
        for n in range(1, min(depth, 6) + 1):
            stacked, pushed = TrimmableArraysCache(2, depth=depth), TrimmableArraysCache(2, depth=depth)
            for c in (stacked, pushed):
                c[0], c[1] = mx.array([[-1.0]]), mx.array([[-2.0]])
                c.advance(1)
            stacked.push_stacked(convs, states)
            pushed.push_steps([(convs[p:p + 1], states[p:p + 1]) for p in range(5)])
            assert stacked.cache[0].shape == (1, 1)
            assert stacked.trimmable_tokens() == pushed.trimmable_tokens() == min(depth, 6)
            assert stacked.trim(n) == pushed.trim(n) == n
            # (Going back past the first write gives the empty state: None.)
            assert all(a is b is None or mx.array_equal(a, b).item()
                       for a, b in zip(stacked.cache, pushed.cache)), (depth, n)


def test_the_head_takes_a_round_s_positions_on_the_decode_kernels(emulated, monkeypatch):
    # The MTP head's calls after its prompt run its layer's rows on the decode
    # kernels (verify_step.head_rows): each position attends up to itself,
    # the head's cache advances as its own ops advance it, and the output is
    # the head's forward (its bits may differ from the prompt ops': drafts
    # only steer what is verified; greedy output is tested above and below).
    from mlx_lily import mtp

    model = emulated["model"]
    head = mtp.head_of(model)
    embed = model.language_model.model.embed_tokens
    D = model.language_model.args.hidden_size
    hidden = mx.random.normal((1, 9, D), key=mx.random.key(3)).astype(mx.bfloat16)
    after = embed(mx.array([[7, 11, 13, 17, 19, 23, 29, 31, 37]]))

    def run(rows_path: bool):
        if not rows_path:
            monkeypatch.setattr(verify_step, "head_rows", lambda *a: None)
        cache = [KVCache()]
        head(hidden[:, :6], after[:, :6], cache)  # the prompt's positions: the head's own ops
        outs = [head(hidden[:, 6:8], after[:, 6:8], cache)]
        cache[0].trim(1)  # a rejected draft's entry
        outs.append(head(hidden[:, 7:9], after[:, 7:9], cache))
        monkeypatch.undo()
        return outs, cache[0]

    calls = []
    real = verify_step.head_rows
    monkeypatch.setattr(verify_step, "head_rows", lambda *a: calls.append(a[2].shape[1]) or real(*a))
    got, got_cache = run(True)
    assert calls == [6, 2, 2]  # the first call (an empty cache) runs the head's own ops
    want, want_cache = run(False)
    assert got_cache.offset == want_cache.offset == 9
    for g, w in zip(got, want):
        assert g.shape == w.shape == (1, 2, D)
        err = mx.max(mx.abs(g.astype(mx.float32) - w.astype(mx.float32))).item()
        assert err <= 0.05 * mx.max(mx.abs(w.astype(mx.float32))).item(), err
    rows = got_cache.keys[..., :9, :].astype(mx.float32)
    ref = want_cache.keys[..., :9, :].astype(mx.float32)
    assert mx.max(mx.abs(rows - ref)).item() <= 0.05 * mx.max(mx.abs(ref)).item()
    # The buffers hold a whole capacity, as the main model's in the whole step.
    from mlx_lily.layers.text_model import CAPACITY_STEP

    assert got_cache.keys.shape[2] % CAPACITY_STEP == 0


@pytest.mark.parametrize("S,k", [(1, 1), (2, 2), (4, 3)])
def test_a_round_s_greedy_drafts_are_one_call_with_the_loop_s_drafts(emulated, S, k):
    # verify_step.head_drafts: the head over S verified positions, then k
    # logits, argmaxes and (but for the last) head steps on the drafts, as
    # one call: the drafts and the head's cache those of the loop that makes
    # them step by step (the head's rows path, the head GEMV, the argmax).
    from mlx_lily import mtp
    from mlx_lily.mtp_decode import _head_logits

    model = emulated["model"]
    head, language = mtp.head_of(model), model.language_model
    embed = language.model.embed_tokens
    D = language.args.hidden_size
    hidden = mx.random.normal((1, 6 + S, D), key=mx.random.key(5)).astype(mx.bfloat16)
    after = mx.array([[7, 11, 13, 17, 19, 23, 29, 31, 37, 41][: 6 + S]])
    main = _prefilled(model)

    def prefilled_head():
        cache = [KVCache()]
        head(hidden[:, :6], embed(after[:, :6]), cache)
        return cache

    def logits(g):
        return _head_logits(model, g, main)

    loop_cache = prefilled_head()
    g = head(hidden[:, 6:], embed(after[:, 6:]), loop_cache)[:, -1:]
    want = []
    for j in range(k):
        d = mx.argmax(logits(g)[0], axis=-1)
        want.append(int(d.item()))
        if j + 1 < k:
            g = head(g, embed(d[None]), loop_cache)
    chain_cache = prefilled_head()
    got = verify_step.head_drafts(head, head.layers[0], hidden[:, 6:], embed(after[:, 6:]), chain_cache[0], k,
                                  logits, embed, language._lily_head_takes(hidden[:, -1:], main),
                                  [language.lm_head, embed])
    assert got is not None and got.dtype == mx.uint32 and got.tolist() == want
    assert chain_cache[0].offset == loop_cache[0].offset == 6 + S + k - 1
    n = 6 + S + k - 1
    assert mx.array_equal(chain_cache[0].keys[..., :n, :], loop_cache[0].keys[..., :n, :]).item()
    # Where the rows path would not take the call (an empty cache), nothing is done.
    empty = KVCache()
    assert verify_step.head_drafts(head, head.layers[0], hidden[:, :S], embed(after[:, :S]), empty, k,
                                   logits, embed, True, [language.lm_head, embed]) is None
    assert empty.offset == 0


def test_the_mtp_loop_drafts_in_one_call_where_the_head_s_rows_path_takes_them(emulated, monkeypatch):
    model, prompt, greedy = emulated["model"], emulated["prompt"], emulated["greedy"]
    calls = []
    real = verify_step.head_drafts
    monkeypatch.setattr(verify_step, "head_drafts", lambda *a: calls.append(a[5]) or real(*a))
    out = [t for t, _, _ in mtp_generate_step(prompt, model, num_draft_tokens=2, max_tokens=TOKENS,
                                              draft_hook=_oracle(greedy, 2))]
    assert out == greedy and calls and set(calls) == {2}


def test_one_stream_s_decode_rows_take_the_head_gemv_only_where_asked(emulated, monkeypatch):
    # One stream's rows (generate's token, a pass's positions, a draft) take
    # stock's head, whose greedy tokens the GEMV's other summing order can
    # change; lily's head GEMV only on a GPU named in ONE_STREAM_BACKENDS. A
    # decode step and a pass decide alike. The server's batch caches take it
    # everywhere (batch invariance).
    from mlx_lily.layers import language_model as lm

    model = emulated["model"]
    language = model.language_model
    D = language.args.hidden_size
    cache = _prefilled(model)
    assert lm.ONE_STREAM_BACKENDS == ()
    monkeypatch.setattr(lm, "ONE_STREAM_BACKENDS", ("cuda",))
    for backend, takes in (("cuda", True), ("metal", False), ("emulator", False), (None, False)):
        monkeypatch.setattr(lm, "kernel_backend", lambda backend=backend: (backend, backend))
        for rows in (1, 4):
            assert language._lily_head_takes(mx.zeros((rows, 1, D), dtype=mx.bfloat16), cache) is takes
        assert not language._lily_head_takes(mx.zeros((1, 3, D), dtype=mx.bfloat16), cache)  # a prompt
        assert not language._lily_head_takes(mx.zeros((1, 1, D), dtype=mx.bfloat16), None)
    monkeypatch.setattr(lm, "kernel_backend", lambda: ("cuda", "cuda"))
    x = mx.random.normal((4, 1, D), key=mx.random.key(9)).astype(mx.bfloat16)
    want = language.lm_head(x)
    got = language.head(x, cache)
    assert got.shape == want.shape and got.dtype == want.dtype
    # Within the GEMV's contract (its fp32 oracle's bound), not stock's bits.
    from mlx_lily.kernels.linear.gemv import quantized_matvec_agree

    head = language.lm_head
    assert quantized_matvec_agree((got,), (want,), x, ((head.weight, head.scales, head.biases),)) is None


def test_the_pass_gives_each_position_the_bits_of_a_decode_step(emulated):
    from mlx_lily import kernels as K

    positions = len(DRAFTS)
    K.gated_delta_decode_steps.last_path = None
    paths, passed, alone = _compare(emulated["model"], positions, "view")
    assert paths == {"lily fused decode"}
    # The DeltaNet layers took their positions in one launch each.
    assert K.gated_delta_decode_steps.last_path == "kernel"
    # Back one position: the states of the run that fed one token fewer.
    for c in passed:
        c.trim(1)
    shorter = _prefilled(emulated["model"])
    for t in DRAFTS[: positions - 1]:
        emulated["model"].language_model.model(mx.array([[t]]), cache=shorter)
    assert_caches_equal(passed, shorter)


def test_the_pass_runs_the_one_row_kernel_per_position_where_the_steps_kernel_is_off(emulated, monkeypatch):
    from mlx_lily import kernels as K

    monkeypatch.setattr(verify_step, "_steps_on", lambda *args: False)
    K.gated_delta_decode_steps.last_path = None
    _compare(emulated["model"], 3, "view")
    assert K.gated_delta_decode_steps.last_path is None


def test_the_whole_form_takes_a_row_a_call_where_the_rows_form_is_off(emulated, monkeypatch):
    monkeypatch.setattr(T, "compile_enabled", lambda: True)
    monkeypatch.setattr(verify_step, "compile_enabled", lambda: True)
    monkeypatch.setattr(mx, "compile", lambda fn: fn)
    monkeypatch.setattr(verify_step, "_rows_on", lambda: False)
    from mlx_lily import kernels as K

    rows_seen = []
    attention = K.attention
    monkeypatch.setattr(K, "attention", lambda q, *a, **kw: rows_seen.append(q.shape[0]) or attention(q, *a, **kw))
    model = emulated["model"]
    model.language_model.model.__dict__.pop("_lily_whole_ok", None)
    _compare(model, 3, "whole")
    assert rows_seen and set(rows_seen) == {1}


def test_the_pass_in_the_whole_steps_form(emulated, monkeypatch):
    """Where the compiled whole step decodes (run eagerly here), the pass
    reads the attention's keys at the whole step's capacity, bounded."""
    monkeypatch.setattr(T, "compile_enabled", lambda: True)
    monkeypatch.setattr(verify_step, "compile_enabled", lambda: True)
    monkeypatch.setattr(mx, "compile", lambda fn: fn)
    from mlx_lily import kernels as K

    rows_seen = []
    attention = K.attention

    def spy(q, *args, **kwargs):
        rows_seen.append(q.shape[0])
        return attention(q, *args, **kwargs)

    monkeypatch.setattr(K, "attention", spy)
    model = emulated["model"]
    model.language_model.model.__dict__.pop("_lily_whole_ok", None)
    paths, passed, _ = _compare(model, 3, "whole")
    assert paths == {"lily whole decode step"}
    # The pass's attention took its 3 positions in one call a layer (rows of
    # one view, each bounded at its own length; the step's first call runs
    # once eagerly, then as traced): the same bits as above.
    attention_layers = sum(not layer.is_linear for layer in model.language_model.model.layers)
    assert attention_layers > 0 and rows_seen.count(3) in (attention_layers, 2 * attention_layers)
    assert all(c.keys.shape[2] % T.CAPACITY_STEP == 0 for c in passed if type(c) is KVCache)


def _oracle(greedy, k):
    """Drafts from greedy decoding's continuation, every other round's
    second (for k = 1: first) draft wrong: accepted and rejected drafts."""
    rounds = [0]

    def hook(done, drafts):
        rounds[0] += 1
        out = [greedy[done + i] if done + i < len(greedy) else 0 for i in range(k)]
        if rounds[0] % 2 == 0:
            out[min(1, k - 1)] = (out[min(1, k - 1)] + 1) % 500
        return out

    return hook


@pytest.mark.parametrize("k", [1, 2, 3])
def test_mtp_greedy_is_greedy_decoding_on_the_kernels(emulated, k):
    """The head's drafts (k = 1), else partly wrong ones; at k = 3 the
    caches after the rollbacks are those of a run that never drafted."""
    model, prompt, greedy = emulated["model"], emulated["prompt"], emulated["greedy"]
    stats, cache = {}, make_prompt_cache(model)
    out, paths = _paths(lambda: [t for t, _, _ in mtp_generate_step(
        prompt, model, num_draft_tokens=k, max_tokens=TOKENS, stats=stats, prompt_cache=cache,
        draft_hook=_oracle(greedy, k) if k > 1 else None)])
    assert out == greedy
    assert VERIFY in paths
    if k == 1:
        return
    assert 0 < stats["accepted"] < stats["rounds"] * k
    if k == 3:
        plain = make_prompt_cache(model)
        model(prompt[None, :-1], cache=plain)
        for t in [int(prompt[-1])] + out[:-1]:
            model(mx.array([[t]]), cache=plain)
        mx.eval([c.state for c in plain])
        assert_caches_equal(cache, plain)


def test_draft_model_greedy_is_greedy_decoding_on_the_kernels(emulated):
    """mlx-lm's speculative loop with the model as its own draft and with
    the draft's tokens disturbed: the verify calls take the pass."""
    import importlib

    generate_module = importlib.import_module("mlx_lm.generate")
    mlx_lily.enable()
    model, prompt, greedy = emulated["model"], emulated["prompt"], emulated["greedy"]
    out, paths = _paths(lambda: [int(t) for t, _, _ in generate_module.speculative_generate_step(
        prompt, model, model, num_draft_tokens=2, max_tokens=TOKENS)])
    assert out == greedy
    assert VERIFY in paths


@pytest.mark.gpu
def test_on_the_gpu_the_pass_gives_the_compiled_whole_steps_bits(tmp_path, monkeypatch):
    """On a GPU (compiled steps, the real kernels): the pass against the
    compiled whole step across a capacity step (the prompt ends 3 rows short
    of 1024: the attention split, positions on both sides), then greedy
    output with drafts against greedy decoding. Run with
    ``python -m pytest tests/test_verify_step.py -m gpu``."""
    from mlx_lily.toolchain.registry import gpu_backend

    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.delenv("MLX_LILY_KERNELS", raising=False)
    if gpu_backend() is None:
        pytest.skip("no GPU: the default device is not a Metal or CUDA GPU")
    model, _ = mlx_lily.load(str(make_checkpoint(tmp_path / "head", shape="demo", mtp=True)))
    prompt = [(37 * i) % 500 + 1 for i in range(1021)]
    paths, _, _ = _compare(model, 4, "whole", prompt)
    assert paths == {"lily whole decode step"}
    greedy = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=2 * TOKENS)]
    for k in (1, 3):
        out = [t for t, _, _ in mtp_generate_step(mx.array(prompt), model, num_draft_tokens=k,
                                                   max_tokens=2 * TOKENS, draft_hook=_oracle(greedy, k))]
        assert out == greedy
