"""What collectives a rank ran: recorded as they are issued, read back from the flight recorder, and DETAIL's
report of a mismatch, parsed into plain values a notebook can print and assert on; and a hand-written ring
all-reduce that records what each rank holds after each step and the bytes it sends.
"""
from __future__ import annotations

import os
import pickle
import re
from collections import OrderedDict
from typing import Any, Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# TORCH_DISTRIBUTED_DEBUG=DETAIL's ProcessGroupWrapper names each rank's collective like this
# (torch/csrc/distributed/c10d/ProcessGroupWrapper.cpp, CollectiveFingerPrint's operator<<).
_FINGERPRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+), "
                          r"OpType=(\w+), TensorShape=\[([\d, ]*)\]")


def _tensors(x: Any) -> List[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []


class CommRecorder(TorchDispatchMode):
    """Inside `with CommRecorder() as rec:`, every c10d collective issued is noted in rec.calls.

    DDP's reducer, ZeroRedundancyOptimizer and FSDP2 all reach the process group through torch's dispatcher as
    c10d ops (c10d::allreduce_, broadcast_, _allgather_base_, _reduce_scatter_base_, ...), so one mode sees
    them all. Each call is {"op", "dtype", "bytes"}: bytes of its largest tensor argument, i.e. the full buffer
    (an all-reduce's tensor, an all-gather's output, a reduce-scatter's input).
    """

    def __init__(self) -> None:
        super().__init__()
        self.calls: List[Dict[str, Any]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            tensors = _tensors(list(args) + list((kwargs or {}).values()))
            big = max(tensors, key=lambda t: t.numel() * t.element_size(), default=None)
            self.calls.append({"op": func.__name__.split(".")[0],
                               "dtype": str(big.dtype).replace("torch.", "") if big is not None else None,
                               "bytes": big.numel() * big.element_size() if big is not None else 0})
        return func(*args, **(kwargs or {}))

    def summary(self) -> Dict[str, Dict[str, Any]]:
        """op -> {"calls", "bytes", "dtypes"}, in the order the ops first appeared."""
        out: Dict[str, Dict[str, Any]] = OrderedDict()
        for c in self.calls:
            s = out.setdefault(c["op"], {"calls": 0, "bytes": 0, "dtypes": []})
            s["calls"] += 1
            s["bytes"] += c["bytes"]
            if c["dtype"] not in s["dtypes"]:
                s["dtypes"].append(c["dtype"])
        return dict(out)


def collective_mismatch(message: str) -> Dict[int, Dict[str, Any]]:
    """The collectives TORCH_DISTRIBUTED_DEBUG=DETAIL's error says each named rank was running.

    rank -> {"op": "ALLREDUCE", "shape": [3], "sequence": 0}; empty if the message is not such a report.
    """
    found = {}
    for rank, seq, op, shape in _FINGERPRINT.findall(message):
        found[int(rank)] = {"op": op, "shape": [int(s) for s in shape.split(",") if s.strip()],
                            "sequence": int(seq)}
    return found


def flight_recorder_unsupported(backend: str = "gloo") -> Optional[str]:
    """Why the installed torch has no flight recorder to dump for `backend` here, or None when it has one."""
    c10d = getattr(torch._C, "_distributed_c10d", None)
    if backend == "nccl":
        if not torch.cuda.is_available():
            return "the flight recorder of nccl needs CUDA GPUs, and none is visible"
        return None if hasattr(c10d, "_dump_nccl_trace") else f"torch {torch.__version__} has no _dump_nccl_trace"
    if not hasattr(c10d, "_dump_fr_trace"):
        return f"torch {torch.__version__} records collectives for nccl only (no _dump_fr_trace for {backend})"
    return None


def dump_flight_recorder(path: str, backend: str = "gloo") -> str:
    """Write this process's flight-recorder dump (what torch records once TORCH_FR_BUFFER_SIZE is set) to path."""
    c10d = torch._C._distributed_c10d
    raw = c10d._dump_nccl_trace() if backend == "nccl" else c10d._dump_fr_trace()
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as fh:
        fh.write(raw)
    os.replace(tmp, path)
    return path


def read_flight_recorder(path: str) -> Dict[str, Any]:
    """A dump written by dump_flight_recorder: {"last": the last collective the first process group enqueued,
    "groups": {group id: its last enqueued sequence number}, "entries": [...]}.

    Each entry: {"seq", "op", "sizes", "group", "where", "by"}: "group" is the process group's id ("0" the default
    group; TORCH_DISTRIBUTED_DEBUG=DETAIL's helper group is another), "where" the innermost frame outside torch (the
    caller's function and line) that issued the collective, "by" the innermost Python frame of all (a torch
    function such as _verify_param_shape_across_processes, or the caller's own).
    """
    with open(path, "rb") as fh:
        dump = pickle.load(fh)  # noqa: S301 - a file this process's ranks just wrote
    entries = []
    for e in dump.get("entries", []):
        every = e.get("frames", [])
        frames = [f for f in every if f"{os.sep}torch{os.sep}" not in f.get("filename", "")]
        where = f"{frames[0]['name']}, line {frames[0]['line']}" if frames else "?"
        entries.append({"seq": e["collective_seq_id"], "op": e["profiling_name"], "sizes": e["input_sizes"],
                        "group": str(e.get("pg_id", 0)), "where": where, "by": every[0]["name"] if every else "?"})
    groups = {str(g): s.get("last_enqueued_collective", 0) for g, s in dump.get("pg_status", {}).items()}
    first = next(iter(groups.values()), entries[-1]["seq"] if entries else 0)
    return {"last": groups.get("0", first), "groups": groups, "entries": entries}


def ring_all_reduce(t: torch.Tensor) -> Dict[str, Any]:
    """Sum t over the ranks in place with a hand-written ring (dist.isend/recv), as gloo's ring all-reduce does;
    returns {"steps": t's values at the start and after each of the 2(W-1) steps, "sent_bytes": what this rank
    sent}. t's length must be a multiple of the world size (one chunk per rank)."""
    import torch.distributed as dist  # only inside a rank's process

    world, rank = dist.get_world_size(), dist.get_rank()
    if t.dim() != 1 or t.numel() % world:
        raise ValueError(f"ring_all_reduce: t must be 1-D with a length divisible by the world size {world} "
                         f"(one chunk per rank); got shape {tuple(t.shape)}")
    chunks = t.chunk(world)  # views into t: the ring changes t itself
    right, left = (rank + 1) % world, (rank - 1) % world
    incoming = torch.empty_like(chunks[0])
    steps, sent = [t.tolist()], 0
    for s in range(world - 1):  # reduce-scatter: partial sums travel right, one more rank's value in each
        send = dist.isend(chunks[(rank - s) % world], right)
        dist.recv(incoming, left)
        chunks[(rank - s - 1) % world].add_(incoming)
        send.wait()  # the chunk sent must not change before it has left
        sent += chunks[0].numel() * t.element_size()
        steps.append(t.tolist())
    for s in range(world - 1):  # all-gather: the complete chunks travel right and overwrite the partial ones
        send = dist.isend(chunks[(rank + 1 - s) % world], right)
        dist.recv(chunks[(rank - s) % world], left)
        send.wait()
        sent += chunks[0].numel() * t.element_size()
        steps.append(t.tolist())
    return {"steps": steps, "sent_bytes": sent}


def ring_bytes_per_rank(nbytes: int, world_size: int) -> float:
    """What each rank sends in a ring all-reduce of nbytes: 2(W-1) chunks of nbytes/W, i.e. 2(W-1)/W x nbytes."""
    return 2 * (world_size - 1) / world_size * nbytes
