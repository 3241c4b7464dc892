"""Core binding: each CPU rank's training thread gets cores of its own; gloo's threads and loader workers don't."""
from __future__ import annotations

import os

import pytest
import torch

from ddp_helpers import LaunchError, launch
import ddp_helpers.ranks.cores as P
from ddp_helpers.ranks.cores import core_plan, usable_cores
from ddp_helpers.engine.batches import loader_worker_init

CORES = usable_cores()
needs_two_cores = pytest.mark.skipif(len(CORES) < 2 or not hasattr(os, "sched_setaffinity"),
                                     reason="binding needs at least 2 usable cores (Linux)")


def test_plan_gives_each_rank_its_own_cores():
    plan = core_plan(3, 2, list(range(8)))
    assert plan == [[0, 1], [2, 3], [4, 5]]
    flat = [c for cores in plan for c in cores]
    assert len(flat) == len(set(flat))  # disjoint


def test_plan_follows_the_usable_cores_not_their_numbers():
    assert core_plan(2, 1, [3, 7]) == [[3], [7]]


@pytest.mark.parametrize("world_size, threads, n_cores", [(1, 1, 4), (3, 1, 2), (2, 2, 3)])
def test_no_plan_when_binding_cannot_help(world_size, threads, n_cores):
    assert core_plan(world_size, threads, list(range(n_cores))) is None


def _affinities(rank, world_size):
    """This rank's training thread's cores, and those of its other threads (gloo's)."""
    me = os.sched_getaffinity(0)
    others = {}
    for tid in os.listdir("/proc/self/task"):
        if int(tid) != __import__("threading").get_native_id():
            try:  # a short-lived thread (torch's, a logger's) may end between the listing and the read
                with open(f"/proc/self/task/{tid}/comm") as fh:
                    others[fh.read().strip()] = os.sched_getaffinity(int(tid))
            except (FileNotFoundError, ProcessLookupError):
                continue
    return sorted(me), {k: sorted(v) for k, v in others.items()}


@needs_two_cores
def test_launched_ranks_are_bound_and_gloo_threads_are_not():
    out = launch(_affinities, 2, start_method="fork", threads_per_rank=1)
    plan = core_plan(2, 1, CORES)
    assert [mine for mine, _ in out] == plan, out
    for _, others in out:
        gloo = {name: cores for name, cores in others.items() if "gloo" in name}
        assert gloo, others  # gloo's communication threads exist ...
        assert all(cores == CORES for cores in gloo.values()), gloo  # ... and may run anywhere


@needs_two_cores
def test_bind_cores_false_leaves_ranks_free():
    out = launch(_affinities, 2, start_method="fork", threads_per_rank=1, bind_cores=False)
    assert [mine for mine, _ in out] == [CORES, CORES]


def test_bind_cores_true_is_refused_before_launch_when_cores_are_short():
    with pytest.raises(LaunchError, match="bind_cores"):
        launch(_affinities, len(CORES) + 1, start_method="fork", threads_per_rank=1, bind_cores=True)


@pytest.mark.parametrize("world, threads, backend, reason", [
    (2, 1, "nccl", "binding is for CPU ranks (gloo); backend 'nccl' runs each rank on its own GPU"),
    (1, 1, "gloo", "there is only 1 rank"),
    (2, 3, "gloo", "2 ranks x 3 threads need 6 cores of their own, and there are 4 usable cores"),
])
def test_refused_binding_names_only_the_rule_that_fails(monkeypatch, world, threads, backend, reason):
    monkeypatch.setattr(P, "usable_cores", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(P, "cpu_quota", lambda: None)
    with pytest.raises(ValueError) as e:
        P.binding_plan(world, threads, backend, True)
    assert reason in str(e.value)
    assert str(e.value).count(";") <= 1 and "(not 'gloo')" not in str(e.value)


class _AffinityDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 2

    def __getitem__(self, i):
        return torch.tensor(sorted(os.sched_getaffinity(0)))


def _loader_worker_cores(rank, world_size):
    loader = torch.utils.data.DataLoader(_AffinityDataset(), batch_size=None, num_workers=1,
                                         worker_init_fn=loader_worker_init)
    return sorted(os.sched_getaffinity(0)), [t.tolist() for t in loader]


@needs_two_cores
def test_dataloader_workers_of_a_bound_rank_use_every_core():
    # The seed pipeline's loader workers must not be squeezed onto their rank's core: the benchmark would
    # then slow the listing's pipeline down artificially.
    out = launch(_loader_worker_cores, 2, start_method="fork", threads_per_rank=1)
    for rank, (mine, workers) in enumerate(out):
        assert mine == core_plan(2, 1, CORES)[rank]
        assert workers == [CORES, CORES], workers


def _refuse(*args):
    raise PermissionError("sched_setaffinity not allowed here")


@needs_two_cores
def test_a_sandbox_that_forbids_binding_still_trains(monkeypatch):
    from ddp_helpers import TrainConfig, run_training

    monkeypatch.setattr(os, "sched_setaffinity", _refuse)  # forked ranks inherit the refusal
    res = run_training(TrainConfig(dataset="mnist-5k", max_steps=3, threads_per_rank=1), progress=False,
                       start_method="fork")
    assert res.n_steps == 3 and res.fingerprints_agree()


def test_bind_cores_true_is_refused_by_validate_naming_the_setting():
    from ddp_helpers import ConfigError, TrainConfig, validate

    with pytest.raises(ConfigError, match=r"TrainConfig\.bind_cores=True .*None \(bind when possible\) or False"):
        validate(TrainConfig(dataset="mnist-5k", world_size=len(CORES) + 1, threads_per_rank=1, bind_cores=True))
