"""The rendezvous as a rank sees it: a store that records every call init_process_group makes on it (notebook 1).

`RecordingStore(store)` passes each call on to a real store (the notebook's TCPStore, reached as a client) and
notes what it was, its key and when it started and ended, failed calls included. Given to
`dist.init_process_group(store=...)`, it shows gloo checking in (each rank sets its address under a key of
its own and waits for every other rank's) and the barrier at the end (a counter every rank adds 1 to, and a key
the last one sets). It is a class of the package, not of a notebook cell: a subclass of torch's C++ Store can't
travel to a rank by value (cloudpickle), only by name.
"""
from __future__ import annotations

import datetime
import time
from typing import Any, Callable, Dict, List, Optional

import torch.distributed as dist


class RecordingStore(dist.Store):
    """A store that forwards every call to `inner` and records (op, key, start, end, failed) for each."""

    def __init__(self, inner: dist.Store, clock: Callable[[], float] = time.time):
        super().__init__()
        self.inner, self.clock = inner, clock  # time.time: one clock for every process of this machine
        self.log: List[Dict[str, Any]] = []

    def _call(self, op: str, key: str, fn: Callable[[], Any]) -> Any:
        start = self.clock()
        entry = {"op": op, "key": key, "start": start, "end": start, "failed": ""}
        self.log.append(entry)
        try:
            return fn()
        except Exception as e:
            entry["failed"] = type(e).__name__  # e.g. DistStoreError when a wait reaches the timeout
            raise
        finally:
            entry["end"] = self.clock()

    def set(self, key: str, value: Any) -> None:
        return self._call("set", key, lambda: self.inner.set(key, value))

    def get(self, key: str) -> bytes:
        return self._call("get", key, lambda: self.inner.get(key))

    def add(self, key: str, amount: int) -> int:
        return self._call("add", key, lambda: self.inner.add(key, amount))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self._call("compare_set", key, lambda: self.inner.compare_set(key, expected, desired))

    def wait(self, keys: List[str], timeout: Optional[datetime.timedelta] = None) -> None:
        call = (lambda: self.inner.wait(keys)) if timeout is None else (lambda: self.inner.wait(keys, timeout))
        return self._call("wait", ",".join(keys), call)

    def check(self, keys: List[str]) -> bool:
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self.inner.set_timeout(timeout)

    @property
    def timeout(self) -> datetime.timedelta:
        return self.inner.timeout


def address_owner(key: str) -> Optional[int]:
    """The rank whose address a gloo rendezvous key holds ('0//cpu//0/2' -> 2); None for other keys."""
    last = key.rsplit("/", 1)[-1]
    return int(last) if "//" in key and last.isdigit() else None
