"""A failed multi-node job's partial results merged into one: each node's surviving ranks see only the rows on
their own machine, and on a shared --out the last writer used to win (the file held one node's rows and blamed
whichever rank that node guessed). Each writer now merges what is already there with what it saw (cli/leaving.py
does so under a lock), so the file holds every rank's rows that any node saw, and the best-founded blame."""
from __future__ import annotations

import copy
from typing import Any, Dict, List

from .result import TrainResult

# How well a node knows who failed, highest first: the scheduler stopped the job; a rank's own error (or a
# SIGTERM from outside while every peer ran); a rank only inferred (it reported nothing, or a peer it waited for).
SCHEDULER, OWN, INFERRED = 3, 2, 1
FAILURE_NOTE = "failure_note"  # provenance key: the note line that names the failure


def same_attempt(a: TrainResult, b: TrainResult) -> bool:
    """Are a and b partial results of the same job's same attempt (a file left by another job is replaced)?"""
    pa, pb = a.provenance, b.provenance
    return bool(pa.get("job")) and pa.get("job") == pb.get("job") and pa.get("attempt") == pb.get("attempt") \
        and a.world_size == b.world_size and not a.complete and not b.complete


def _owner(parts: List[TrainResult], rank: int) -> TrainResult:
    """The part holding the most of rank's rows (the first that saw it when none has any)."""
    seen = [p for p in parts if rank in p.provenance.get("seen", [])] or parts
    return max(seen, key=lambda p: len(p.ranks[rank]))


def _failure(parts: List[TrainResult]) -> Dict[str, Any]:
    """The best-founded blame: the highest weight; among equals, the lowest rank (the same on every run)."""
    failures = [p.provenance.get("failure") or {} for p in parts]
    return max(failures, key=lambda f: (f.get("weight", 0), -(f.get("rank") if f.get("rank") is not None else -1)))


def merge_partials(old: TrainResult, new: TrainResult) -> TrainResult:
    """One partial result from two nodes' views of the same failed attempt: each rank's rows from the part that
    saw the most of them (rank 0's owner gives the accuracy and the parameters), the best-founded failure."""
    parts = [old, new]
    merged = copy.deepcopy(new)
    owners = [_owner(parts, r) for r in range(new.world_size)]
    merged.ranks = [copy.deepcopy(o.ranks[r]) for r, o in enumerate(owners)]
    for name in ("peak_rss_mb", "bytes_allreduced", "allreduce_calls", "peak_cuda_mb"):
        merged_list = [getattr(o, name)[r] if r < len(getattr(o, name)) else float("nan")
                       for r, o in enumerate(owners)]
        setattr(merged, name, merged_list)
    first = owners[0]
    merged.test_accuracy, merged.final_params = first.test_accuracy, copy.deepcopy(first.final_params)
    merged.startup_s, merged.loop_time_s = first.startup_s, first.loop_time_s
    merged.wall_time_s = max(old.wall_time_s, new.wall_time_s)
    merged.captured_grads = old.captured_grads or new.captured_grads
    failure = _failure(parts)
    seen = sorted(set(old.provenance.get("seen", [])) | set(new.provenance.get("seen", [])))
    prov = merged.provenance
    prov.update(failure=failure, seen=seen, writers=sorted(set(old.provenance.get("writers", []))
                                                            | set(new.provenance.get("writers", []))))
    drop = {p.provenance.get(FAILURE_NOTE) for p in parts} | {p.provenance.get("unseen_note") for p in parts}
    notes = [n for n in dict.fromkeys(old.notes + new.notes) if n not in drop]
    prov[FAILURE_NOTE] = failure.get("note", "")
    notes.append(prov[FAILURE_NOTE])
    unseen = [r for r in range(new.world_size) if r not in seen]
    prov["unseen_note"] = unseen_note(unseen)
    if unseen:
        notes.append(prov["unseen_note"])
    merged.notes = notes
    return merged


def unseen_note(unseen: List[int]) -> str:
    """The note naming the ranks whose rows no writer of the partial result could see."""
    return (f"ranks {unseen} kept their rows on their own machines, whose ranks wrote no partial result (a node "
            "that failed, or ranks killed by SIGKILL)")
