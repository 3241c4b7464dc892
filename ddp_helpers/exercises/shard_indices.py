"""Exercise 3, shard_indices(n, rank, world_size, epoch, seed): disjoint, covering, equal shards, reshuffled,
from a generator of its own (the global random state left as it was)."""
from __future__ import annotations

import pickle
import random
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from ._harness import Verdict, call_cases, exercise, fail, run_ranks, student_outcomes
from ._watch import record_seeds

SHARD_SEED = 7
WORLD_SIZE = 2

NUDGES = {
    "out_of_range": "some index is not a position in the data set.",
    "every_rank_all": "each rank should see only its own part of the data set: how big is one rank's part?",
    "unequal_lengths": "the ranks got different numbers of indices: what happens to a rank that runs out of "
                       "batches first?",
    "overlap": "some samples are on two ranks: can the ranks split one order between them if each shuffles "
               "differently?",
    "overlapping_slices": "some samples are on two ranks, although every rank shuffled the same way: how did "
                          "each rank pick its part?",
    "not_covering": "some samples are on no rank at all.",
    "not_shuffled": "the indices come out in a fixed order.",
    "nondeterministic": "the same arguments gave two different answers: where does your randomness come from?",
    "same_every_epoch": "think about what should change from one epoch to the next.",
    "seed_ignored": "one of your function's arguments has no effect on the result.",
    "global_rng": "the shards are right, but look at what else your function changes: which random state does "
                  "the exercise say to use?",
}


def _global_states() -> Dict[str, bytes]:
    """The global random states a learner could use: torch's default generator, Python's, NumPy's."""
    return {"torch": torch.get_rng_state().numpy().tobytes(), "random": pickle.dumps(random.getstate()),
            "numpy": pickle.dumps(np.random.get_state())}


def _indices(value: Any) -> Dict[str, Any]:
    """In a rank: the report for one returned shard, as a list of ints."""
    try:
        return {"status": "ok", "value": [int(i) for i in torch.as_tensor(value).reshape(-1).tolist()]}
    except (TypeError, ValueError, RuntimeError):
        return {"status": "mistake", "mistake": "not_indices",
                "hint": f"return a list (or tensor) of ints, not {type(value).__name__}."}


def _in_rank(rank: int, world_size: int, student_fn: Callable) -> Dict[str, Any]:
    """In each rank: the learner's indices for each case (stopping at the first failing call), and per case the
    seeds its code gave torch's generators."""
    cases = {"n12_e0": (12, 0, SHARD_SEED), "n12_e1": (12, 1, SHARD_SEED), "n12_e0_again": (12, 0, SHARD_SEED),
             "n12_seed": (12, 0, SHARD_SEED + 100), "n11_e0": (11, 0, SHARD_SEED)}  # (n, epoch, seed)
    args = {key: (n, rank, world_size, epoch, seed) for key, (n, epoch, seed) in cases.items()}
    seeds = record_seeds(student_fn)
    per_case: List[List[Tuple[str, int]]] = []
    touched: List[str] = []  # the global random states some call changed
    before = [_global_states()]

    def report(value: Any) -> Dict[str, Any]:
        per_case.append(list(seeds))
        seeds.clear()
        after = _global_states()
        touched.extend(k for k in after if after[k] != before[0][k] and k not in touched)
        before[0] = after
        return _indices(value)

    out = call_cases(student_fn, args, report)
    out["seeds"] = dict(zip(args, per_case))
    out["global_rng"] = touched
    return out


def _overlap(n: int, shared: int, seeds: Sequence[Sequence[Tuple[str, int]]]) -> Verdict:
    """The verdict for shards that overlap: the ranks shuffled differently (their seeds say so), or they cut one
    shared permutation into overlapping parts."""
    said = f"n={n}: {shared} indices are on more than one rank"
    other = next((r for r, s in enumerate(seeds) if list(s) != list(seeds[0])), None)
    if seeds and all(seeds) and other is not None:
        return fail("overlap", f"{said}. Rank 0 seeded with {_seeds(seeds[0])}, rank {other} with "
                               f"{_seeds(seeds[other])}: "
                               "the ranks shuffled differently, so their shares of their permutations overlap. Use "
                               "the same seed on every rank (from seed and epoch, not rank), then give each rank "
                               "its own share of that one permutation.")
    if seeds and all(seeds):
        return fail("overlapping_slices", f"{said}. Every rank seeded its generator with {_seeds(seeds[0])}, so "
                                          "they all hold the same permutation, but the parts they took from it "
                                          "overlap: give each rank a part of its own (no position of the padded "
                                          "permutation in two ranks' parts).")
    return fail("overlap", f"{said}. Shuffle with the same seed on every rank (from seed and epoch, not rank), "
                           "then give each rank its own share of that one permutation.")


def _seeds(seeds: Sequence[Tuple[str, int]]) -> str:
    """'1007' or '1007, 3' for the seeds one call gave torch's generators."""
    return ", ".join(str(s) for _, s in seeds)


def _check_split(shards: List[List[int]], n: int, world_size: int,
                 seeds: Sequence[Sequence[Tuple[str, int]]] = ()) -> None:
    """Raise the verdict for the first problem of one epoch's shards (one list per rank; seeds: each rank's
    recorded seeds for that call, or none)."""
    for r, s in enumerate(shards):
        bad = [i for i in s if not 0 <= i < n]
        if bad:
            raise fail("out_of_range", f"rank {r} got index {bad[0]}, but the data set has indices 0..{n - 1}.")
    if all(sorted(s) == list(range(n)) for s in shards):
        raise fail("every_rank_all", f"every rank got all {n} indices (the listing's bug: no sampler): keep only "
                                     "this rank's 1/world_size share of the shuffled indices.")
    lengths = [len(s) for s in shards]
    if len(set(lengths)) > 1:
        raise fail("unequal_lengths", f"n={n}: the ranks got {lengths} indices. A rank with fewer batches "
                                      "finishes early and the others wait for it forever in the all-reduce: pad "
                                      "to ceil(n / world_size) each by repeating the first indices.")
    per_rank = -(-n // world_size)
    counts = np.bincount([i for s in shards for i in s], minlength=n)
    repeats = int((counts - 1).clip(min=0).sum())  # padding allows per_rank * world_size - n of them
    if repeats > max(per_rank * world_size - n, 0):
        raise _overlap(n, int((counts > 1).sum()), seeds)
    missing = sorted(set(range(n)) - {i for s in shards for i in s})
    if missing:
        raise fail("not_covering", f"n={n}: indices {missing[:5]} are never used by any rank: every sample must "
                                   "be in some rank's shard (pad with repeats instead of dropping).")
    if lengths[0] != per_rank:
        raise fail("unequal_lengths", f"n={n}: each rank got {lengths[0]} indices, expected ceil(n / world_size) "
                                      f"= {per_rank}.")


def _check_global_state(outs: Sequence[Dict[str, Any]]) -> None:
    """Raise the verdict for shards drawn from (or a function that reseeds) a global random generator."""
    touched = outs[0]["global_rng"]
    if not touched:
        return
    which = {"torch": "torch's global random state", "random": "Python's global random state (random.seed, "
             "random.shuffle)", "numpy": "NumPy's global random state (np.random.seed, np.random.permutation)"}
    seeded = sorted({s for case in outs[0]["seeds"].values() for kind, s in case if kind == "global"})
    how = f" (torch.manual_seed({seeded[0]}), then a draw without a generator)" if touched[0] == "torch" and seeded \
        else ""
    raise fail("global_rng", f"the shards are right, but your function changed {which[touched[0]]}{how}. The "
                             "training script's other random draws (initialization, dropout, augmentation) share "
                             "that state: your function would reset them every epoch, and any draw between two calls "
                             "would change the shards. Draw the permutation from a torch.Generator of your own, "
                             "seeded from seed and epoch.")


@exercise("shard_indices", NUDGES)
def check_shard_indices(student_fn: Callable, world_size: Optional[int] = None) -> str:
    """Exercise 3: shard_indices(n, rank, world_size, epoch, seed): disjoint, covering, equal, reshuffled."""
    world_size = world_size or WORLD_SIZE
    outs = run_ranks(_in_rank, world_size, (student_fn,))
    student_outcomes(outs)
    ranks = [{k: v["value"] for k, v in o.items() if k not in ("call", "seeds", "global_rng")} for o in outs]
    _check_split([r["n12_e0"] for r in ranks], 12, world_size, [o["seeds"]["n12_e0"] for o in outs])
    if all(r["n12_e0"] == sorted(r["n12_e0"]) for r in ranks):
        raise fail("not_shuffled", "each rank's indices come in increasing order: shuffle them, with a "
                                   "torch.Generator seeded with seed + epoch.")
    if any(r["n12_e0_again"] != r["n12_e0"] for r in ranks):
        raise fail("nondeterministic", "the same (n, rank, epoch, seed) gave a different order the second time, "
                                       "so the ranks can't agree on one permutation: use a torch.Generator seeded "
                                       "with seed + epoch, not the global random state.")
    _check_split([r["n12_e1"] for r in ranks], 12, world_size, [o["seeds"]["n12_e1"] for o in outs])
    if all(r["n12_e1"] == r["n12_e0"] for r in ranks):
        raise fail("same_every_epoch", "epoch 1 repeats epoch 0's order: mix the epoch into the generator's seed "
                                       "(that is what sampler.set_epoch(epoch) does).")
    if all(r["n12_seed"] == r["n12_e0"] for r in ranks):
        raise fail("seed_ignored", "a different seed gave the same order: seed the generator with seed + epoch.")
    _check_split([r["n11_e0"] for r in ranks], 11, world_size, [o["seeds"]["n11_e0"] for o in outs])
    _check_global_state(outs)
    per_rank = -(-11 // world_size)
    return (f"disjoint shards of equal length that cover the data set (11 samples on {world_size} ranks: "
            f"{per_rank} each, {per_rank * world_size - 11} repeated), reshuffled every epoch and reproducible "
            "from the seed.")


