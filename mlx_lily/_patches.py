"""Attributes of mlx-lm's modules and classes that lily replaces while a
feature is installed (prefix reuse, the server's log-prob read, cache files),
and what was there before, so that ``undo`` puts every one back."""

from __future__ import annotations

import importlib
import sys
from typing import Any, Dict, Optional, Tuple


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


def _run_as_main(name: str) -> Optional[Any]:
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return main if getattr(spec, "name", None) == name else None


def program_module(name: str) -> Any:
    """mlx-lm's module ``name`` as the running program calls it: ``__main__``
    where the process was started as ``python -m name`` (importing ``name``
    then loads a second copy, whose functions and classes the program never
    calls), else the imported module. For patches made once the program's
    module has run its definitions (at model load, not from the startup hook)."""
    return _run_as_main(name) or importlib.import_module(name)


def loaded_program_module(name: str) -> Optional[Any]:
    """``program_module(name)`` where that module is loaded, else None."""
    return _run_as_main(name) or sys.modules.get(name)
