"""Which form a decode call runs in, and what happens when a form fails.

A decode token can run in five tiers, fastest first: the server's batch of
1-16 rows as one compiled step (``batch_step.py``), the whole layer stack
of one row as one compiled step, the stack in compiled segments (both
``text_model.py``), each layer's fused step (``decoder.py``), and stock's
code. The model's call tries the first two, then stock's stack, whose layers
each try their fused step, then stock's layer flow. ``MODEL_TIERS`` and
``LAYER_TIERS`` list them; each tier has a ``takes`` predicate and a ``run``,
and ``decode`` applies one fallback policy to all of them: a tier that raises
has its KV-cache writes undone (recurrent states are assigned only at a
step's end), is switched off for its owner (the model or the layer) from then
on, prints one notice naming it and the reason (once per tier and reason),
and the next tier runs the call. A tier's run raises ``Declined`` to pass the
call on without a notice. The last tier's errors are the call's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from .._notice import notice_once


class Declined(Exception):
    """A tier's run found it does not take the call after all (nothing done)."""


class DecodeCall:
    """One call's arguments, by name, and ``touched``: the KV-cache positions
    a tier wrote (``kv_position``), undone if it fails."""

    def __init__(self, **args: Any):
        self.__dict__.update(args)
        self.touched: list = []


@dataclass(frozen=True)
class Tier:
    name: str  # in the notice: "lily's <name> failed"
    then: str  # what runs from now on, in the notice
    off: Optional[str]  # the owner's __dict__ key set False when it fails (None: the last tier)
    takes: Callable[[Any, DecodeCall], bool]
    run: Callable[[Any, DecodeCall], Any]


def decode(owner: Any, tiers: Sequence[Tier], call: DecodeCall) -> Any:
    """The first tier that takes the call runs it; see the module's policy."""
    for tier in tiers:
        if tier.off is not None and owner.__dict__.get(tier.off) is False:
            continue
        if not tier.takes(owner, call):
            continue
        if tier.off is None:
            return tier.run(owner, call)
        try:
            return tier.run(owner, call)
        except Declined:
            continue
        except Exception as exc:  # noqa: BLE001 - a failing tier must not stop generation
            for saved in reversed(call.touched):
                restore_kv_position(saved)
            call.touched.clear()
            owner.__dict__[tier.off] = False
            notice_once(
                f"decode-failed:{tier.name}:{type(exc).__name__}",
                f"lily's {tier.name} failed ({type(exc).__name__}: {str(exc)[:200]}); {tier.then}",
            )
    raise AssertionError("the last decode tier takes every call")


def kv_position(cache: Any) -> tuple:
    """What undoes a KV cache's write: its offset (and a BatchKVCache's write
    index). A failed step restores it (``restore_kv_position``); the retry
    rewrites that slot."""
    return cache, cache.offset, getattr(cache, "_idx", None)


def restore_kv_position(saved: tuple) -> None:
    cache, offset, index = saved
    cache.offset = offset
    if index is not None:
        cache._idx = index


def _always(owner: Any, call: DecodeCall) -> bool:
    return True


# The owner's methods are looked up per call (by name), so a subclass or a
# patched method (bench/diagnostics) is what runs.
MODEL_TIERS = (
    Tier("compiled batched decode step", "the server's batches decode layer by layer from now on", "_lily_batch_ok",
         takes=lambda model, c: c.masks is not None and c.masks.rows is not None
         and model._batch_takes(c.cache, c.masks.ssm_mask, c.masks.rows),
         run=lambda model, c: model._decode_batch(c.inputs, c.cache, c.masks.ssm_mask, c.masks.version)),
    Tier("compiled whole decode step", "the model decodes in segments from now on", "_lily_whole_ok",
         takes=lambda model, c: c.masks is not None and c.masks.one_row
         and model._whole_takes(c.cache, c.masks.fa_mask, c.masks.ssm_mask),
         run=lambda model, c: model._decode_whole(c.inputs, c.cache, c.masks.version)),
    Tier("compiled decode segments", "the model decodes layer by layer from now on", "_lily_segments_ok",
         takes=lambda model, c: c.masks is not None and c.masks.one_row,
         run=lambda model, c: model._decode_segments(c.inputs, c.cache, c.touched, c.masks.fa_mask,
                                                      c.masks.ssm_mask, c.masks.version)),
    Tier("stock layer stack", "", None, takes=_always, run=lambda model, c: model._stock_stack(c)),
)

LAYER_TIERS = (
    Tier("fused decode step", "this layer decodes through its unfused ops from now on", "_lily_decode_ok",
         takes=lambda layer, c: layer._takes_decode(c.x, c.mask, c.cache),
         run=lambda layer, c: layer._decode(c.x, c.mask, c.cache, c.touched)),
    Tier("stock layer flow", "", None, takes=_always, run=lambda layer, c: layer._stock_flow(c)),
)
