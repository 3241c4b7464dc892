"""Tensors this process shares with ranks that no rank may change, by name: the data cache registers its tensors
here, so that a launch finding one changed can say which and drop the cache (ranks/starting.py: SharedWatch)."""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple

# the tensor's storage address -> (what it is, a callable that drops it from its cache)
_GUARDED: Dict[int, Tuple[str, Callable[[], None]]] = {}


def guard(storage_ptr: int, what: str, forget: Callable[[], None]) -> None:
    """Name a shared storage that ranks must only read (e.g. "load_data('mnist-5k').train_images")."""
    _GUARDED[storage_ptr] = (what, forget)


def guarded(storage_ptr: int) -> Optional[Tuple[str, Callable[[], None]]]:
    """(what, forget) for a guarded storage, else None."""
    return _GUARDED.get(storage_ptr)


def any_guarded() -> bool:
    """Has this process registered any? (Else a launch has nothing to check.)"""
    return bool(_GUARDED)


def unguard_all() -> None:
    """Forget every registration (the cache they belong to was cleared)."""
    _GUARDED.clear()
