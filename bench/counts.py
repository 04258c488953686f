"""Kernels and bytes of one decode step, counted from its MLX graph.

The Apple proxy for decode cost: it counts on any machine, no timing needed.

How the graph is read
---------------------
``mx.export_function`` with a callback (public in MLX 0.32) traces a function
and hands every primitive node of its graph to the callback, in order, with
the node's input and output arrays as (name, shape, dtype). It evaluates
nothing. One decode step is traced as ``token -> model(token[None], cache)``
(the model's forward of one token; mlx-lm's sampler adds the same few small
kernels to both engines and is not counted). The weights and the cache arrays
enter the graph as constants: they are passed by reference, never copied.
``mx.export_to_dot`` draws the same graph but without shapes or dtypes, so
bytes could not be counted from it.

What is counted
---------------
* **Kernels** (``kernels_per_decode_token``): every primitive node, except the
  ones MLX evaluates as views of their input (``VIEW_PRIMITIVES``: reshape,
  transpose, slice, broadcast, expand/squeeze, flatten, split, ...). A custom
  kernel (``mx.fast.metal_kernel`` / ``cuda_kernel``) is one node, so one
  kernel; so is a fused fast op (rms_norm, RoPE, SDPA) where MLX builds it
  as one primitive. This is the number of launches the graph asks for; at run
  time MLX can add copies (a reshape of a non-contiguous array, a kernel's
  non-contiguous input, one copy per input of a concatenate).
* Lily's kernels are built for the trace without the row-contiguous copy MLX
  otherwise puts before each custom kernel's input (``traced_not_run`` in
  ``mlx_lily/toolchain/tracing.py``; export cannot serialize that primitive).
  Where an input is a non-contiguous view, the kernel run copies it first: a
  launch and bytes this count leaves out.
* Export traces through ``mx.compile``: a compiled function's element-wise ops
  count one each here, where MLX would fuse them into one kernel at run time.
  The count is an upper bound for code that relies on ``mx.compile``.
* The graph is the one MLX builds on the default device: on the CPU the fast
  ops are built from plain ops (more nodes), on a GPU as one primitive each.
  Compare counts taken on the same device.
* **Bytes** (``bytes_per_decode_token``): for every kernel node, the bytes of
  its inputs plus the bytes of its outputs, summed over nodes (not the
  distinct arrays: an array read by three kernels is read three times, which
  is the traffic fusion removes). An input that is a view counts the
  smallest array along its chain of views (a slice reads the slice, a
  broadcast reads its source). Gathers read what they gather
  (``_read_bytes``): ``gather_qmm``/``gather_mm`` the selected experts'
  weights (indices x one expert's bytes), ``take``-style gathers their output's
  size, and in-place updates (slice update, scatter) move only the update.
  Lily's MoE kernels are read the same way (``GATHERED_KERNEL_INPUTS``): the
  prefill GEMMs by their row-order input, the decode chain by the top-k it
  picks in the kernel (its ids output) or is given (the down kernel's ids).

``bytes_token_must_read`` is the floor to compare with: the weights one token
touches (every non-expert parameter whole, top-k of each layer's experts, one
row of the embedding table unless it doubles as the output head) plus the
cache state the step reads (keys and values up to the context, the recurrent
and conv states). ``ratio_to_must_read`` = bytes_per_decode_token / that.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import mlx.core as mx

# Primitives MLX evaluates without a kernel: their output shares the input's
# buffer (a reshape copies only when the strides do not allow a view).
VIEW_PRIMITIVES = frozenset({
    "Reshape", "Transpose", "Slice", "Broadcast", "BroadcastAxes", "ExpandDims",
    "Squeeze", "Flatten", "Unflatten", "AsStrided", "Split", "View",
    "StopGradient", "Depends",
})

# Primitives that update their first input in place (it is donated at run
# time): they move the update, not the whole buffer.
IN_PLACE_PRIMITIVES = frozenset({"SliceUpdate", "Scatter", "ScatterAxis"})

# Gathers that read only the gathered slices of their first input.
TAKE_PRIMITIVES = frozenset({"Gather", "GatherAxis"})

# Expert-indexed matmuls: inputs [x, weight operands..., lhs_indices, rhs_indices].
EXPERT_MATMULS = frozenset({"GatherQMM", "GatherMM"})

# Lily's custom kernels that read only some experts of their weight inputs:
# kernel name -> (where the number of (token, expert) picks is read: the size
# of ("inputs", i) or ("outputs", i), positions of the expert-indexed weight
# inputs). MLX names a custom kernel's primitive "custom_kernel_" + the name
# it was built with (lily's: the kernel's name, "_", a digest).
GATHERED_KERNEL_INPUTS: Dict[str, Tuple[Tuple[str, int], Sequence[int]]] = {
    "moe_gate_up": (("inputs", 1), range(3, 9)),  # the row order
    "moe_down": (("inputs", 1), range(3, 9)),
    # The decode chain's expert walk (the union of its rows' picks: B x top-k
    # entries, exact for one row; bench/batch_counts.py counts the union).
    "moe_decode_gate_up": (("inputs", 1), range(2, 8)),
    "moe_decode_down": (("inputs", 1), range(4, 7)),
    # Down and the combine as one launch (one row): its picks are input 2.
    "moe_decode_down_combine": (("inputs", 2), range(5, 8)),
    # Route and gate/up as one launch (a few rows): its picks are an output.
    "moe_decode_route_gate_up": (("outputs", 1), range(4, 10)),
}
CUSTOM_KERNEL_PREFIX = "custom_kernel_"

Node = Dict[str, Any]
Arr = Tuple[str, Tuple[int, ...], Any]  # (name, shape, dtype) as export gives them


def _nbytes(arr: Arr) -> int:
    _, shape, dtype = arr
    size = 1
    for d in shape:
        size *= int(d)
    return size * dtype.size


def trace(fn, *args: mx.array) -> List[Node]:
    """The primitive nodes of ``fn(*args)``'s graph, in evaluation order:
    dicts with ``name``, ``arguments``, ``inputs`` and ``outputs``."""
    from mlx_lily.toolchain.tracing import traced_not_run

    nodes: List[Node] = []

    def collect(entry: Dict[str, Any]) -> None:
        if entry.get("type") == "primitive":
            nodes.append({k: entry[k] for k in ("name", "arguments", "inputs", "outputs")})

    with traced_not_run():
        mx.export_function(collect, fn, *args)
    return nodes


def kernel_in(node: Node, table: Dict[str, Any]) -> Optional[str]:
    """Which name of ``table`` a custom kernel node was built as, from the
    name in the primitive's state (its first string: the name, "_", a
    digest), or None. The longest name is tried first, since one may extend
    another (moe_decode_down_combine_<digest> is not moe_decode_down's)."""
    stack = list(node.get("arguments") or [])
    while stack:
        a = stack.pop(0)
        if isinstance(a, str):
            built = a[len(CUSTOM_KERNEL_PREFIX):] if a.startswith(CUSTOM_KERNEL_PREFIX) else a
            for name in sorted(table, key=len, reverse=True):
                if built == name or built.startswith(name + "_"):
                    return name
            return None
        if isinstance(a, (list, tuple)):
            stack.extend(a)
    return None


def _read_bytes(node: Node, view_bytes: Dict[str, int]) -> int:
    """Bytes a kernel node reads from its inputs (see the module docstring)."""
    inputs = node["inputs"]
    sizes = [view_bytes.get(a[0], _nbytes(a)) for a in inputs]
    name = node["name"]
    if name in IN_PLACE_PRIMITIVES:
        return sum(sizes[1:])
    if name in TAKE_PRIMITIVES:
        return min(sizes[0], sum(_nbytes(o) for o in node["outputs"])) + sum(sizes[1:])
    picks_from: Optional[Arr] = None
    weight_pos: Sequence[int] = ()
    if name in EXPERT_MATMULS:
        picks_from, weight_pos = inputs[-1], range(1, len(inputs) - 2)
    elif name == "CustomKernel":
        kernel = kernel_in(node, GATHERED_KERNEL_INPUTS)
        if kernel is not None:
            (where, i), weight_pos = GATHERED_KERNEL_INPUTS[kernel]
            picks_from = node[where][i]
    if picks_from is not None:
        picks = 1
        for d in picks_from[1]:
            picks *= int(d)
        for i in weight_pos:
            if i < len(inputs) and len(inputs[i][1]) >= 3:
                experts = int(inputs[i][1][0])
                sizes[i] = min(sizes[i], sizes[i] // experts * picks)
    return sum(sizes)


def _write_bytes(node: Node) -> int:
    if node["name"] in IN_PLACE_PRIMITIVES:
        return sum(_nbytes(a) for a in node["inputs"][1:2])  # the update
    return sum(_nbytes(o) for o in node["outputs"])


def kernel_nodes(nodes: List[Node]) -> Iterator[Tuple[Node, int, int]]:
    """(node, bytes read, bytes written) for each node of a traced graph
    that runs a kernel (views are followed, not counted)."""
    view_bytes: Dict[str, int] = {}  # a view's output -> bytes a reader reads
    for node in nodes:
        if node["name"] in VIEW_PRIMITIVES:
            source = node["inputs"][0] if node["inputs"] else None
            src = view_bytes.get(source[0], _nbytes(source)) if source else 0
            for out in node["outputs"]:
                view_bytes[out[0]] = min(_nbytes(out), src) if source else _nbytes(out)
            continue
        yield node, _read_bytes(node, view_bytes), _write_bytes(node)


def kernel_label(node: Node) -> str:
    """What names a kernel node's launches: a custom kernel's built name
    (``custom_kernel_<name>_<digest>``, as the GPU's profiler shows it), else
    the primitive's name."""
    if node["name"] == "CustomKernel":
        stack = list(node.get("arguments") or [])
        while stack:
            a = stack.pop(0)
            if isinstance(a, str):
                return a if a.startswith(CUSTOM_KERNEL_PREFIX) else CUSTOM_KERNEL_PREFIX + a
            if isinstance(a, (list, tuple)):
                stack.extend(a)
    return node["name"]


def bytes_by_kernel(nodes: List[Node]) -> Dict[str, List[int]]:
    """{kernel label: bytes each of its nodes moves (read + written)}."""
    out: Dict[str, List[int]] = {}
    for node, read, write in kernel_nodes(nodes):
        out.setdefault(kernel_label(node), []).append(read + write)
    return out


def count_nodes(nodes: List[Node]) -> Dict[str, Any]:
    """Kernels and bytes of a traced graph (``trace``'s nodes)."""
    kernels, read, write = 0, 0, 0
    by_primitive: Dict[str, int] = {}
    for node, r, w in kernel_nodes(nodes):
        kernels += 1
        by_primitive[node["name"]] = by_primitive.get(node["name"], 0) + 1
        read += r
        write += w
    return {
        "kernels": kernels,
        "bytes": read + write,
        "bytes_read": read,
        "bytes_written": write,
        "nodes": len(nodes),
        "by_primitive": dict(sorted(by_primitive.items(), key=lambda kv: -kv[1])),
    }


def count_fn(fn, *args: mx.array) -> Dict[str, Any]:
    """Kernels and bytes of ``fn(*args)``'s graph."""
    return count_nodes(trace(fn, *args))


# ------------------------------------------------------ the model's floor


def _tree_bytes(tree: Any) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(tree) if isinstance(v, mx.array))


def _top_k(model: Any) -> Optional[int]:
    for _, m in model.named_modules():
        k = getattr(m, "top_k", None)
        if isinstance(k, int):
            return k
    return None


def weights_touched(model: Any) -> Dict[str, int]:
    """Bytes of the weights one decode token reads (module docstring)."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    top_k = _top_k(model)
    inner = getattr(model, "language_model", model)
    tied = not hasattr(inner, "lm_head") and not hasattr(model, "lm_head")
    experts, embedding, total = 0, 0, _tree_bytes(model.parameters())
    for name, m in model.named_modules():
        if isinstance(m, (SwitchLinear, QuantizedSwitchLinear)):
            full = _tree_bytes(m.parameters())
            n = m.weight.shape[0]
            experts += full if top_k is None else full * min(top_k, n) // n
            total -= full
        elif name.endswith("embed_tokens") and not tied:
            full = _tree_bytes(m.parameters())
            embedding += full // m.weight.shape[0]
            total -= full
    return {"dense": total, "experts": experts, "embedding": embedding}


def cache_bytes(cache: Sequence[Any]) -> int:
    """Bytes of the cache state a step reads: keys/values up to the context
    (``state`` slices them), recurrent and conv states."""
    return sum(_tree_bytes(c.state) for c in cache)


def decode_step_counts(model: Any, cache: Sequence[Any], token: int = 0) -> Dict[str, Any]:
    """Kernels and bytes of one decode step of ``model`` at ``cache``'s
    context, and the bytes that token must read.

    The trace rebinds the cache's arrays to traced ones: use a cache that is
    thrown away afterwards (the bench counts on its run's cache, after the
    measured tokens)."""
    mx.eval([c.state for c in cache])
    context = max((getattr(c, "offset", 0) for c in cache), default=0)
    must = weights_touched(model)
    must["cache"] = cache_bytes(cache)
    must_total = sum(must.values())
    counts = count_fn(lambda tok: model(tok[None], cache=cache), mx.array([token]))
    layers = len(getattr(model, "layers", None) or [])
    return {
        "method": "mx.export_function graph trace (see bench/counts.py)",
        "device": str(mx.default_device()),
        "context": int(context),
        "kernels_per_decode_token": counts["kernels"],
        "kernels_per_layer": counts["kernels"] / layers if layers else None,
        "bytes_per_decode_token": counts["bytes"],
        "bytes_read": counts["bytes_read"],
        "bytes_written": counts["bytes_written"],
        "graph_nodes": counts["nodes"],
        "by_primitive": counts["by_primitive"],
        "bytes_token_must_read": must_total,
        "must_read_parts": must,
        "ratio_to_must_read": counts["bytes"] / must_total if must_total else None,
    }
