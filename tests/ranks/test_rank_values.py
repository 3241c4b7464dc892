"""What a rank's function may do and return: end with destroy_process_group(), return a value of a class defined
in a notebook cell, see the launcher's environment as it is now; and what can't travel is named."""
from __future__ import annotations

import os
import threading

import pytest

from ddp_helpers import LaunchError, RankFailedError, launch


def _torchrun_idiom(rank: int, world_size: int) -> int:
    import torch
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()  # how a torchrun script ends
    return int(t.item())


def test_a_function_that_ends_with_destroy_process_group_returns_its_value():
    assert launch(_torchrun_idiom, 2, threads_per_rank=1) == [2, 2]


def _cell_classes():
    """A dataclass and a namedtuple as a notebook cell defines them: in __main__, unknown to pickle by name."""
    import collections
    import dataclasses

    Point = dataclasses.make_dataclass("Point", [("rank", int), ("norm", float)])
    Pair = collections.namedtuple("Pair", "rank total")
    Point.__module__ = Pair.__module__ = "__main__"
    return Point, Pair


def test_values_of_classes_defined_in_a_cell_come_back():
    Point, Pair = _cell_classes()

    def fn(rank, world_size):
        return Point(rank, 0.5), Pair(rank, world_size)

    out = launch(fn, 2, init_group=False)
    assert [(p.rank, p.norm, q.rank, q.total) for p, q in out] == [(0, 0.5, 0, 2), (1, 0.5, 1, 2)]


def test_a_value_that_cant_be_sent_back_is_named():
    def fn(rank, world_size):
        return threading.Lock()

    with pytest.raises(RankFailedError) as e:
        launch(fn, 2, init_group=False)
    assert "returned a lock that can't be sent back" in e.value.message and "exit()" not in str(e.value)


def test_a_global_that_cant_be_sent_is_named_before_any_rank_starts(monkeypatch):
    import ddp_helpers.ranks.launcher as L

    lock = threading.Lock()
    started = []
    monkeypatch.setattr(L, "start_ranks", lambda *a, **k: started.append(1))

    def fn(rank, world_size):
        return lock.locked()

    with pytest.raises(LaunchError, match="can't send the function or its arguments .* a global the function uses"):
        launch(fn, 2, start_method="forkserver")
    assert not started


def _reads(rank: int, world_size: int, name: str):
    return os.environ.get(name)


def test_a_variable_set_after_the_server_started_reaches_its_ranks(monkeypatch):
    launch(_reads, 2, args=("HOME",), start_method="forkserver")  # the server runs now
    monkeypatch.setenv("DDP_HELPERS_SET_LATE", "seen")
    assert launch(_reads, 2, args=("DDP_HELPERS_SET_LATE",), start_method="forkserver") == ["seen", "seen"]
