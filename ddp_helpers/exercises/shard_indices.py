"""Exercise 3, shard_indices(n, rank, world_size, epoch, seed): disjoint, covering, equal shards, reshuffled."""
from __future__ import annotations

from typing import Any, Callable, Dict, List

import numpy as np
import torch

from ._harness import call_cases, exercise, fail, run_ranks, student_outcomes

SHARD_SEED = 7


def _indices(value: Any) -> Dict[str, Any]:
    """In a rank: the report for one returned shard, as a list of ints."""
    try:
        return {"status": "ok", "value": [int(i) for i in torch.as_tensor(value).reshape(-1).tolist()]}
    except (TypeError, ValueError, RuntimeError):
        return {"status": "mistake", "mistake": "not_indices",
                "hint": f"return a list (or tensor) of ints, not {type(value).__name__}."}


def _in_rank(rank: int, world_size: int, student_fn: Callable) -> Dict[str, Any]:
    """In each rank: the learner's indices for each case (stopping at the first failing call)."""
    cases = {"n12_e0": (12, 0, SHARD_SEED), "n12_e1": (12, 1, SHARD_SEED), "n12_e0_again": (12, 0, SHARD_SEED),
             "n12_seed": (12, 0, SHARD_SEED + 100), "n11_e0": (11, 0, SHARD_SEED)}  # (n, epoch, seed)
    args = {key: (n, rank, world_size, epoch, seed) for key, (n, epoch, seed) in cases.items()}
    return call_cases(student_fn, args, _indices)


def _check_split(shards: List[List[int]], n: int, world_size: int) -> None:
    """Raise the verdict for the first problem of one epoch's shards (one list per rank)."""
    for r, s in enumerate(shards):
        bad = [i for i in s if not 0 <= i < n]
        if bad:
            raise fail("out_of_range", f"rank {r} got index {bad[0]}, but the data set has indices 0..{n - 1}.")
    if all(sorted(s) == list(range(n)) for s in shards):
        raise fail("every_rank_all", f"every rank got all {n} indices (the listing's bug: no sampler): keep only "
                                     "this rank's 1/world_size share, e.g. perm[rank::world_size].")
    lengths = [len(s) for s in shards]
    if len(set(lengths)) > 1:
        raise fail("unequal_lengths", f"n={n}: the ranks got {lengths} indices. A rank with fewer batches "
                                      "finishes early and the others wait for it forever in the all-reduce: pad "
                                      "to ceil(n / world_size) each by repeating the first indices.")
    per_rank = -(-n // world_size)
    counts = np.bincount([i for s in shards for i in s], minlength=n)
    repeats = int((counts - 1).clip(min=0).sum())  # padding allows per_rank * world_size - n of them
    overlap = set(shards[0]).intersection(*map(set, shards[1:])) if len(shards) > 1 else set()
    if repeats > max(per_rank * world_size - n, 0):
        raise fail("overlap", f"n={n}: ranks 0 and 1 share {len(overlap)} indices. Shuffle with the same seed on "
                              "every rank (seed + epoch, not rank), then split that one permutation: "
                              "perm[rank::world_size].")
    missing = sorted(set(range(n)) - {i for s in shards for i in s})
    if missing:
        raise fail("not_covering", f"n={n}: indices {missing[:5]} are never used by any rank: every sample must "
                                   "be in some rank's shard (pad with repeats instead of dropping).")
    if lengths[0] != per_rank:
        raise fail("unequal_lengths", f"n={n}: each rank got {lengths[0]} indices, expected ceil(n / world_size) "
                                      f"= {per_rank}.")


@exercise("shard_indices")
def check_shard_indices(student_fn: Callable) -> str:
    """Exercise 3: shard_indices(n, rank, world_size, epoch, seed): disjoint, covering, equal, reshuffled."""
    outs = run_ranks(_in_rank, 2, (student_fn,))
    student_outcomes(outs)
    ranks = [{k: v["value"] for k, v in o.items() if k != "call"} for o in outs]
    _check_split([r["n12_e0"] for r in ranks], 12, 2)
    if all(r["n12_e0"] == sorted(r["n12_e0"]) for r in ranks):
        raise fail("not_shuffled", "each rank's indices come in increasing order: shuffle them, with a "
                                   "torch.Generator seeded with seed + epoch.")
    if any(r["n12_e0_again"] != r["n12_e0"] for r in ranks):
        raise fail("nondeterministic", "the same (n, rank, epoch, seed) gave a different order the second time, "
                                       "so the ranks can't agree on one permutation: use a torch.Generator seeded "
                                       "with seed + epoch, not the global random state.")
    _check_split([r["n12_e1"] for r in ranks], 12, 2)
    if all(r["n12_e1"] == r["n12_e0"] for r in ranks):
        raise fail("same_every_epoch", "epoch 1 repeats epoch 0's order: mix the epoch into the generator's seed "
                                       "(that is what sampler.set_epoch(epoch) does).")
    if all(r["n12_seed"] == r["n12_e0"] for r in ranks):
        raise fail("seed_ignored", "a different seed gave the same order: seed the generator with seed + epoch.")
    _check_split([r["n11_e0"] for r in ranks], 11, 2)
    return ("disjoint shards of equal length that cover the data set (11 samples: 6 each, one repeated), "
            "reshuffled every epoch and reproducible from the seed.")


