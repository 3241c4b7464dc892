"""Checkpoints as a GPU job writes them, on any machine: torch.save records each storage's device (a location
tag such as "cuda:0") and torch.load puts it back there unless map_location says otherwise.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, List, Optional

import torch

_STATE = threading.local()
_REGISTERED = False


def _tag(storage: Any) -> Optional[str]:
    """The location torch.save writes for a CPU storage while saved_as_if_on is active (else: torch decides)."""
    location = getattr(_STATE, "location", None)
    return location if location is not None and storage.device.type == "cpu" else None


def _no_restore(obj: Any, location: str) -> None:
    return None  # loading is left to torch's own handlers: "cuda:0" goes to the cuda one


@contextlib.contextmanager
def saved_as_if_on(location: str) -> Iterator[None]:
    """torch.save inside the block tags every CPU storage with `location` (e.g. "cuda:0"), as it would if the
    tensors had been on that device: the file is then the one rank 0 of a GPU job writes.

    Uses torch.serialization.register_package (a tagger consulted before the CPU one); outside the block, and in
    other threads, saving is unchanged.
    """
    global _REGISTERED
    if not _REGISTERED:
        torch.serialization.register_package(1, _tag, _no_restore)
        _REGISTERED = True
    _STATE.location = location
    try:
        yield
    finally:
        _STATE.location = None


def saved_locations(path: str) -> List[str]:
    """The location tag of every storage in a checkpoint, as torch.load's map_location callable receives them."""
    seen: List[str] = []

    def note(storage: Any, location: str) -> Any:
        seen.append(location)
        return storage  # keep it on the CPU: only the tags are wanted here

    torch.load(path, map_location=note, weights_only=True)
    return seen
