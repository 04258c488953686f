"""Attributes of mlx-lm's modules and classes that lily replaces while a
feature is installed (prefix reuse, the server's log-prob read, cache files),
and what was there before, so that ``undo`` puts every one back."""

from __future__ import annotations

from typing import Any, Dict, Tuple


class Patches:
    def __init__(self):
        self._held: Dict[str, Tuple[Any, str, Any]] = {}

    def set(self, key: str, owner: Any, name: str, value: Any) -> None:
        """``owner.name = value``, the original kept under ``key``."""
        self._held[key] = (owner, name, getattr(owner, name))
        setattr(owner, name, value)

    def __getitem__(self, key: str) -> Any:
        """The original that ``key`` replaced (what lily's version calls)."""
        return self._held[key][2]

    def __contains__(self, key: str) -> bool:
        return key in self._held

    def __bool__(self) -> bool:
        return bool(self._held)

    def undo(self) -> None:
        """Every replaced attribute as it was, the last replaced first."""
        for owner, name, original in reversed(list(self._held.values())):
            setattr(owner, name, original)
        self._held.clear()
