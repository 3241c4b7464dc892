"""The data cache's tensors a launch hands its ranks, checked after the launch: a rank that changed one in place
(`x.sub_(mean)` or `images[:] -= mean` on a slice of it) changed this process's copy too, since the ranks map the
same memory, and every later run would train on the changed data. Such a change is named, and the cache dropped."""
from __future__ import annotations

import warnings
from typing import Any, Callable, Dict, List, Tuple

from ..common.shared import any_guarded, guarded


class SharedDataChanged(UserWarning):
    """A rank changed data that this process shares with every rank (the data cache's tensors)."""


warnings.simplefilter("always", SharedDataChanged)  # every time: each launch that does it is a new corruption


def _digest(storage: Any) -> int:
    import torch
    import xxhash

    raw = torch.empty(0, dtype=torch.uint8).set_(storage)  # the storage's bytes, whatever the tensor's dtype
    return xxhash.xxh3_64_intdigest(raw.numpy())


class SharedWatch:
    """The guarded storages among the tensors a launch sends (payload.tensors_in), with their digests before it."""

    def __init__(self, tensors: List[Any]):
        self.before: Dict[int, Tuple[Any, int, str, Callable[[], None]]] = {}
        if not any_guarded():
            return
        for t in tensors:
            storage = t.untyped_storage()
            name = guarded(storage.data_ptr()) if t.device.type == "cpu" else None
            if name is not None and storage.data_ptr() not in self.before:
                self.before[storage.data_ptr()] = (storage, _digest(storage), *name)

    def check(self) -> List[str]:
        """Name every guarded tensor a rank changed (a SharedDataChanged warning each) and drop its cache."""
        changed = []
        for storage, digest, what, forget in self.before.values():
            if _digest(storage) != digest:
                changed.append(what)
                forget()
                warnings.warn(
                    f"a rank changed {what} in place, and this process's copy with it: the ranks map the same memory "
                    "(an in-place op such as x.sub_(...) or images[:] -= ... on that tensor or a slice of it). The data "
                    "cache was dropped, so the next load_data reads the files again; tensors you took from it before "
                    "(e.g. a global IMAGES) still hold the changed values: load them again. In the rank, change a copy: "
                    "x = x.clone() first, or x = x - mean", SharedDataChanged, stacklevel=3)
        return changed
