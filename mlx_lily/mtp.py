"""The multi-token-prediction (MTP) head of Qwen3.5/3.6 checkpoints.

Qwen publishes these models with one extra decoder layer (``mtp.*`` tensors,
``mtp_num_hidden_layers: 1`` in config.json) that predicts the token after
next. At position t it takes the main model's final hidden state h_t (after
the final norm, the vector the main head reads) and the embedding of the
token that follows, x_{t+1}:

    e = pre_fc_norm_embedding(embed(x_{t+1}))
    g = pre_fc_norm_hidden(h_t)
    u = fc(concat([e, g]))            # 2 * hidden -> hidden
    u = layers[i](u)                   # full attention + MoE, its own KV cache
    h'_t = norm(u)                     # logits: the main model's lm_head(h'_t)

h'_t predicts x_{t+2}; fed back as the hidden state with x_{t+2}'s embedding
it drafts x_{t+3}, and so on. The head's attention runs at position t, the
main model's position for h_t.

mlx-lm's ``sanitize`` drops ``mtp.*``. Lily's model keeps the head where the
checkpoint has one: ``sanitize`` builds it (``attach``) at
``language_model.mtp`` before mlx-lm quantizes the model, so it is quantized
like every other layer (config.json's entry for a layer, else its tensors).
A checkpoint without ``mtp.*`` tensors builds no head and loads as before.

Tensor names, relative to ``mtp.``, in an mlx checkpoint (what ``save_model``
writes, under ``language_model.mtp.``): ``fc``, ``pre_fc_norm_embedding``,
``pre_fc_norm_hidden``, ``norm``, ``layers.N.*`` as a full-attention decoder
layer of the main model (experts as ``mlp.switch_mlp.*``). In the original
(Hugging Face) checkpoint the same names follow ``mtp.``, with the experts
either fused (``mlp.experts.gate_up_proj`` [E, 2I, D], ``mlp.experts.down_proj``
[E, D, I]) or one tensor per expert (``mlp.experts.N.gate_proj.weight``...), and
RMSNorm weights stored as offsets from 1 (as the main model's).
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.qwen3_5 import DecoderLayer, TextModelArgs

from .errors import CheckpointError

# Where the head lives in lily's model, and its tensors' prefix there.
ATTRIBUTE = "mtp"
PREFIX = "language_model.mtp."

# The config.json field (text_config) that declares the head's layers.
LAYERS_FIELD = "mtp_num_hidden_layers"

# RMSNorm weights the original checkpoint stores as offsets from 1 (Gemma
# style), as mlx-lm's sanitize treats the main model's.
_OFFSET_NORMS = re.compile(
    r"^(pre_fc_norm_embedding|pre_fc_norm_hidden|norm|layers\.\d+\.(input_layernorm|post_attention_layernorm"
    r"|self_attn\.q_norm|self_attn\.k_norm))\.weight$"
)
_LAYER = re.compile(r"^layers\.(\d+)\.")
_PER_EXPERT = re.compile(r"^(layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class MTPHead(nn.Module):
    """The head's parameters and its forward pass. Built with stock mlx-lm's
    layer; lily's model switches it to lily's classes as it does its own
    layers (``models/qwen3_5_moe.specialize``), so a draft step of one token
    runs the fused decode step. ``args``: the language model's TextModelArgs."""

    def __init__(self, args: TextModelArgs, num_layers: int = 1):
        super().__init__()
        D, eps = args.hidden_size, args.rms_norm_eps
        self.pre_fc_norm_embedding = nn.RMSNorm(D, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(D, eps=eps)
        self.fc = nn.Linear(2 * D, D, bias=False)
        # A full-attention layer of the main model's kind: stock builds one
        # where (index + 1) is a multiple of full_attention_interval.
        full = args.full_attention_interval - 1
        self.layers = [DecoderLayer(args, layer_idx=full) for _ in range(num_layers)]
        self.norm = nn.RMSNorm(D, eps=eps)

    def __call__(self, hidden: mx.array, embeddings: mx.array, cache: Optional[List[Any]] = None,
                 step: int = 0) -> mx.array:
        """hidden [B, S, D]: h_t (the main model's normed hidden, or the head's
        own output when drafting further); embeddings [B, S, D]: the
        embeddings of x_{t+1}. Returns the head's normed hidden [B, S, D]
        (logits: the main model's lm_head of it). ``cache``: one KV cache per
        head layer; ``step`` picks the layer (draft step modulo layers)."""
        layer = self.layers[step % len(self.layers)]
        c = cache[step % len(self.layers)] if cache is not None else None
        if c is not None:
            # A speculative round's few positions: on the decode kernels,
            # one compiled call (``verify_step.head_rows``), where it takes them.
            from .layers.verify_step import head_rows

            out = head_rows(self, layer, hidden, embeddings, c)
            if out is not None:
                return out
        e = self.pre_fc_norm_embedding(embeddings)
        g = self.pre_fc_norm_hidden(hidden)
        u = self.fc(mx.concatenate([e, g], axis=-1))
        u = layer(u, mask=create_attention_mask(u, c), cache=c)
        return self.norm(u)

    def make_cache(self) -> List[Any]:
        from mlx_lm.models.cache import KVCache

        return [KVCache() for _ in self.layers]


def head_of(model: nn.Module) -> Optional[MTPHead]:
    """The model's MTP head, or None where its checkpoint has none."""
    language = getattr(model, "language_model", model)
    return getattr(language, ATTRIBUTE, None)


def has_head(model: nn.Module) -> bool:
    return head_of(model) is not None


def split_head_tensors(weights: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """The head's tensors of a checkpoint, keyed relative to ``mtp.``
    (``fc.weight``...), whatever prefix the file gives them (``mtp.``,
    ``language_model.mtp.``, ``model.mtp.``)."""
    out = {}
    for key, value in weights.items():
        if key.startswith("mtp."):
            out[key[4:]] = value
        elif key.startswith(("language_model.mtp.", "model.mtp.")):
            out[key.split("mtp.", 1)[1]] = value
    return out


def num_layers_of(tensors: Dict[str, Any], where: str = "checkpoint") -> int:
    """The head's layer count, from its ``layers.N.`` tensors."""
    indices = {int(m.group(1)) for k in tensors if (m := _LAYER.match(k))}
    if not indices:
        raise CheckpointError(f"{where} has MTP tensors but no 'mtp.layers.0.*' tensor (the head's decoder layer)")
    missing = sorted(set(range(max(indices) + 1)) - indices)
    if missing:
        raise CheckpointError(f"{where} has no tensor 'mtp.layers.{missing[0]}.*' but has mtp.layers.{max(indices)}")
    return max(indices) + 1


def is_original_layout(tensors: Dict[str, Any]) -> bool:
    """Whether the head's tensors are in the original (Hugging Face) layout:
    experts as ``experts.*`` rather than mlx-lm's ``switch_mlp.*``."""
    return any(".mlp.experts." in k for k in tensors)


def sanitize_original(tensors: Dict[str, mx.array], norm_offsets: bool = True, where: str = "checkpoint",
                      sources: Optional[Dict[str, str]] = None) -> Dict[str, mx.array]:
    """The head's tensors from the original layout in mlx-lm's: experts split
    (fused) or stacked (one per expert) into ``switch_mlp``, and, with
    ``norm_offsets``, 1 added to the RMSNorm weights (as mlx-lm's sanitize
    does to the main model's). Keys stay relative to ``mtp.``. ``sources``,
    where given, gets each result's original name (for errors)."""
    out: Dict[str, mx.array] = {}
    sources = {} if sources is None else sources
    per_expert: Dict[str, Dict[str, Dict[int, mx.array]]] = {}
    for key, value in tensors.items():
        m = _PER_EXPERT.match(key)
        if m:
            per_expert.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = value
            continue
        if key.endswith(".mlp.experts.gate_up_proj"):
            base = key[: -len(".experts.gate_up_proj")]
            if value.ndim != 3 or value.shape[-2] % 2:
                raise CheckpointError(
                    f"{where} tensor 'mtp.{key}' has shape {tuple(value.shape)}; expected "
                    "[experts, 2 x expert hidden size, hidden size]"
                )
            mid = value.shape[-2] // 2
            out[f"{base}.switch_mlp.gate_proj.weight"] = value[..., :mid, :]
            out[f"{base}.switch_mlp.up_proj.weight"] = value[..., mid:, :]
            sources[f"{base}.switch_mlp.gate_proj.weight"] = sources[f"{base}.switch_mlp.up_proj.weight"] = key
            continue
        if key.endswith(".mlp.experts.down_proj"):
            new_key = key.replace(".experts.down_proj", ".switch_mlp.down_proj.weight")
            out[new_key], sources[new_key] = value, key
            continue
        if norm_offsets and _OFFSET_NORMS.match(key) and value.ndim == 1:
            value = value + 1.0
        out[key], sources[key] = value, key
    for base, projections in per_expert.items():
        for name, experts in projections.items():
            count = max(experts) + 1
            missing = sorted(set(range(count)) - set(experts))
            if missing:
                raise CheckpointError(
                    f"{where} is missing tensor 'mtp.{base}.experts.{missing[0]}.{name}.weight' "
                    f"(it has expert {count - 1})"
                )
            shapes = {tuple(v.shape) for v in experts.values()}
            if len(shapes) > 1:
                odd = next(e for e in sorted(experts) if tuple(experts[e].shape) != tuple(experts[0].shape))
                raise CheckpointError(
                    f"{where} tensor 'mtp.{base}.experts.{odd}.{name}.weight' has shape "
                    f"{tuple(experts[odd].shape)}; expert 0's has {tuple(experts[0].shape)}"
                )
            new_key = f"{base}.switch_mlp.{name}.weight"
            out[new_key] = mx.stack([experts[e] for e in range(count)])
            sources[new_key] = f"{base}.experts.N.{name}.weight"
    return out


def attach(model: nn.Module, num_layers: int) -> MTPHead:
    """Build an MTP head of ``num_layers`` layers on ``model`` (a qwen3_5_moe
    Model) at ``language_model.mtp``, replacing any there; returns it."""
    language = model.language_model
    head = MTPHead(language.args, num_layers)
    setattr(language, ATTRIBUTE, head)
    return head


def detach(model: nn.Module) -> None:
    language = getattr(model, "language_model", model)
    if ATTRIBUTE in language:
        delattr(language, ATTRIBUTE)


def declared_layers(text_config: Dict[str, Any]) -> Optional[int]:
    value = text_config.get(LAYERS_FIELD)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def keep_head(model: nn.Module, raw: Dict[str, mx.array], sanitized: Dict[str, mx.array]) -> Dict[str, mx.array]:
    """For lily's ``Model.sanitize``: where the checkpoint (``raw``, as read)
    has ``mtp.*`` tensors, build the head on ``model`` and add its tensors to
    ``sanitized`` (mlx-lm's result, which dropped them) under ``PREFIX``;
    else leave both as they are (no head)."""
    tensors = split_head_tensors(raw)
    if not tensors:
        detach(model)
        return sanitized
    # mlx-lm's rule for the main model: conv1d weights not yet moved mean the
    # original layout, whose norms are offsets from 1.
    unsanitized = any("conv1d.weight" in k and v.shape[-1] != 1 for k, v in raw.items())
    tensors = sanitize_original(tensors, norm_offsets=unsanitized)
    n = num_layers_of(tensors)
    text = getattr(model.args, "text_config", None) or {}
    declared = declared_layers(text)
    if declared is not None and declared != n:
        raise CheckpointError(
            f"config.json text_config.{LAYERS_FIELD} is {declared}, but the checkpoint's MTP tensors have "
            f"{n} layer{'s' if n != 1 else ''} (mtp.layers.0 to mtp.layers.{n - 1})"
        )
    attach(model, n)
    out = dict(sanitized)
    out.update({PREFIX + k: v for k, v in tensors.items()})
    return out
