"""Getting a model for an engine ('lily' or 'stock').

Two ways, one per run mode:

* ``load_engine`` (fresh-process mode) gives one engine's model the way a
  user gets it: ``mlx_lily.load(path, backend=...)`` for a checkpoint, or
  ``build_model`` with lily's or stock's model class for a generated shape.
* ``load_shared`` + ``switch`` (same-process mode and numerics) build stock's
  model once and flip its layers between the engines with ``specialize``, so
  the weights exist once and are the same for both by construction.

Generated shapes use a fixed seed, so every process draws identical weights.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Optional, Tuple

ENGINES = ("lily", "stock")
BACKEND = {"lily": "lily", "stock": "mlx"}  # mlx_lily.load's names


def _vocab_size(config: Dict[str, Any]) -> int:
    text = config.get("text_config") or {}
    size = text.get("vocab_size", config.get("vocab_size"))
    if not size:
        raise ValueError("cannot find vocab_size in the model's config")
    return int(size)


def _is_qwen3_5_moe(model: Any) -> bool:
    from mlx_lm.models import qwen3_5_moe

    return isinstance(model, qwen3_5_moe.Model)


def lily_layer_count(model: Any) -> int:
    """How many of the model's modules are lily's classes: > 0 on lily's
    engine for qwen3_5_moe, 0 on stock's (a check that an arm ran what it says)."""
    return sum(type(m).__module__.startswith("mlx_lily") for _, m in model.named_modules())


def load_engine(source: Dict[str, Any], engine: str) -> Tuple[Any, int, float]:
    """(model, vocab_size, seconds) for one engine, loaded or built afresh."""
    start = time.perf_counter()
    if source.get("model"):
        import mlx_lily

        model, _tok, config = mlx_lily.load(
            source["model"], backend=BACKEND[engine], return_config=True
        )
    else:
        from mlx_lily.random_checkpoints import build_model

        model_class = None
        if engine == "lily":
            from mlx_lily.models.qwen3_5_moe import Model as model_class
        model, config = build_model(
            source["shape"], seed=source["seed"], model_class=model_class,
            conditioned=bool(source.get("conditioned")),
        )
    return model, _vocab_size(config), time.perf_counter() - start


def load_shared(source: Dict[str, Any]) -> Tuple[Any, int, float, Optional[str]]:
    """(model, vocab_size, seconds, note) with stock's classes, for ``switch``.

    ``note`` says when lily cannot specialize the model (then both engines
    run the same stock code and the comparison is moot)."""
    start = time.perf_counter()
    if source.get("model"):
        import mlx_lily

        model, _tok, config = mlx_lily.load(source["model"], backend="mlx", return_config=True)
    else:
        from mlx_lily.random_checkpoints import build_model

        model, config = build_model(
            source["shape"], seed=source["seed"], conditioned=bool(source.get("conditioned"))
        )
    note = None
    if not _is_qwen3_5_moe(model):
        note = (
            f"model type {config.get('model_type')!r} is not specialized by lily: "
            "both engines run stock mlx-lm"
        )
    return model, _vocab_size(config), time.perf_counter() - start, note


def switch(model: Any, engine: str) -> None:
    """Make a model built by ``load_shared`` run the given engine's layers."""
    if engine not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES}, got {engine!r}")
    if not _is_qwen3_5_moe(model):
        return
    from mlx_lily.models.qwen3_5_moe import specialize

    specialize(model, lily=(engine == "lily"))
