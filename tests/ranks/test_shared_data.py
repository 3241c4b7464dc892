"""The data cache's tensors reach the ranks shared: a rank that changes one in place is named, and the cache dropped,
so that no later run trains on the changed data without a word."""
from __future__ import annotations

import warnings

import pytest
import torch

from ddp_helpers import TrainConfig, launch, load_data
from ddp_helpers.data import clear_cache
from ddp_helpers.ranks.starting import SharedDataChanged

CFG = TrainConfig(dataset="mnist-5k")


@pytest.fixture(autouse=True)
def fresh_cache():
    clear_cache()
    yield
    clear_cache()


def _normalize_in_place(rank: int, world_size: int, images) -> float:
    batch = images[:64]  # a slice of the kernel's global, as the lessons take one
    batch.sub_(batch.mean())  # the learner's "centering", in place
    return float(batch.mean())


def _only_reads(rank: int, world_size: int, images) -> float:
    return float(images[:64].mean())


@pytest.mark.parametrize("field", ["train_normalized", "train_images"])
def test_a_rank_that_changes_the_cached_data_in_place_is_named_and_the_cache_dropped(field):
    data = load_data(CFG)
    images = data.train_normalized() if field == "train_normalized" else data.train_images
    before = images[:64].clone()
    with pytest.warns(SharedDataChanged, match=rf"load_data\('mnist-5k'\)\.{field}") as caught:
        launch(_normalize_in_place if field == "train_normalized" else _bump_bytes, 2, args=(images,),
               threads_per_rank=1)
    assert "x = x.clone()" in str(caught[0].message)
    assert not torch.equal(images[:64], before)  # this process's copy did change: that is what is named
    again = load_data(CFG)  # the cache was dropped: the files are read again, unchanged
    fresh = again.train_normalized() if field == "train_normalized" else again.train_images
    assert again is not data and torch.equal(fresh[:64], before)


def _bump_bytes(rank: int, world_size: int, images) -> int:
    images[:4] += 1  # uint8 pixels, in place
    return 0


def test_a_rank_that_only_reads_the_data_is_not_named():
    data = load_data(CFG)
    with warnings.catch_warnings():
        warnings.simplefilter("error", SharedDataChanged)
        launch(_only_reads, 2, args=(data.train_normalized(),), threads_per_rank=1)
    assert load_data(CFG) is data  # still cached


def test_a_tensor_the_caller_shares_on_purpose_is_the_callers_to_write():
    clock = torch.zeros(2).share_memory_()  # notebook 10's pattern: the ranks write into it

    def write(rank, world_size, out):
        out[rank] = rank + 1.0
        return rank

    with warnings.catch_warnings():
        warnings.simplefilter("error", SharedDataChanged)
        launch(write, 2, args=(clock,), threads_per_rank=1)
    assert clock.tolist() == [1.0, 2.0]
