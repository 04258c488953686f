"""Lily's layers under mlx-lm's batch generator: batches of several rows,
left-padded and length-limited prompts, boolean masks, BatchKVCache and
batched ArraysCache, continuous batching; what the server runs.

Each case asserts the path every layer took (``mlx_lily.call_trace``), not only
the tokens. On the reference backend lily's ops are stock's computation, so
lily must reproduce stock's tokens exactly, and each row of a batch must
give the tokens its prompt gives alone (the CPU's matmuls are row-exact).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator, batch_generate
from mlx_lm.models.cache import make_prompt_cache

import mlx_lily
from mlx_lily import kernels as K
from mlx_lily import call_trace
from mlx_lily.kernels.gated_delta.recurrence import gated_delta_kernel
from mlx_lily.layers.prompt_rows import ROWS_ENV
from mlx_lily.toolchain.registry import BACKEND_ENV

PROMPTS = [[5, 9, 300, 41, 7], [12, 500], [64, 65, 66]]
LAYERS = {"Gated DeltaNet", "full attention", "MoE"}


@pytest.fixture
def reference_backend(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "reference")


@pytest.fixture
def recorded():
    call_trace.start()
    yield call_trace.seen
    call_trace.stop()


@pytest.fixture(scope="module")
def models(demo_checkpoint):
    stock, tokenizer = mlx_lily.load(str(demo_checkpoint), backend="mlx")
    lily, _ = mlx_lily.load(str(demo_checkpoint), backend="lily")
    return stock, lily, tokenizer


def tokens_of(model, tokenizer, prompts, max_tokens=6, **kwargs):
    out = batch_generate(model, tokenizer, prompts, max_tokens=max_tokens, return_token_ids=True, **kwargs)
    return out.token_ids


def assert_all_lily(records):
    """Every layer call took lily's path, and every layer kind was called."""
    stock = [r for r in records if not r["path"].startswith("lily")]  # "lily" or "lily fused decode"
    assert not stock, stock
    assert {r["layer"] for r in records} == LAYERS


def test_batch_of_two_runs_lily_s_layers(models, reference_backend, recorded, capfd):
    stock, lily, _ = models
    batch = mx.array([[17, 301, 45, 499, 2, 77], [7, 6, 5, 4, 3, 2]])
    got, want = lily(batch), stock(batch)
    assert mx.array_equal(got, want).item()
    assert_all_lily(recorded())
    assert {r["batch"] for r in recorded()} == {2}
    assert "stock mlx-lm" not in capfd.readouterr().err


def test_padded_batch_matches_stock_and_each_prompt_alone(models, reference_backend, recorded):
    # batch_generate right-pads the prompts (ArraysCache lengths, BatchKVCache
    # right padding rolled to the left afterwards), then decodes all rows
    # together with left-padding masks. Lily prefills the padded batch row by
    # row, each row as if alone (layers/prompt_rows.py).
    stock, lily, tokenizer = models
    got = tokens_of(lily, tokenizer, PROMPTS)
    assert got == tokens_of(stock, tokenizer, PROMPTS)
    assert got == [tokens_of(lily, tokenizer, [p])[0] for p in PROMPTS]
    records = recorded()
    assert_all_lily(records)
    seen = {(r["layer"], r["step"], r["batch"], r["mask"], r["cache"]) for r in records}
    batched = {
        ("Gated DeltaNet", "prefill", 1, "array", "ArraysCache+left_padding"),
        ("full attention", "prefill", 1, "array", "BatchKVCache+left_padding"),
        ("MoE", "prefill", 1, "none", "none"),
        ("Gated DeltaNet", "decode", 3, "none", "ArraysCache"),
        ("full attention", "decode", 3, "array", "BatchKVCache+left_padding"),
        ("MoE", "decode", 3, "none", "none"),
    }
    assert batched <= seen, batched - seen
    assert not [r for r in records if r["step"] == "prefill" and r["batch"] > 1]


def test_which_rows_share_a_packed_prefill_call(monkeypatch):
    from mlx_lily.layers import prompt_rows as pr

    def groups(real, packing=True):  # the order of the calls does not matter
        return sorted(pr.pack_groups(real, packing))

    assert groups([9, 0, 4, 8, 300]) == [[0, 3, 4], [2]]  # no tokens: no call; short: alone
    assert groups([9, 0, 4, 8], packing=False) == [[0], [2], [3]]
    big = pr.PACK_MAX_TOKENS // 2
    assert groups([big, big, 1, big]) == [[0, 1], [2], [3]]
    assert groups([pr.PACK_MAX_TOKENS + 5, 9]) == [[0], [1]]
    # Where packing keeps a row's bits: the CPU and CUDA; not (unmeasured) Metal,
    # and not when turned off.
    monkeypatch.setattr(pr, "gpu_backend", lambda: "metal")
    assert not pr.packing_enabled()
    monkeypatch.setattr(pr, "gpu_backend", lambda: "cuda")
    assert pr.packing_enabled()
    monkeypatch.setenv(pr.PACK_ENV, "0")
    assert not pr.packing_enabled()


def test_packed_rows_move_to_a_padded_batch_and_back_by_gathers():
    from mlx_lm.models.cache import ArraysCache

    from mlx_lily.layers import prompt_rows as pr

    lengths = [3, 5, 2, 4]
    packed = mx.arange(1, 1 + sum(lengths) * 2, dtype=mx.float32).reshape(1, -1, 2).astype(mx.bfloat16)
    rows = pr.split_rows(packed, lengths)
    for group in ([1, 3, 0], [0, 1, 2, 3]):  # a subset, longest first; every row in order
        padded = pr.padded_rows(packed, lengths, group)
        assert padded.shape == (len(group), max(lengths[r] for r in group), 2)
        for slot, r in enumerate(group):  # each row's tokens, then zeros
            n = lengths[r]
            assert mx.array_equal(padded[slot, :n], rows[r][0]).item()
            assert not mx.any(padded[slot, n:]).item()
        back = pr.packed_from_padded(padded, lengths, group)
        assert mx.array_equal(back, mx.concatenate([rows[r] for r in sorted(group)], axis=1)).item()
    # The batch's cache takes a batched call's arrays whole where its rows
    # hold their slots untouched, in slot order or gathered; not otherwise.
    states = [mx.arange(12, dtype=mx.float32).reshape(3, 2, 2), mx.arange(3, dtype=mx.float32)[:, None] * 10]
    caches = [ArraysCache(2) for _ in range(3)]
    pr.BatchedRows(states).hand_out(caches)
    assert pr.batched_entries(caches)[0] is states[0]
    swapped = pr.batched_entries([caches[2], caches[0], caches[1]])
    assert mx.array_equal(swapped[1], mx.array([[20.0], [0.0], [10.0]])).item()
    assert pr.batched_entries([caches[0], None, caches[2]]) is None
    caches[1][1] = mx.zeros((1, 1))  # a row whose state moved on since
    assert pr.batched_entries(caches) is None


def test_continuous_batching_a_request_joins_the_decode_batch(models, reference_backend, recorded):
    # The server's pattern: one request decodes, a second arrives and decodes
    # with it; each gets the tokens it gets alone.
    _, lily, tokenizer = models
    alone = [tokens_of(lily, tokenizer, [p], max_tokens=8)[0] for p in PROMPTS[:2]]
    gen = BatchGenerator(lily, completion_batch_size=8, prefill_batch_size=8)
    out: dict[int, list[int]] = {}
    (first,) = gen.insert([PROMPTS[0]], max_tokens=[8])
    batch_sizes = []
    for step in range(40):
        if step == 3:
            (second,) = gen.insert([PROMPTS[1]], max_tokens=[8])
        _, responses = gen.next()
        batch_sizes.append(len(responses))
        for r in responses:
            out.setdefault(r.uid, []).append(r.token)
        if step > 3 and not responses:
            break
    gen.close()
    assert [out[first], out[second]] == alone
    assert max(batch_sizes) == 2
    assert_all_lily(recorded())
    assert any(r["step"] == "decode" and r["batch"] == 2 for r in recorded())


def test_prompts_continuing_saved_caches(models, reference_backend, recorded):
    # The server resumes prompts from its prompt cache: caches of different
    # lengths merge into one BatchKVCache (left-padded) and ArraysCache.
    # Lily prefills the tails row by row: each row's cache without the left
    # padding the merge gave the shorter history (its positions and keys as alone).
    stock, lily, tokenizer = models
    heads, tails = [[5, 9, 300, 7, 8, 9], [12]], [[41, 7, 3], [500, 3, 4, 9]]

    def continued(model):
        caches = [make_prompt_cache(model) for _ in heads]
        for head, cache in zip(heads, caches):
            model(mx.array([head]), cache=cache)
        return tokens_of(model, tokenizer, tails, prompt_caches=caches)

    assert continued(lily) == continued(stock)
    assert_all_lily(recorded())


def test_kernels_take_padded_batches(demo_checkpoint, monkeypatch, recorded):
    # With kernels (in the CPU emulator) the gated delta kernel takes the
    # padded, batched calls itself, mask and all, and each row's tokens are
    # those of its prompt alone.
    monkeypatch.setenv(BACKEND_ENV, "emulator")
    monkeypatch.setenv(ROWS_ENV, "0")  # the padded prompts as one batch, masks and all
    # Only the per-row kernels: the MoE and attention kernels take a batched
    # prefill but not the short solo one (or the reverse), and the fused
    # decode kernels take a row decoded alone but not a batch of two; on this
    # chaotic random model their rounding-level differences change greedy tokens.
    for name in ("moe_experts", "moe_combine", "attention", "quantized_matvec", "moe_decode",
                 "gated_delta_decode", "qk_norm_rope"):
        monkeypatch.setattr(K.OPS[name], "kernel", None)
    lily, tokenizer = mlx_lily.load(str(demo_checkpoint), backend="lily")
    masked_calls = []
    run_checked = gated_delta_kernel.run_checked

    def spy(backend, *args):
        masked_calls.append(len(args) > 8 and args[8] is not None)
        return run_checked(backend, *args)

    monkeypatch.setattr(gated_delta_kernel, "run_checked", spy)
    prompts = PROMPTS[:2]
    got = tokens_of(lily, tokenizer, prompts, max_tokens=3)
    assert any(masked_calls) and K.OPS["gated_delta"].last_path == "kernel"
    assert got == [tokens_of(lily, tokenizer, [p], max_tokens=3)[0] for p in prompts]
    assert_all_lily(recorded())


def test_an_unpadded_prompt_under_the_batch_generator_drops_its_all_true_mask(models, reference_backend, monkeypatch):
    # The server passes a padding mask with every call; a prompt with no
    # padding must still reach the chunked DeltaNet kernels, which take none.
    from mlx_lily.kernels.gated_delta.recurrence import CHUNKED_FROM

    stock, lily, tokenizer = models
    masks = []
    real = type(K.gated_delta).__call__

    def spy(self, *args, **kwargs):
        if self is K.gated_delta and args[0].shape[1] > 1:
            masks.append((args[0].shape[0], args[0].shape[1], args[8] is not None))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(type(K.gated_delta), "__call__", spy)
    long = [(7 * i) % 500 + 1 for i in range(CHUNKED_FROM + 8)]
    got = tokens_of(lily, tokenizer, [long], max_tokens=4)
    assert masks and all(not masked for _, _, masked in masks)
    assert got == tokens_of(stock, tokenizer, [long], max_tokens=4)
    masks.clear()
    monkeypatch.setenv(ROWS_ENV, "0")  # a padded batch prefilled as one (not row by row)
    tokens_of(lily, tokenizer, [long, long[:40]], max_tokens=2)  # padded: the mask stays
    assert any(masked for batch, _, masked in masks if batch == 2)


def test_one_model_call_reads_its_padding_mask_once(models, monkeypatch):
    # Reading the mask waits on the GPU; the same mask reaches every DeltaNet
    # layer of a call, so the layers share one read.
    from mlx_lily.kernels.gated_delta.recurrence import CHUNKED_FROM
    from mlx_lily.layers import gated_deltanet

    _, lily, tokenizer = models
    reads = []
    real_all = mx.all
    monkeypatch.setattr(gated_deltanet.mx, "all", lambda *a, **k: reads.append(1) or real_all(*a, **k))
    long = [(7 * i) % 500 + 1 for i in range(CHUNKED_FROM + 8)]
    tokens_of(lily, tokenizer, [long], max_tokens=2)
    layers = sum(1 for layer in lily.layers if layer.is_linear)
    assert layers > 1 and 0 < len(reads) < layers
    # Prompts arriving together, packed into one call (prompt_rows.packed_call):
    # each row's mask is read once for the call, not once per layer.
    reads.clear()
    tokens_of(lily, tokenizer, [long, long[:-3], long[:-5]], max_tokens=2)
    assert 0 < len(reads) <= 3 + 1, len(reads)  # the rows, and the decode step's at most
    mask = mx.array([[True] * CHUNKED_FROM])
    reads.clear()
    assert gated_deltanet.padding_only(mask, CHUNKED_FROM) is None
    assert gated_deltanet.padding_only(mask, CHUNKED_FROM) is None and len(reads) == 1
    padded = mx.array([[False] + [True] * (CHUNKED_FROM - 1)])
    assert gated_deltanet.padding_only(padded, CHUNKED_FROM) is padded and len(reads) == 2


def test_a_padding_decode_step_is_stock_s_in_the_fused_step(models, reference_backend):
    # The fused DeltaNet decode step (the server's batched step and the
    # one-row masked step) passes the padding mask into the decode op: a
    # padding row's qkv enters the convolution as zeros, a zero row is
    # shifted into its conv state and its recurrent state is kept, as stock's
    # layer does on a cache without lengths. Bits against stock's layer.
    from mlx_lm.models.cache import ArraysCache

    stock, lily, _ = models
    i = next(j for j, layer in enumerate(lily.layers) if layer.is_linear)
    ours, theirs = lily.layers[i], stock.layers[i]
    la = ours.linear_attn
    B = 3
    rng = np.random.default_rng(4)
    x = mx.array(rng.standard_normal((B, 1, la.hidden_size)).astype(np.float32)).astype(mx.bfloat16)
    conv = mx.array(rng.standard_normal((B, la.conv_kernel_size - 1, la.conv_dim)).astype(np.float32)).astype(
        mx.bfloat16)
    state = mx.array(rng.standard_normal((B, la.num_v_heads, la.head_v_dim, la.head_k_dim)).astype(np.float32))
    mask = mx.array([[True], [False], [True]])
    cache = ArraysCache(2)
    cache[0], cache[1] = conv, state
    want = theirs(x, mask, cache)
    got, got_conv, got_state = ours._linear_step(x, conv, state, mask)
    for name, g, w in (("out", got, want), ("conv state", got_conv, cache[0]), ("state", got_state, cache[1])):
        assert g.dtype == w.dtype and mx.array_equal(g, w).item(), name
    # The padding row: its recurrent state kept, a zero row shifted in.
    assert mx.array_equal(got_state[1], state[1]).item()
    assert mx.array_equal(got_conv[1], mx.concatenate([conv[1, 1:], mx.zeros_like(conv[1, :1])])).item()


def test_the_batched_step_advances_every_layer_s_counters_with_one_op():
    # Each attention layer's offset (+1) and each DeltaNet layer's left
    # padding (-1), as stock's layers advance them: once the values are seen
    # equal, one array serves all, each cache holding its own object.
    from types import SimpleNamespace

    from mlx_lily.layers.batch_step import advance_together

    caches = [SimpleNamespace(offset=mx.array([3, 7])) for _ in range(4)]
    held = {}
    advance_together(held, "offset", caches, "offset", 1)  # first step: one read compares them
    assert [c.offset.tolist() for c in caches] == [[4, 8]] * 4 and "offset" in held
    assert len({id(c.offset) for c in caches}) == 4
    caches[2].offset += 5  # an in-place update of one cache's counter reaches no other
    assert [c.offset.tolist() for c in caches] == [[4, 8], [4, 8], [9, 13], [4, 8]]
    caches[2].offset = caches[2].offset - 5  # reassigned (rows left, trimmed): compared again
    advance_together(held, "offset", caches, "offset", 1)
    assert [c.offset.tolist() for c in caches] == [[5, 9]] * 4 and "offset" in held
    caches[1].offset = mx.array([0, 0])  # counters that differ advance one by one
    advance_together(held, "offset", caches, "offset", 1)
    assert [c.offset.tolist() for c in caches] == [[6, 10], [1, 1], [6, 10], [6, 10]] and "offset" not in held


def test_the_batched_step_s_layer_kinds_follow_the_layer_list(models):
    # Worked out once per layer list (the server asks at every token), and
    # again for a new list: the attention and DeltaNet layers' indices.
    from mlx_lily.layers.batch_step import layer_kinds

    text = models[1].language_model.model
    attention, linear = layer_kinds(text)
    assert list(attention) == text._cuts() and attention and linear
    assert sorted(attention + linear) == list(range(len(text.layers)))
    assert all(text.layers[i].is_linear for i in linear)
    assert layer_kinds(text) is layer_kinds(text)
    layers = text.layers
    k = attention[0] + 1
    try:
        text.layers = layers[:k]  # a new list: its own kinds
        assert layer_kinds(text) == (tuple(i for i in attention if i < k), tuple(i for i in linear if i < k))
    finally:
        text.layers = layers
    assert layer_kinds(text) == (attention, linear)
    first = layers[attention[0]]
    try:
        layers[attention[0]] = layers[linear[0]]  # replaced in place: worked out again
        assert attention[0] in layer_kinds(text)[1]
    finally:
        layers[attention[0]] = first
    assert layer_kinds(text) == (attention, linear)
