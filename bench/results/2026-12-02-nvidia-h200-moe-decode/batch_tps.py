"""Decode speed through BatchGenerator (the server's loop, no HTTP) at B = 16, 4, 8, 1
streams and mlx_lm.generate's single stream, on lily, conditioned real-shape checkpoint;
then a B = 1 diagnostic: the batch caches' step synchronous vs pipelined."""
import json, os, time
import numpy as np
import mlx.core as mx
import mlx_lily
from mlx_lily.random_checkpoints import make_checkpoint
from mlx_lm import stream_generate
from mlx_lm.generate import BatchGenerator

OUT = os.environ["OUT"]
res = {}
def dump():
    json.dump(res, open(os.path.join(OUT, "batch_tps.json"), "w"), indent=1)
path = make_checkpoint(os.environ.get("CKPT", "ckpt") + "/qwen3.6-35b-a3b-conditioned-seed0", shape="qwen3.6-35b-a3b",
                       seed=0, quiet=True, conditioned=True)
t = time.perf_counter()
model, tok = mlx_lily.load(str(path), backend="lily")
res["load_s"] = time.perf_counter() - t
rng = np.random.default_rng(0)
prompts = [rng.integers(1000, 20000, 256).tolist() for _ in range(16)]
TOK = 48
for i in range(2):
    t = time.perf_counter()
    last = None
    for last in stream_generate(model, tok, prompts[0], max_tokens=TOK):
        pass
    res[f"generate_{i}"] = {"tps": last.generation_tps, "wall_s": time.perf_counter() - t}
    print("generate", i, res[f"generate_{i}"], flush=True); dump()

def batch(B):
    bg = BatchGenerator(model, max_tokens=TOK)
    bg.insert(prompts[:B])
    steps = []
    while True:
        t = time.perf_counter()
        p, g = bg.next()
        dt = time.perf_counter() - t
        if g and not p:
            steps.append(dt)
        if g and len(g) == B and all(r.finish_reason for r in g):
            break
        if not g and not p and not bg._unprocessed_sequences and len(bg._generation_batch) == 0:
            break
    bg.close()
    s = sorted(steps[4:])
    med = s[len(s) // 2]
    return {"steps": len(steps), "median_ms": 1e3 * med, "per_stream_tps": 1 / med, "aggregate_tps": B / med}

for B in (16, 4, 8, 1):
    t = time.perf_counter()
    warm = batch(B)
    r = batch(B)
    r["first_run_s"] = time.perf_counter() - t
    res[f"batch_{B}"] = r
    print(B, r, flush=True); dump()

# B = 1 on the batch caches: synchronous steps vs pipelined (as generate_step)
from mlx_lm.generate import _merge_caches
from mlx_lm.models.cache import make_prompt_cache
def merged():
    c = make_prompt_cache(model)
    mx.eval(model(mx.array(prompts[0])[None], cache=c))
    return _merge_caches([c])
cache = merged()
y = mx.zeros((1, 1), dtype=mx.int32)
walls = []
for i in range(40):
    t = time.perf_counter()
    logits = model(y, cache=cache)
    y = mx.argmax(logits[:, -1:], axis=-1)
    mx.eval(y)
    walls.append(time.perf_counter() - t)
res["diag_sync_ms"] = 1e3 * sorted(walls[8:])[16]
cache = merged()
y = mx.zeros((1, 1), dtype=mx.int32)
def nxt(y):
    logits = model(y, cache=cache)
    return mx.argmax(logits[:, -1:], axis=-1)
nx = nxt(y); mx.async_eval(nx)
t0 = time.perf_counter()
for i in range(40):
    cur = nx
    nx = nxt(cur); mx.async_eval(nx)
    cur.item()
res["diag_pipelined_ms"] = 1e3 * (time.perf_counter() - t0) / 40
print("diag", res["diag_sync_ms"], res["diag_pipelined_ms"], flush=True); dump()
