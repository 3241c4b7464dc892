"""TORCH_DISTRIBUTED_DEBUG set in the notebook after warm_up() takes effect in the ranks (issue 49, round-4
leftover): the forkserver imported torch.distributed, which reads the variable once, before it was set."""
from __future__ import annotations

import os

import pytest

from ddp_helpers import launch


def _level(rank, world_size):
    import torch.distributed as dist

    return os.environ.get("TORCH_DISTRIBUTED_DEBUG"), str(dist.get_debug_level())


@pytest.mark.parametrize("start_method", ["forkserver", "fork"])
def test_a_debug_level_set_after_warm_up_reaches_the_ranks(monkeypatch, start_method):
    import torch.distributed  # noqa: F401 - imported here before the variable is set, as in a warmed-up kernel

    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    launch(_level, 1, start_method=start_method)  # the server (or this process) has torch imported: level OFF
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")
    for env, level in launch(_level, 2, start_method=start_method):
        assert env == "DETAIL" and level.endswith("DETAIL"), (env, level)
