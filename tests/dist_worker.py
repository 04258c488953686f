"""One rank of the two-rank tests (tests/test_distributed.py): load a
checkpoint with mlx-lm's ``sharded_load`` (tensor or pipeline parallel) on
stock and on lily, generate greedily from a prompt alone and from two
prompts batched (mlx-lm's ``batch_generate``: the server's caches), and
print one JSON line: each engine's token ids, and the layer paths lily's
calls took (``mlx_lily.call_trace``)."""

from __future__ import annotations

import argparse
import json
import sys

import mlx.core as mx
from mlx_lm.generate import batch_generate, generate_step
from mlx_lm.utils import sharded_load

from mlx_lily import call_trace
from mlx_lily.backend import using
from mlx_lily.layers.sharded import describe


def greedy(model, prompt, tokens):
    out = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=tokens):
        out.append(int(token))
    return out


def barrier(group) -> None:
    mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--parallel", choices=["tensor", "pipeline"], required=True)
    parser.add_argument("--tokens", type=int, default=6)
    parser.add_argument("--die", action="store_true", help="exit with an error after joining the group")
    args = parser.parse_args()
    group = mx.distributed.init(backend="ring", strict=True)
    if args.die and group.rank() == 1:
        raise SystemExit("rank 1 stops on purpose")
    prompts = [[1, 5, 9, 30, 200, 7, 11, 3], [4, 4, 17, 120]]
    result = {"rank": group.rank(), "size": group.size()}
    for engine in ("mlx", "lily"):
        with using(engine):
            if args.parallel == "tensor":
                model, _ = sharded_load(args.model, tensor_group=group)
            else:
                model, _ = sharded_load(args.model, pipeline_group=group)
        if engine == "lily":
            call_trace.start()
        alone = greedy(model, prompts[0], args.tokens)
        batched = batch_generate(model, _, prompts, max_tokens=args.tokens, return_token_ids=True)
        result[engine] = {"alone": alone, "batched": [list(map(int, t)) for t in batched.token_ids]}
        barrier(group)  # a rank's last queued send completes before the next load (or exit)
        if engine == "lily":
            result["paths"] = call_trace.seen()
            result["split"] = describe(model)
            call_trace.stop()
    print(json.dumps(result))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
