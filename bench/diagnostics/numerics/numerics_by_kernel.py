"""Teacher-forced numerics of lily against stock with lily's kernels on one
at a time (none, the router's, the recurrence's, all), beside stock against
itself (a repeat; the prompt in two chunks), then the first DeltaNet and MoE
layers alone: which kernel moves the model's output, and by how much.
`python3 bench/diagnostics/numerics/numerics_by_kernel.py [SHAPE]`; the
command behind bench/results/2026-11-29-nvidia-h200-462c4cc770's
numerics-by-kernel.txt."""
import sys
import mlx.core as mx, numpy as np
from mlx_lm.models.cache import make_prompt_cache
from mlx_lily.random_checkpoints import build_model
from mlx_lily.models.qwen3_5_moe import specialize
from mlx_lily import kernels as K
from bench.common import prompt_ids
from bench.measure import compare

shape = sys.argv[1] if len(sys.argv) > 1 else "qwen3.6-35b-a3b"
model, config = build_model(shape, seed=0)
V = config["text_config"]["vocab_size"]
toks = mx.array(prompt_ids(256, V))

def score(chunks=(256,)):
    cache = make_prompt_cache(model)
    outs, a = [], 0
    for c in chunks:
        outs.append(model(toks[None, a:a + c], cache=cache)[0]); a += c
    lg = mx.concatenate(outs).astype(mx.float32)
    lp = lg - mx.logsumexp(lg, axis=-1, keepdims=True)
    mx.eval(lp)
    return np.array(lp)

def show(name, lp, ref):
    c = compare(lp, ref, np.array(toks))
    print(f"{name:40s} top1 {c['top1_agreement']:.3f} KL {c['kl_mean']:.2e} maxdiff {c['max_abs_logprob_diff']:.3f}", flush=True)

specialize(model, lily=False)
stock = score()
show("stock vs stock (repeat)", score(), stock)
show("stock, prompt in 2 chunks", score((128, 128)), stock)
specialize(model, lily=True)
kernels = {n: op.kernel for n, op in K.OPS.items()}
def only(names):
    for n, op in K.OPS.items():
        op.kernel = kernels[n] if n in names else None
only([]); show("lily, all references", score(), stock)
only(["router_topk"]); show("lily, router kernel only", score(), stock)
only(["gated_delta"]); show("lily, gated_delta kernel only", score(), stock)
only(list(kernels)); show("lily, all kernels", score(), stock)
# One layer in isolation: GDN layer 0 with kernel vs reference.
x = (0.5 * mx.random.normal((1, 256, config["text_config"]["hidden_size"]), key=mx.random.key(1))).astype(mx.bfloat16)
layer = model.layers[0].linear_attn
only([]); ref = layer(x); only(["gated_delta"]); got = layer(x)
print("GDN layer 0: max |diff| / max |ref| =", (mx.abs(got.astype(mx.float32) - ref.astype(mx.float32)).max() / mx.abs(ref.astype(mx.float32)).max()).item())
moe = model.layers[0].mlp
only([]); ref = moe(x); only(["router_topk"]); got = moe(x)
print("MoE layer 0: max |diff| / max |ref| =", (mx.abs(got.astype(mx.float32) - ref.astype(mx.float32)).max() / mx.abs(ref.astype(mx.float32)).max()).item())
inds_ref, _ = K.router_topk.reference(moe.gate(x), moe.top_k, True)
inds_k, _ = kernels["router_topk"](moe.gate(x), moe.top_k, True)
same = (mx.sort(inds_ref, axis=-1) == mx.sort(inds_k, axis=-1)).all(axis=-1)
print("router: rows with the same expert set:", same.sum().item(), "/", same.size)
