"""Exercise 4, make_loader(dataset, rank, world_size, batch_size, epoch): DistributedSampler and set_epoch."""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from ..engine.config import ConfigError
from ._harness import Verdict, call_cases, exercise, fail, run_ranks, student_outcomes

LOADER_N, LOADER_BATCH = 40, 4
WORLD_SIZE = 2

NUDGES = {
    "no_sampler": "each rank should read only its own part of the data set: which DataLoader argument decides "
                  "the order and choice of samples?",
    "wrong_replicas": "the sampler has a wrong idea of how many ranks share the data set.",
    "wrong_rank": "two ranks read the same part of the data set: how does the sampler know which part is "
                  "whose?",
    "seed_per_rank": "the ranks' shuffles don't fit together: should each rank shuffle differently?",
    "batch_size": "the batches have the wrong size.",
    "not_shuffled": "every epoch has the same, unshuffled order.",
    "no_set_epoch": "the order of the samples does not change from one epoch to the next: what does the sampler "
                    "need to be told at the start of each epoch?",
    "epochs_differ": "the ranks' shuffles don't fit together: what does each rank tell its sampler?",
    "overlap": "the ranks' samples overlap, or some samples are missing.",
    "nondeterministic": "the same epoch gave two different orders: who does the shuffling?",
    "shuffle_and_sampler": "the DataLoader refused your arguments: which of them do the same job twice?",
}


def _describe(loader: Any) -> Dict[str, Any]:
    """In a rank: the call's report for the returned loader, its sampler's settings and the batches it yields."""
    if not isinstance(loader, DataLoader):
        return {"status": "mistake", "mistake": "not_a_loader",
                "hint": f"return the DataLoader, not {type(loader).__name__}."}
    sampler = loader.sampler
    info: Dict[str, Any] = {"sampler": type(sampler).__name__, "distributed": isinstance(sampler, DistributedSampler)}
    if info["distributed"]:
        info.update(rank=sampler.rank, num_replicas=sampler.num_replicas, epoch=sampler.epoch,
                    shuffle=sampler.shuffle, seed=sampler.seed)
    try:
        info["batches"] = [[int(i) for i in y.reshape(-1).tolist()] for _, y in loader]
    except Exception as e:  # noqa: BLE001 - iterating runs the learner's settings: any error becomes a hint
        return {"status": "error", "type": type(e).__name__, "message": str(e)[:300],
                "where": " while iterating your DataLoader", "comm": False}
    return {"status": "ok", "value": info}


def _in_rank(rank: int, world_size: int, student_fn: Callable) -> Dict[str, Any]:
    """In each rank: the learner's loader for epochs 0, 1 and 0 again (stopping at the first failing call)."""
    # Each sample's label is its own index, so the batches say exactly which samples a rank saw.
    dataset = TensorDataset(torch.arange(LOADER_N, dtype=torch.float32).unsqueeze(1), torch.arange(LOADER_N))
    epochs = {"e0": 0, "e1": 1, "e0_again": 0}
    args = {key: (dataset, rank, world_size, LOADER_BATCH, epoch) for key, epoch in epochs.items()}
    return call_cases(student_fn, args, _describe)


def _check_samplers(infos: List[Dict[str, Any]], seen: Dict[str, List[List[int]]], world_size: int) -> None:
    """Raise the verdict for the first wrong setting of the ranks' epoch-0 loaders and samplers."""
    if not all(info["e0"]["distributed"] for info in infos):
        if all(sorted(s) == list(range(LOADER_N)) for s in seen["e0"]):
            raise fail("no_sampler", f"every rank iterates all {LOADER_N} samples (Listing 7.2's bug): give the "
                                     "DataLoader a DistributedSampler that knows this rank and the world size.")
        raise fail("no_sampler", f"the loader uses a {infos[0]['e0']['sampler']}: use a "
                                 "torch.utils.data.DistributedSampler that knows this rank and the world size.")
    for r, info in enumerate(infos):
        if info["e0"]["num_replicas"] != world_size:
            raise fail("wrong_replicas", f"rank {r}'s sampler has num_replicas={info['e0']['num_replicas']}: pass "
                                         "num_replicas=world_size.")
        if info["e0"]["rank"] != r:
            raise fail("wrong_rank", f"rank {r}'s sampler was built with rank={info['e0']['rank']}, so two ranks "
                                     "read the same shard: pass rank=rank.")
    if len({info["e0"]["seed"] for info in infos}) > 1:
        raise fail("seed_per_rank", "the ranks' samplers have different seeds, so their shuffles overlap: give every "
                                    "rank the same seed (the default 0 is fine).")
    sizes = [len(b) for info in infos for b in info["e0"]["batches"]]
    if sizes and sizes[0] != LOADER_BATCH:
        raise fail("batch_size", f"the first batch has {sizes[0]} samples, expected batch_size={LOADER_BATCH}: pass "
                                 "batch_size=batch_size to the DataLoader.")
    if not all(info["e0"]["shuffle"] for info in infos):
        raise fail("not_shuffled", "the sampler was built with shuffle=False, so every epoch has the same order: "
                                   "keep DistributedSampler's default shuffle=True.")


def _check_epochs(infos: List[Dict[str, Any]], seen: Dict[str, List[List[int]]]) -> None:
    """Raise the verdict for the first problem across epochs: no reshuffle, overlapping shards, no determinism."""
    for k in ("e0", "e1"):
        told = [info[k]["epoch"] for info in infos]
        if len(set(told)) > 1:  # before the order checks: differently told ranks also overlap
            raise fail("epochs_differ", f"asked for epoch {k[1]}, the ranks told their samplers different epochs "
                                        f"({', '.join(f'rank {r}: {e}' for r, e in enumerate(told))}), so each "
                                        "shuffled differently and their shards overlap: tell every rank's "
                                        "sampler the same epoch, the one your function was given.")
    if all(info["e1"]["epoch"] == info["e0"]["epoch"] for info in infos) or all(
            a == b for a, b in zip(seen["e0"], seen["e1"])):
        said = infos[0]["e1"]["epoch"]
        raise fail("no_set_epoch", f"epoch 1 repeats epoch 0's order: the sampler's epoch was {said} both times. "
                                   "Call sampler.set_epoch(epoch) before iterating (DistributedSampler reshuffles "
                                   "only when told the epoch).")
    for k in ("e0", "e1"):
        flat = [i for s in seen[k] for i in s]
        if len(set(flat)) != len(flat) or set(flat) != set(range(LOADER_N)):
            raise fail("overlap", f"in epoch {k[1]} the ranks' samples overlap or miss some, although every "
                                  "rank's DistributedSampler has the right rank, num_replicas, seed and epoch: "
                                  "the DataLoader must draw its samples from that sampler alone.")
    if seen["e0_again"] != seen["e0"]:
        seeds = [infos[0][k]["seed"] for k in ("e0", "e0_again")]
        if seeds[0] != seeds[1]:
            raise fail("nondeterministic", f"asking for epoch 0 twice gave two different orders: your sampler's "
                                           f"seed changed between the calls ({seeds[0]}, then {seeds[1]}). Give "
                                           "it a fixed seed (the default 0 is fine).")
        raise fail("nondeterministic", "asking for epoch 0 twice gave two different orders: let the "
                                       "DistributedSampler shuffle (seeded), not the DataLoader.")


@exercise("make_loader", NUDGES)
def check_make_loader(student_fn: Callable, world_size: Optional[int] = None) -> str:
    """Exercise 4: make_loader(dataset, rank, world_size, batch_size, epoch) with DistributedSampler + set_epoch."""
    world_size = world_size or WORLD_SIZE
    if LOADER_N % world_size:
        raise ConfigError(f"world_size={world_size}: the loader check needs a world size that divides {LOADER_N} "
                          "(its sampler would pad otherwise), e.g. 2, 4 or 5.")
    outs = run_ranks(_in_rank, world_size, (student_fn,))
    try:
        student_outcomes(outs)
    except Verdict as v:
        if v.mistake == "error" and "mutually exclusive" in v.hint:
            raise fail("shuffle_and_sampler", "DataLoader(shuffle=True) can't be combined with a sampler: the "
                                              "DistributedSampler does the shuffling, so drop shuffle=True.") from None
        raise
    infos = [{k: v["value"] for k, v in o.items() if k != "call"} for o in outs]
    # The sample indices each rank saw, per case, in order.
    seen = {k: [[i for b in info[k]["batches"] for i in b] for info in infos] for k in ("e0", "e1", "e0_again")}
    _check_samplers(infos, seen, world_size)
    _check_epochs(infos, seen)
    return (f"each of the {world_size} ranks reads its own {LOADER_N // world_size} of the {LOADER_N} samples in "
            f"batches of {LOADER_BATCH}, and set_epoch gives every epoch a new order.")
