"""Per-op device time of the batched decode kernels at the real shapes, B = 1, 4, 8, 16
(each op called 20 times in one graph, timed over 3 rounds after a warm one)."""
import json, os, sys, time
import mlx.core as mx
import numpy as np
from mlx_lily import kernels as K
from mlx_lily.kernels.linear.testing import gemv_call
from mlx_lily.kernels.moe.testing import moe_decode_inputs
from mlx_lily.kernels.gated_delta.testing import gated_delta_decode_inputs

def timed(fn, args, kwargs, reps=20):
    def run():
        outs = [fn(*args, **kwargs) for _ in range(reps)]
        mx.eval(outs)
    run()
    best = 1e9
    for _ in range(3):
        t = time.perf_counter(); run(); best = min(best, time.perf_counter() - t)
    return best / reps * 1e6

out = {}
for B in (1, 2, 4, 8, 16):
    r = {}
    a, k = gemv_call(2048, [8192, 4096, 32, 32], [4, 4, 4, 4], prologue="norm", batch=B)
    r["gemv_deltanet_in"] = timed(K.quantized_matvec, a, k); r["gemv_path"] = K.OPS["quantized_matvec"].last_path
    a, k = gemv_call(4096, [2048], [4], prologue="gate", residual=True, batch=B)
    r["gemv_o_proj"] = timed(K.quantized_matvec, a, k)
    a, k = gemv_call(2048, [256, 1], [8, 8], prologue="norm", batch=B)
    r["gemv_router"] = timed(K.quantized_matvec, a, k)
    a = moe_decode_inputs(2048, 256, 8, 512, 512, rows=B, seed=1)
    args, kw = (a if isinstance(a, tuple) and len(a) == 2 and isinstance(a[1], dict) else (a, {}))
    r["moe_decode"] = timed(K.moe_decode, args, kw); r["moe_path"] = K.OPS["moe_decode"].last_path
    a, k = gated_delta_decode_inputs(16, 32, 128, 128, B=B)
    r["gated_delta_decode"] = timed(K.gated_delta_decode, a, k); r["gdn_path"] = K.OPS["gated_delta_decode"].last_path
    S = 512
    q = mx.random.normal((B, 16, 1, 256)).astype(mx.bfloat16)
    kv = mx.random.normal((B, 2, 1024, 256)).astype(mx.bfloat16)
    start = mx.array([0] * B, dtype=mx.int32); length = mx.array([S], dtype=mx.int32)
    r["attention_decode_512"] = timed(K.attention, (q, kv, kv, 0.0625, None), {"length": length, "start": start})
    r["attn_path"] = K.OPS["attention"].last_path
    out[B] = r
    print(B, {k2: (round(v, 1) if isinstance(v, float) else v) for k2, v in r.items()}, flush=True)
json.dump(out, open(os.path.join(os.environ["OUT"], "rows_time.json"), "w"), indent=1)
