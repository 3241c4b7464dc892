"""What a launch sends each rank: the function and its arguments, by value where a notebook cell defined them."""
from __future__ import annotations

import collections
import io
import pickle
import types
from multiprocessing.reduction import ForkingPickler
from typing import Any, Dict, List, Optional

SHARE_ARRAYS_FROM = 16 * 2**20  # NumPy arrays this large travel through shared memory, not one copy per rank


def _readonly_array(tensor: Any) -> Any:
    array = tensor.numpy()
    array.flags.writeable = False  # the ranks share these pages: a write would change every rank's copy
    return array


def _reducer(shared: Dict[int, Any]):
    """Large arrays as shared-memory tensors, one copy for all ranks (kept alive in `shared` until the ranks have
    mapped them); the rest as pickle writes them."""
    def reduce(array: Any) -> Any:
        import numpy as np
        import torch

        if array.nbytes >= SHARE_ARRAYS_FROM and array.dtype.kind in "biufc":
            if id(array) not in shared:
                try:
                    shared[id(array)] = (array, torch.from_numpy(np.ascontiguousarray(array)).share_memory_())
                except TypeError:  # a dtype torch can't hold
                    return array.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
            return _readonly_array, (shared[id(array)][1],)
        return array.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    return reduce


def _code_reducer(cloudpickles: Any):
    """Code objects as cloudpickle sends them, but with their file name: cloudpickle renames every one
    "<dynamic-code>" (its payload then doesn't depend on where a function was defined), and a rank's traceback
    and warnings could then not name the learner's cell (ranks/cells.py names it in the launching kernel)."""
    def reduce(code: types.CodeType) -> Any:
        if code.co_filename == "<dynamic-code>":
            return cloudpickles(code)
        return _named_code, (code.replace(co_filename="<dynamic-code>"), code.co_filename)
    return reduce


def _named_code(code: types.CodeType, filename: str) -> types.CodeType:
    return code.replace(co_filename=filename)


def tensors_in(obj: Any) -> List[Any]:
    """Every torch tensor obj holds, found by pickling it to nowhere as dumps would (closures and globals of cell
    functions too), the tensors themselves left out; raises what pickling obj would raise."""
    import cloudpickle

    found: List[Any] = []

    class Finder(cloudpickle.Pickler):
        def reducer_override(self, o: Any) -> Any:
            if type(o).__module__.startswith("torch") and type(o).__name__ in ("Tensor", "Parameter"):
                found.append(o)
                return int, ()  # not its bytes: only where it is
            return super().reducer_override(o)

    Finder(io.BytesIO(), protocol=5, buffer_callback=lambda _: None).dump(obj)  # arrays out of band: not copied
    return found


def dumps(obj: Any, shared: Optional[Dict[int, Any]] = None) -> bytes:
    """Pickle obj for a rank: functions from __main__ (a notebook cell) by value with cloudpickle, torch's
    shared-memory tensors as handles (multiprocessing's reducers, which torch registers), large NumPy arrays
    as shared memory (read-only in the ranks), the rest as pickle does."""
    import cloudpickle
    import numpy as np
    own = {np.ndarray: _reducer({} if shared is None else shared)}
    code_reduce = cloudpickle.Pickler.dispatch_table.get(types.CodeType)
    if code_reduce is not None:
        own[types.CodeType] = _code_reducer(code_reduce)

    class RankPickler(cloudpickle.Pickler):
        dispatch_table = collections.ChainMap(own, ForkingPickler._extra_reducers, cloudpickle.Pickler.dispatch_table)

    buf = io.BytesIO()
    RankPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


class Deferred:
    """A value a rank unpickles itself, after its parent watch is running (not in multiprocessing's bootstrap,
    which would import torch first), and that may hold functions defined in a notebook cell."""

    def __init__(self, value: Any):
        self.value, self.blob = value, None
        self.shared: Dict[int, Any] = {}  # the arrays sent through shared memory, alive as long as the launch

    def __reduce__(self):
        # Called while each process starts (spawn, forkserver), so the tensors' file handles travel with it.
        return _deferred_from_blob, (dumps(self.value, self.shared),)

    def get(self) -> Any:
        """The value (unpickled on first use)."""
        if self.blob is not None:
            self.value, self.blob = pickle.loads(self.blob), None
        return self.value


def _deferred_from_blob(blob: bytes) -> Deferred:
    d = Deferred(None)
    d.blob = blob
    return d
