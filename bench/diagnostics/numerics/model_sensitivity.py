"""How far the random model's log-probabilities move when its input
embeddings are nudged (one bf16 step at one row; 1e-3 everywhere): the
scale of its sensitivity to rounding, against which differences between
engines are read. Random weights at the real shapes; prints one line per
nudge. The command behind bench/results/2026-11-29-nvidia-h200-462c4cc770's
model-sensitivity.txt."""
import mlx.core as mx, numpy as np
from mlx_lm.models.cache import make_prompt_cache
from mlx_lily.random_checkpoints import build_model
from bench.common import prompt_ids
from bench.measure import compare
model, config = build_model("qwen3.6-35b-a3b", seed=0)
V = config["text_config"]["vocab_size"]
toks = mx.array(prompt_ids(256, V))
emb = model.language_model.model.embed_tokens
def score(scale=None):
    h = emb(toks[None])
    if scale is not None:
        h = (h.astype(mx.float32) * scale).astype(h.dtype)
    lg = model(toks[None], cache=make_prompt_cache(model), input_embeddings=h)[0].astype(mx.float32)
    lp = lg - mx.logsumexp(lg, axis=-1, keepdims=True); mx.eval(lp); return np.array(lp)
ref = score()
for name, s in [("stock, embeddings x (1+2^-7) at row 0 only", None), ("stock, all embeddings x (1 + 1e-3)", 1 + 1e-3)]:
    if s is None:
        sc = mx.ones((1, 256, 1)); sc[0, 0, 0] = 1 + 2**-7
        c = compare(score(sc), ref, np.array(toks))
    else:
        c = compare(score(s), ref, np.array(toks))
    print(f"{name:45s} top1 {c['top1_agreement']:.3f} KL {c['kl_mean']:.2e} maxdiff {c['max_abs_logprob_diff']:.3f}", flush=True)
