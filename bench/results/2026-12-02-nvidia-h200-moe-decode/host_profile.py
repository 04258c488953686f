"""Where one decode step's time goes: mlx_lm.generate's loop against BatchGenerator
(what the server runs) at B = 1 and 4, on lily, with cProfile of the B = 1 loop."""
import cProfile, io, json, os, pstats, sys, time
import numpy as np
import mlx.core as mx
import mlx_lily
from mlx_lily.random_checkpoints import make_checkpoint
from mlx_lm import stream_generate
from mlx_lm.generate import BatchGenerator

OUT = os.environ["OUT"]
res = {}
path = make_checkpoint(os.environ.get("CKPT", "ckpt") + "/qwen3.6-35b-a3b-conditioned-seed0", shape="qwen3.6-35b-a3b",
                       seed=0, quiet=False, conditioned=True)
t = time.perf_counter()
model, tok = mlx_lily.load(str(path), backend="lily")
res["load_s"] = time.perf_counter() - t
rng = np.random.default_rng(0)
prompts = [rng.integers(1000, 20000, 256).tolist() for _ in range(16)]
TOK = 64

def gen():
    last = None
    for last in stream_generate(model, tok, prompts[0], max_tokens=TOK):
        pass
    return last.generation_tps

for i in range(3):
    t = time.perf_counter(); tps = gen()
    res[f"generate_{i}"] = {"tps": tps, "wall_s": time.perf_counter() - t}
    print("generate", i, res[f"generate_{i}"], flush=True)

def batch(B, profile=False):
    bg = BatchGenerator(model, max_tokens=TOK)
    bg.insert(prompts[:B])
    steps = []
    prof = cProfile.Profile() if profile else None
    n_gen_steps = 0
    while True:
        t = time.perf_counter()
        if prof and n_gen_steps >= 8: prof.enable()
        p, g = bg.next()
        if prof: prof.disable()
        dt = time.perf_counter() - t
        if g and not p:
            steps.append(dt); n_gen_steps += 1
        if g and all(r.finish_reason for r in g) and len(g) == B:
            break
        if not g and not p and not bg._unprocessed_sequences and len(bg._generation_batch) == 0:
            break
    bg.close()
    s = sorted(steps[4:]) if len(steps) > 8 else sorted(steps)
    out = {"steps": len(steps), "median_ms": 1e3 * s[len(s) // 2], "per_stream_tps": 1 / s[len(s) // 2]}
    if prof:
        f = io.StringIO(); pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(35)
        f2 = io.StringIO(); pstats.Stats(prof, stream=f2).sort_stats("cumulative").print_stats(45)
        open(os.path.join(OUT, f"profile_b{B}.txt"), "w").write(f.getvalue() + "\n\n" + f2.getvalue())
    return out

for B in (1, 4, 1, 4, 8, 16):
    key = f"batch_{B}"
    r = batch(B)
    res.setdefault(key, []).append(r)
    print(key, r, flush=True)
res["batch_1_profiled"] = batch(1, profile=True)
res["batch_4_profiled"] = batch(4, profile=True)
# The bare step: model call on the batch caches, sync each step (no overlap)
json.dump(res, open(os.path.join(OUT, "host_profile.json"), "w"), indent=1)
print(json.dumps(res))
