"""What a launch sends each rank: the function and its arguments, by value where a notebook cell defined them."""
from __future__ import annotations

import collections
import io
import pickle
from typing import Any

SHARE_ARRAYS_FROM = 16 * 2**20  # NumPy arrays this large travel through shared memory, not one copy per rank


def _readonly_array(tensor: Any) -> Any:
    array = tensor.numpy()
    array.flags.writeable = False  # the ranks share these pages: a write would change every rank's copy
    return array


def _reduce_ndarray(array: Any) -> Any:
    """Large arrays as shared-memory tensors (one copy for all ranks); the rest as pickle writes them."""
    import numpy as np
    import torch

    if array.nbytes >= SHARE_ARRAYS_FROM and array.dtype.kind in "biufc":
        try:
            shared = torch.from_numpy(np.ascontiguousarray(array)).share_memory_()
        except TypeError:  # a dtype torch can't hold
            return array.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
        return _readonly_array, (shared,)
    return array.__reduce_ex__(pickle.HIGHEST_PROTOCOL)


def dumps(obj: Any) -> bytes:
    """Pickle obj for a rank: functions from __main__ (a notebook cell) by value with cloudpickle, torch's
    shared-memory tensors as handles (multiprocessing's reducers, which torch registers), large NumPy arrays
    as shared memory (read-only in the ranks), the rest as pickle does."""
    import cloudpickle
    import numpy as np
    from multiprocessing.reduction import ForkingPickler

    class RankPickler(cloudpickle.Pickler):
        dispatch_table = collections.ChainMap({np.ndarray: _reduce_ndarray}, ForkingPickler._extra_reducers,
                                              cloudpickle.Pickler.dispatch_table)

    buf = io.BytesIO()
    RankPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


class Deferred:
    """A value a rank unpickles itself, after its parent watch is running (not in multiprocessing's bootstrap,
    which would import torch first), and that may hold functions defined in a notebook cell."""

    def __init__(self, value: Any):
        self.value, self.blob = value, None

    def __reduce__(self):
        # Called while the process starts (spawn, forkserver), so the tensors' file handles travel with it.
        return _deferred_from_blob, (dumps(self.value),)

    def get(self) -> Any:
        """The value (unpickled on first use)."""
        if self.blob is not None:
            self.value, self.blob = pickle.loads(self.blob), None
        return self.value


def _deferred_from_blob(blob: bytes) -> Deferred:
    d = Deferred(None)
    d.blob = blob
    return d
