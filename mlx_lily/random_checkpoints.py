"""Random ``qwen3_5_moe`` checkpoints that need no network: for the demo, the
tests and the benchmark.

``make_checkpoint()`` writes a directory mlx-lm loads like any converted
checkpoint: ``config.json``, ``model.safetensors``, and a small real tokenizer
(byte-level BPE trained here on a built-in text) with a ChatML chat template.
Weights are random and quantized as mlx-community quantizes the real model:
4-bit affine, group 64, with the router and shared-expert gates at 8 bits.

``build_model()`` makes the same model in memory, layer by layer, so that the
real Qwen3.6-35B-A3B shapes never hold more than one layer's unquantized
experts at once.
"""

from __future__ import annotations

import copy
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ._cache import cache_dir
from .original_layout import save_original

# Bump when the files written here change, so cached checkpoints are rebuilt.
# 2: the model's vocabulary is the tokenizer's; 3: the demo shape's experts are
# 128 wide (at 64, MLX 0.32.4's CUDA quantized matmul returned NaN).
FORMAT_VERSION = 3
MARKER = "lily_checkpoint.json"

_COMMON = {
    "model_type": "qwen3_5_moe",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "decoder_sparse_step": 1,
    "norm_topk_prob": True,
    "max_position_embeddings": 262144,
}

SHAPES: Dict[str, Dict[str, Any]] = {
    # Small enough to run on a CPU in seconds; every feature of the real model.
    "demo": {
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "full_attention_interval": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        # Two quantization groups per row of the down projections: MLX 0.32.4's
        # CUDA quantized matmul returns NaN or varying values for 4-bit weights
        # of one group per row (bench/diagnostics/determinism.py).
        "moe_intermediate_size": 128,
        "shared_expert_intermediate_size": 128,
        "intermediate_size": 256,
        "vocab_size": 512,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    },
    # Other head counts, GQA ratio, value/key head ratio, expert count and top-k.
    "small-alt": {
        "hidden_size": 128,
        "num_hidden_layers": 4,
        "full_attention_interval": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 3,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "num_experts": 16,
        "num_experts_per_tok": 4,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 128,
        "intermediate_size": 256,
        "vocab_size": 512,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
    },
    # Qwen3.6-35B-A3B.
    "qwen3.6-35b-a3b": {
        "hidden_size": 2048,
        "num_hidden_layers": 40,
        "full_attention_interval": 4,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 256,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "intermediate_size": 512,
        "vocab_size": 248320,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    },
}

# Qwen3.5-397B-A17B, the family's largest published configuration (60 layers,
# 512 experts, top-10; about 223 GB at 4 bits). Source: the text_config of
# Qwen/Qwen3.5-397B-A17B's config.json on Hugging Face, as its fields are
# quoted by the mlx-community/Qwen3.5-397B-A17B-4bit model card (hidden 4096,
# 60 layers as 15 x (3 Gated DeltaNet + 1 attention), 512 experts, 10 routed
# + 1 shared, expert width 1024, 32 query / 2 KV heads of 256, DeltaNet 16
# key / 64 value heads of 128, vocabulary 248320) and by public code that
# copies the config (rope_theta 1e7, partial_rotary_factor 0.25, conv kernel
# 4, shared_expert_intermediate_size 1024). The config.json itself was not
# read here: where a copy differs (one test fixture gives the shared expert
# 4096), the values above are those the model card's parameter counts fit.
SHAPES["qwen3.5-397b-a17b"] = {
    "hidden_size": 4096,
    "num_hidden_layers": 60,
    "full_attention_interval": 4,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 64,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 1024,
    "shared_expert_intermediate_size": 1024,
    "intermediate_size": 1024,
    "vocab_size": 248320,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
}
# The same per-layer shapes at 4 layers (3 Gated DeltaNet + 1 attention, about
# 15 GB at 4 bits): every real tensor shape of the large model, sharded or not,
# on one machine.
SHAPES["qwen3.5-397b-a17b-4l"] = dict(SHAPES["qwen3.5-397b-a17b"], num_hidden_layers=4)

QUANTIZATION = {"group_size": 64, "bits": 4, "mode": "affine"}

# A well-conditioned random model (``conditioned=True``): every residual
# branch's output projection is scaled by BRANCH_SCALE / sqrt(2 * layers), so
# the residual stream grows slowly with depth, and the router's weights by
# ROUTER_SCALE, so that routing margins are wide, as in trained models. A
# plain random model is chaotic at depth: rounding-sized differences flip
# later routers and greedy tokens, which hides what a kernel's error is.
BRANCH_SCALE = 0.5
ROUTER_SCALE = 8.0
_BRANCH_OUTPUTS = ("o_proj", "out_proj", "down_proj")
_ROUTERS = ("mlp.gate",)


def _condition(layer: nn.Module, n_layers: int) -> None:
    """Scale a layer's branch outputs and router, in place (before quantizing)."""
    branch = BRANCH_SCALE / (2 * n_layers) ** 0.5
    scaled = []
    for name, module in layer.named_modules():
        if not hasattr(module, "weight"):
            continue
        if name.rsplit(".", 1)[-1] in _BRANCH_OUTPUTS:
            scaled.append((f"{name}.weight", module.weight * branch))
        elif name in _ROUTERS:
            scaled.append((f"{name}.weight", module.weight * ROUTER_SCALE))
    layer.load_weights(scaled, strict=False)


def model_config(shape: Union[str, Dict[str, Any]] = "demo", mtp: bool = False, **overrides: Any) -> Dict[str, Any]:
    """The config.json dict for a named shape (or a dict of text-config fields);
    ``mtp``: it declares a one-layer MTP head, as Qwen's published configs do."""
    if isinstance(shape, str):
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r}; choose one of {sorted(SHAPES)}")
        fields = copy.deepcopy(SHAPES[shape])
    else:
        fields = copy.deepcopy(SHAPES["demo"]) | dict(shape)
    fields.update(overrides)
    text = dict(_COMMON) | fields
    text["model_type"] = "qwen3_5_moe_text"
    if mtp:
        text.setdefault("mtp_num_hidden_layers", 1)
    return {"model_type": "qwen3_5_moe", "text_config": text, "tie_word_embeddings": False}


def _progress(message: str, quiet: bool) -> None:
    if not quiet:
        print(f"[mlx-lily] {message}", file=sys.stderr, flush=True)


def build_model(
    shape: Union[str, Dict[str, Any]] = "demo",
    *,
    seed: int = 0,
    quantize: bool = True,
    dtype: mx.Dtype = mx.bfloat16,
    model_class: Optional[Callable] = None,
    quiet: bool = True,
    conditioned: bool = False,
    mtp: bool = False,
):
    """Build a random model in memory; returns (model, config).

    Layer by layer: each layer's weights are drawn, cast, quantized and
    evaluated before the next layer's, bounding peak memory to one layer.
    ``model_class`` defaults to stock mlx-lm's qwen3_5_moe Model.
    ``conditioned`` scales residual branches and routers (see BRANCH_SCALE)
    so that the random model is not chaotic; the same seed draws the same
    weights either way, before scaling. ``mtp`` adds a one-layer MTP head
    (``mlx_lily.mtp``) at ``language_model.mtp``, drawn after the rest, so
    the same seed draws the same main model with or without it.
    """
    from mlx_lm.models import qwen3_5_moe as stock

    from . import mtp as mtp_head

    config = model_config(shape, mtp=mtp)
    model_class = model_class or stock.Model
    mx.random.seed(seed)
    model = model_class(stock.ModelArgs.from_dict(config))
    head = mtp_head.attach(model, config["text_config"]["mtp_num_hidden_layers"]) if mtp else None
    if head is not None:
        _draw_norms(head)
    quantization = dict(QUANTIZATION)
    predicate = model.quant_predicate

    def quantize_part(prefix: str, module: nn.Module) -> None:
        def class_predicate(path: str, m: nn.Module):
            full = f"{prefix}{path}" if path else prefix.rstrip(".")
            if not hasattr(m, "to_quantized") or m.weight.shape[-1] % 64 != 0:
                return False
            choice = predicate(full, m) if predicate else True
            if isinstance(choice, dict):
                quantization[full] = dict(choice, mode="affine")
            return choice

        nn.quantize(module, group_size=64, bits=4, class_predicate=class_predicate)

    def finish(prefix: str, module: nn.Module) -> None:
        if conditioned and prefix:
            for layer in head.layers if module is head else [module]:
                _condition(layer, n)
        # Cast first so scales and biases come out in the activation dtype.
        cast = model.cast_predicate
        module.update(_cast_tree(module, dtype, lambda k: cast(f"{prefix}{k}")))
        if quantize:
            quantize_part(prefix, module)
        mx.eval(module.parameters())

    text = model.language_model
    n = len(text.model.layers)
    start = time.time()
    for i, layer in enumerate(text.model.layers):
        finish(f"language_model.model.layers.{i}.", layer)
        if (i + 1) % 10 == 0 or i + 1 == n:
            _progress(f"built layer {i + 1}/{n} ({time.time() - start:.1f}s)", quiet)
    if head is not None:
        finish(mtp_head.PREFIX, head)
    # Embeddings, final norm and lm_head (the layers are quantized already).
    finish("", model)
    if quantize:
        config["quantization"] = quantization
        config["quantization_config"] = quantization
    model.eval()
    return model, config


def _draw_norms(module: nn.Module) -> None:
    """RMSNorm weights of 1 + k/128 (|k| <= 8) instead of ones: exact in bf16
    with and without the original layout's offset from 1, and not all 1, so
    that a reader that forgets the offset gets other weights."""
    for _, m in module.named_modules():
        if isinstance(m, nn.RMSNorm):
            m.weight = 1 + mx.random.randint(-8, 9, m.weight.shape).astype(mx.float32) / 128


def _cast_tree(module: nn.Module, dtype: mx.Dtype, should_cast: Callable[[str], bool]):
    from mlx.utils import tree_unflatten

    flat = []
    for k, v in tree_flatten(module.parameters()):
        if should_cast(k) and mx.issubdtype(v.dtype, mx.floating):
            v = v.astype(dtype)
        flat.append((k, v))
    return tree_unflatten(flat)


# A few paragraphs to train the demo tokenizer on: enough for common English
# words and code-ish text to become single tokens.
_CORPUS = """
The quick brown fox jumps over the lazy dog. A model reads a prompt and writes
one token at a time. Each token is a small piece of text: a word, part of a
word, a space or a sign. The hybrid model mixes two kinds of layers. Most are
Gated DeltaNet layers, which keep a fixed-size state for every head and update
it with each token. Every fourth layer is full attention, which looks back at
all earlier tokens through a key and value cache. Every layer ends with a
mixture of experts: a router picks eight of many small networks for each token,
and a shared expert sees every token.
Hello! How are you today? I am fine, thank you. What is the capital of France?
The capital of France is Paris. Write a short poem about the sea. The sea is
wide and blue, the waves come in and go out again, and the wind sings over the
water. Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. def main(): return 0
for i in range(10): print(i) if x > 0: y = x * 2 else: y = -x
System, user, assistant. Tell me a story. Once upon a time there was a small
engine that wanted to run faster. It learned to read fewer bytes and to do more
work in each step, and it became quick and light.
"""

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer (transformers' fast tokenizer) trained on
    the built-in text, with Qwen's ChatML special tokens and chat template,
    of exactly ``vocab_size`` tokens, so that every id the model can emit
    decodes to text.

    The built-in text yields a few hundred tokens; larger vocabularies (the
    real shapes') are filled with word-like tokens that decode to text but that
    encoding never produces (no merge leads to them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    if tok.get_vocab_size() < vocab_size:
        tok = _fill_vocabulary(tok, vocab_size)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"cannot make a {vocab_size}-token tokenizer (got {tok.get_vocab_size()})")
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def _fill_vocabulary(tok, vocab_size: int):
    """Append word-like tokens (' ab', ' abc', ...) to a trained BPE vocabulary."""
    import itertools
    import string

    from tokenizers import Tokenizer

    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    next_id = tok.get_vocab_size()
    space = "\u0120"  # the byte-level alphabet's space
    for length in itertools.count(2):
        for letters in itertools.product(string.ascii_lowercase, repeat=length):
            if next_id == vocab_size:
                return Tokenizer.from_str(json.dumps(spec))
            word = space + "".join(letters)
            if word not in vocab:
                vocab[word] = next_id
                next_id += 1


def _marker(shape: Union[str, Dict[str, Any]], seed: int, conditioned: bool = False, mtp: bool = False,
            original: bool = False) -> Dict[str, Any]:
    marker = {"format": FORMAT_VERSION, "shape": shape, "seed": seed}
    if conditioned:
        marker["conditioned"] = True
    if mtp:
        marker["mtp"] = True
    if original:
        marker["layout"] = "original"
    return marker


def default_path(shape: Union[str, Dict[str, Any]] = "demo", seed: int = 0, conditioned: bool = False,
                 mtp: bool = False, original: bool = False) -> Path:
    """Where ``make_checkpoint`` writes when given no path: the user's cache."""
    name = shape if isinstance(shape, str) else "custom"
    kind = ("-conditioned" if conditioned else "") + ("-mtp" if mtp else "") + ("-original" if original else "")
    return cache_dir() / "checkpoints" / f"{name}{kind}-seed{seed}"


def is_written(path: Union[str, Path], shape: Union[str, Dict[str, Any]] = "demo", seed: int = 0,
               conditioned: bool = False, mtp: bool = False, original: bool = False) -> bool:
    """Whether ``path`` holds this version's checkpoint of that shape and seed."""
    return _read_marker(Path(path)).get("identity") == _marker(shape, seed, conditioned, mtp, original)


def estimated_size_gb(shape: Union[str, Dict[str, Any]] = "demo") -> float:
    """About how many GB ``make_checkpoint`` writes for ``shape``: the
    model's parameters (drawn lazily, never evaluated) at 4.5 bits each
    (4-bit weights plus a bf16 scale and bias per 64), as most of them are."""
    from mlx_lm.models import qwen3_5_moe as stock

    model = stock.Model(stock.ModelArgs.from_dict(model_config(shape)))
    return sum(v.size for _, v in tree_flatten(model.parameters())) * 4.5 / 8 / 1e9


def make_checkpoint(
    path: Optional[Union[str, Path]] = None,
    shape: Union[str, Dict[str, Any]] = "demo",
    *,
    seed: int = 0,
    force: bool = False,
    quiet: bool = True,
    conditioned: bool = False,
    mtp: bool = False,
    original: bool = False,
) -> Path:
    """Write (once) a random, quantized qwen3_5_moe checkpoint; return its path.

    With no ``path`` it goes to the user's cache directory
    (``$MLX_LILY_CACHE`` or ``~/.cache/mlx_lily``). An existing checkpoint is
    reused when it was written by this version's format with the same shape
    and seed, and rebuilt otherwise.

    ``mtp`` gives the model a one-layer MTP head (``mtp.*`` tensors,
    ``mtp_num_hidden_layers: 1``), as Qwen publishes these models; the main
    model's weights are those of the same seed without it. ``original``
    writes the weights as the original (Hugging Face) checkpoint holds them
    instead: unquantized bf16 in two shards and an index, Hugging Face names
    (fused experts, conv1d as [C, 1, K], RMSNorm weights as offsets from 1),
    the head's tensors in the second shard; mlx-lm loads it unquantized, and
    quantized it is this seed's quantized checkpoint bit for bit
    (``python -m mlx_lily graft-mtp`` reads the head from it).
    """
    from mlx_lm.utils import save_config, save_model

    path = Path(path) if path is not None else default_path(shape, seed, conditioned, mtp, original)
    want = _marker(shape, seed, conditioned, mtp, original)
    if not force and is_written(path, shape, seed, conditioned, mtp, original):
        return path
    _refuse_foreign(path)
    _progress(f"writing a random {want['shape']} checkpoint to {path}", quiet)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written beside the target and renamed into place, so a crash never
    # leaves a half-written checkpoint under the name.
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.partial-", dir=path.parent))
    try:
        model, config = build_model(shape, seed=seed, quiet=quiet, conditioned=conditioned, mtp=mtp,
                                    quantize=not original)
        tokenizer = make_tokenizer(config["text_config"]["vocab_size"])
        config["eos_token_id"] = tokenizer.convert_tokens_to_ids("<|im_end|>")
        size_gb = sum(v.nbytes for _, v in tree_flatten(model.parameters())) / 1e9
        _progress(f"saving {size_gb:.1f} GB of weights", quiet)
        if original:
            save_original(tmp, model)
            config = dict(config, architectures=["Qwen3_5MoeForConditionalGeneration"], torch_dtype="bfloat16")
        else:
            save_model(tmp, model, donate_model=True)
        save_config(config, tmp / "config.json")
        tokenizer.save_pretrained(tmp)
        written = sorted(p.name for p in tmp.iterdir()) + [MARKER]
        (tmp / MARKER).write_text(json.dumps(want | {"files": written}))
        if path.exists():
            _refuse_foreign(path)  # checked again: it may have changed meanwhile
            _replace_own_files(path, tmp, written)
        else:
            try:
                tmp.rename(path)
            except OSError:
                # Another process wrote the same checkpoint meanwhile (two
                # programs, or test workers, asking for it at once): theirs
                # is as good as ours.
                if force or not is_written(path, shape, seed, conditioned, mtp, original):
                    raise
                shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def _read_marker(path: Path) -> Dict[str, Any]:
    """The marker's contents: "identity" (what the checkpoint is: format,
    shape, seed...) and "files" (what lily wrote), or {} if none is readable."""
    try:
        content = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(content, dict):
        return {}
    files = content.pop("files", None)
    return {"identity": content, "files": files}


# What lily's earlier formats wrote, for a marker that lists no files: the
# weights (one file, or shards and their index) besides the names this
# version writes.
_OLD_WEIGHT_FILES = ("model*.safetensors", "model.safetensors.index.json")


def _replace_own_files(path: Path, new: Path, written: list) -> None:
    """Put the checkpoint built in ``new`` at ``path`` (a folder lily wrote),
    removing only the files lily wrote there; anything else stays, and one
    notice names it."""
    listed = _read_marker(path).get("files")
    if isinstance(listed, list):
        own = set(map(str, listed))
    else:
        own = set(written) | {p.name for pattern in _OLD_WEIGHT_FILES for p in path.glob(pattern)}
    own.add(MARKER)
    others = sorted(p.name for p in path.iterdir() if p.name not in own)
    if not others:
        # Only lily's files: swap the whole folder, so a crash never leaves a
        # mix of the old checkpoint and the new under the name.
        shutil.rmtree(path)
        new.rename(path)
        return
    clash = sorted(set(others) & set(written))
    if clash:
        raise FileExistsError(
            f"{path} holds {', '.join(clash)}, which lily did not write there and would overwrite; "
            "move it away or choose another path for the checkpoint"
        )
    # File by file. First the marker lists both sets of files and no identity:
    # interrupted, the folder is still lily's (rebuilt on the next call) and
    # every file lily may have written is on its list.
    (path / MARKER).write_text(json.dumps({"files": sorted(own | set(written))}))
    for name in sorted(own - {MARKER}):
        old = path / name
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        elif old.exists() or old.is_symlink():
            old.unlink()
    for name in written:
        if name != MARKER:
            (new / name).replace(path / name)
    (new / MARKER).replace(path / MARKER)  # last: the checkpoint is whole
    new.rmdir()
    print(f"[mlx-lily] left {len(others)} entr{'y' if len(others) == 1 else 'ies'} in {path} that lily "
          f"did not write: {', '.join(others)}", file=sys.stderr, flush=True)


def _refuse_foreign(path: Path) -> None:
    """Raise unless ``path`` is absent, an empty folder, or a checkpoint lily
    wrote (it has lily's marker file): lily never deletes what it did not write."""
    if not path.exists():
        return
    if not path.is_dir():
        raise FileExistsError(f"{path} exists and is not a folder; choose another path for the checkpoint")
    if any(path.iterdir()) and not (path / MARKER).is_file():
        raise FileExistsError(
            f"{path} is a non-empty folder that is not a lily checkpoint (no {MARKER}); "
            "lily will not overwrite it: choose another path or empty it yourself"
        )
