"""bench/counts.py: kernels and bytes of a graph, exact on small graphs, and
one decode step of the demo checkpoint for both engines."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from bench.counts import count_fn, decode_step_counts, weights_touched
from bench.engines import lily_layer_count, load_shared, switch

F32 = 4


def _evaluated(*arrays):
    mx.eval(*arrays)
    return arrays


def test_matmul_add_exact():
    # x [4, 8] @ w [8, 3] + c [3]: Matmul and Add are kernels; the broadcast of
    # c is a view and the Add reads c's 3 elements, not the broadcast [4, 3].
    x, w, c = _evaluated(mx.ones((4, 8)), mx.ones((8, 3)), mx.ones((3,)))
    counts = count_fn(lambda x: x @ w + c, x)
    assert counts["kernels"] == 2
    assert counts["by_primitive"] == {"Matmul": 1, "Add": 1}
    matmul = (4 * 8 + 8 * 3) * F32 + 4 * 3 * F32  # reads x and w, writes [4, 3]
    add = (4 * 3 + 3) * F32 + 4 * 3 * F32  # reads the product and c, writes [4, 3]
    assert counts["bytes_read"] + counts["bytes_written"] == counts["bytes"] == matmul + add


def test_views_are_not_kernels_and_slices_read_the_slice():
    (big,) = _evaluated(mx.ones((8, 16)))
    # transpose + reshape are views; the slices' rows are what the add reads.
    counts = count_fn(lambda x: mx.exp(x.T.reshape(8, 16)[:2] + x[:2]), big)
    assert counts["by_primitive"] == {"Add": 1, "Exp": 1}
    add = 2 * 16 * F32 * 2 + 2 * 16 * F32
    exp = 2 * 16 * F32 * 2
    assert counts["bytes"] == add + exp


def test_gather_qmm_reads_only_the_selected_experts():
    experts, d_in, d_out, top_k = 6, 64, 32, 2
    w, scales, biases = mx.quantize(mx.ones((experts, d_out, d_in)), group_size=32, bits=4)
    inds = mx.array([[1, 4]], dtype=mx.uint32)
    rows = mx.zeros((1, top_k), dtype=mx.uint32)
    x = mx.ones((1, 1, 1, d_in))
    _evaluated(w, scales, biases, inds, rows)
    counts = count_fn(
        lambda x: mx.gather_qmm(x, w, scales, biases, lhs_indices=rows, rhs_indices=inds,
                                transpose=True, group_size=32, bits=4),
        x,
    )
    assert counts["by_primitive"] == {"GatherQMM": 1}
    one_expert = (w.nbytes + scales.nbytes + biases.nbytes) // experts
    out = 1 * top_k * 1 * d_out * F32
    assert counts["bytes"] == x.nbytes + top_k * one_expert + rows.nbytes + inds.nbytes + out


def _custom_kernel_node_counts(name, inputs, output_shapes, output_dtypes):
    """Counts of one custom kernel node as MLX builds it (a Metal kernel:
    traced, never compiled, so any machine can build the node)."""
    kernel = mx.fast.metal_kernel(
        name=name, input_names=[f"in{i}" for i in range(len(inputs))],
        output_names=[f"out{i}" for i in range(len(output_shapes))], source="",
    )
    return count_fn(
        lambda *xs: kernel(inputs=list(xs), grid=(32, 1, 1), threadgroup=(32, 1, 1),
                           output_shapes=output_shapes, output_dtypes=output_dtypes, template=[("K", 4)]),
        *inputs,
    )


def test_moe_decode_kernels_read_only_the_experts_they_pick():
    # One row: its k picks are the experts the kernels walk (B x k entries).
    from mlx_lily.kernels.moe.decode import (
        moe_decode_down_combine_kernel,
        moe_decode_down_kernel,
        moe_decode_gate_up_kernel,
    )

    E, I, D, k = 16, 64, 128, 4
    experts = lambda cols, dtype: mx.zeros((E, I, cols), dtype)  # noqa: E731
    weights = [experts(D // 8, mx.uint32), experts(D // 64, mx.bfloat16), experts(D // 64, mx.bfloat16)] * 2
    shared = [mx.zeros((I, D // 8), mx.uint32), mx.zeros((I, D // 64), mx.bfloat16),
              mx.zeros((I, D // 64), mx.bfloat16)] * 2
    inds = mx.zeros((1, k), mx.uint32)  # the row's picks: the experts the kernels walk
    gate_up_in = [mx.zeros((1, D), mx.bfloat16), inds, *weights, *shared]
    down_w = [mx.zeros((E, D, I // 8), mx.uint32), mx.zeros((E, D, I // 64), mx.bfloat16),
              mx.zeros((E, D, I // 64), mx.bfloat16)]
    shared_down = [mx.zeros((D, I // 8), mx.uint32), mx.zeros((D, I // 64), mx.bfloat16),
                   mx.zeros((D, I // 64), mx.bfloat16)]
    down_in = [mx.zeros((1, k + 1, I), mx.bfloat16), inds, mx.zeros((1, k), mx.bfloat16),
               mx.zeros((1, 1, 1), mx.bfloat16), *down_w, *shared_down]
    # Down and the combine as one launch: h first, then down's inputs.
    down_combine_in = [mx.zeros((1, 1, D), mx.bfloat16), *down_in]
    _evaluated(*gate_up_in, *down_combine_in)
    cases = [
        (moe_decode_gate_up_kernel, gate_up_in, [(1, k + 1, I)], [mx.bfloat16], weights),
        (moe_decode_down_kernel, down_in, [(1, k + 1, D)], [mx.bfloat16], down_w),
        (moe_decode_down_combine_kernel, down_combine_in, [(1, 1, D)], [mx.bfloat16], down_w),
    ]
    for kernel, inputs, shapes, dtypes, gathered in cases:
        ours = _custom_kernel_node_counts(kernel.backend_name("metal"), inputs, shapes, dtypes)
        other = _custom_kernel_node_counts("some_kernel", inputs, shapes, dtypes)
        assert ours["kernels"] == other["kernels"] == 1
        whole = sum(a.nbytes for a in gathered)
        assert other["bytes"] - ours["bytes"] == whole - whole // E * k, kernel.name


def test_a_contiguous_copy_is_traced_as_one_kernel():
    # mx.contiguous has no exportable state: lily's graphs use the toolchain's
    # contiguous(), which a trace sees as one copy-like node (read + write).
    from mlx_lily.toolchain.tracing import contiguous

    (big,) = _evaluated(mx.arange(8 * 16, dtype=mx.float32).reshape(8, 16))
    with pytest.raises(ValueError, match="Contiguous"):
        count_fn(lambda x: mx.contiguous(x[:, 4:]), big)
    counts = count_fn(lambda x: contiguous(x[:, 4:]), big)
    assert counts["kernels"] == 1
    assert counts["bytes"] == 8 * 12 * F32 + F32 + 8 * 12 * F32  # the slice, the 1, the copy
    assert mx.array_equal(contiguous(big[:, 4:]), big[:, 4:]).item()


def test_lily_builds_no_bare_contiguous():
    """Every row-contiguous copy in lily's graphs goes through the toolchain's
    contiguous(), so that a decode step can be traced for its counts."""
    import pathlib

    import mlx_lily

    root = pathlib.Path(mlx_lily.__file__).parent
    bare = [str(p.relative_to(root)) for p in root.rglob("*.py")
            if "mx.contiguous(" in p.read_text() and p.name != "tracing.py"]
    assert bare == []


def _decode_counts(model, engine):
    switch(model, engine)
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(list(range(1, 25)))[None], cache=cache))
    return decode_step_counts(model, cache, token=3)


def test_demo_decode_step_counts(demo_checkpoint, monkeypatch):
    # Every lily op on its reference: lily's graph is then stock's, node for node.
    monkeypatch.setenv("MLX_LILY_KERNELS", "0")
    model, _, _, note = load_shared({"model": str(demo_checkpoint)})
    assert note is None
    stock = _decode_counts(model, "stock")
    lily = _decode_counts(model, "lily")
    assert lily_layer_count(model) > 0  # the lily count really ran lily's classes
    for c in (stock, lily):
        assert c["kernels_per_decode_token"] > 0 and c["bytes_per_decode_token"] > 0
        assert c["context"] == 24
        # The token reads at least every touched weight and the cache once.
        assert c["bytes_per_decode_token"] >= c["bytes_token_must_read"] > 0
    same = ("kernels_per_decode_token", "bytes_per_decode_token", "by_primitive",
            "bytes_token_must_read")
    assert {k: lily[k] for k in same} == {k: stock[k] for k in same}

    # The floor: top-k of the experts, the rest whole, one embedding row.
    parts = weights_touched(model)
    assert 0 < parts["experts"] < parts["dense"]
    assert stock["must_read_parts"]["cache"] > 0
    assert stock["bytes_token_must_read"] == sum(stock["must_read_parts"].values())


def test_counting_leaves_the_model_usable(demo_checkpoint):
    """The trace rebinds the counted cache only: a fresh cache still decodes."""
    model, _, _, _ = load_shared({"model": str(demo_checkpoint)})
    _decode_counts(model, "stock")
    cache = make_prompt_cache(model)
    logits = model(mx.array([[1, 2, 3]]), cache=cache)
    mx.eval(logits)
    assert logits.shape[:2] == (1, 3) and bool(mx.isfinite(logits.astype(mx.float32)).all())


def test_batched_counts_read_the_union_and_the_rows_spans():
    # bench/batch_counts.py rewrites lily's batched kernels' inputs to what
    # they read: the MoE kernels the union of the rows' experts, the decode
    # attention each row's span of the KV buffer, before count_nodes.
    from bench import batch_counts as bc
    from bench import counts

    E, I, D = 16, 64, 128
    bf16 = mx.bfloat16
    expert = ("w", (E, I, D // 8), mx.uint32)
    per_expert = I * D // 8 * 4
    gate_up = {"name": "CustomKernel", "arguments": ["custom_kernel_moe_decode_gate_up_abc"],
               "inputs": [("x", (2, D), bf16), ("inds", (2, 4), mx.uint32)] + [expert] * 6,
               "outputs": [("o", (2, 5, I), bf16)]}
    union = 5
    scaled = [bc._scaled(a, union) if i in bc.UNION_KERNELS["moe_decode_gate_up"] else a
              for i, a in enumerate(gate_up["inputs"])]
    node = dict(gate_up, inputs=scaled)
    held = dict(counts.GATHERED_KERNEL_INPUTS)
    got = bc._count_as_read([node])
    assert counts.GATHERED_KERNEL_INPUTS == held  # the one-row table is back
    small = 2 * D * 2 + 2 * 4 * 4
    assert got["bytes_read"] == small + 6 * union * per_expert
    # The attention reads the rows' spans of a [B, H, S, D] buffer.
    name, shape, dtype = bc._rows(("k", (4, 2, 1024, 64), bf16), span_rows=300, buffer_rows=4 * 1024)
    assert shape == (1, 2, 300, 64)
    assert counts.kernel_in({"arguments": ["custom_kernel_attention_decode_123"]}, bc.SPAN_KERNELS) == "attention_decode"
    assert counts.kernel_in({"arguments": ["custom_kernel_attention_combine_1"]}, bc.SPAN_KERNELS) is None
