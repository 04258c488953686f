"""The graph of one lily decode step, node by node.

    python3 -m bench.diagnostics.decode.decode_graph [--shape qwen3.6-35b-a3b] [--context 512] [--first 120] [--out DIR]

The real model's layer stack (random weights at ``--shape``), CONTEXT prompt
tokens, then one decode step traced by ``bench.counts.trace`` (nothing is
evaluated). Prints the number of nodes, the count of each primitive, and the
first FIRST nodes with their inputs' and outputs' shapes: where the views
(reshapes, slices) between kernels sit. Each node is host work at every token
(``mx.compile`` replays it, MLX evaluates it), a kernel or not. On a machine
without a GPU lily's ops run their references, and the graph shows those.
"""

from __future__ import annotations

import argparse
from collections import Counter

import mlx.core as mx

from bench.common import write_report


def describe(nodes: list, first: int) -> str:
    lines = [f"{len(nodes)} nodes", str(Counter(n["name"] for n in nodes).most_common())]
    for n in nodes[:first]:
        ins = [tuple(i[1]) for i in n["inputs"]][:3]
        outs = [tuple(o[1]) for o in n["outputs"]][:3]
        lines.append(f"{n['name']} {ins} -> {outs}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen3.6-35b-a3b")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--first", type=int, default=120, help="nodes listed one by one (default 120)")
    p.add_argument("--out", help="also write DIR/decode_graph.txt")
    args = p.parse_args(argv)

    from bench.counts import trace
    from bench.engines import load_shared, switch
    from bench.measure import prefilled_cache

    model, vocab, _, _ = load_shared({"model": None, "shape": args.shape, "seed": 0, "conditioned": False})
    switch(model, "lily")
    cache = prefilled_cache(model, vocab, args.context)
    nodes = trace(lambda tok: model(tok[None], cache=cache), mx.array([1]))
    write_report(args.out, "decode_graph.txt", describe(nodes, args.first))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
