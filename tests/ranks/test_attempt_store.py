"""After a torchrun restart, a rank sees the agent's shared store through its attempt's own prefix."""
from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from ddp_helpers.ranks.env import RankEnv
from ddp_helpers.ranks.rank import attempt_store

T = datetime.timedelta(seconds=10)


@pytest.fixture
def agent_store():
    """What torchrun's agent hosts: one store for every attempt of the job."""
    return dist.TCPStore("127.0.0.1", 0, 1, is_master=True, timeout=T, wait_for_workers=False)


def _env(store) -> RankEnv:
    return RankEnv(rank=0, local_rank=0, world_size=1, local_world_size=1, master_addr="127.0.0.1",
                   master_port=store.port)


def test_a_restarted_rank_does_not_read_the_failed_attempts_keys(agent_store, monkeypatch):
    agent_store.set("0/rank_1", "the first attempt's rank 1, now dead")  # as gloo's rendezvous left it
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    store = attempt_store(_env(agent_store), T)
    assert not store.check(["0/rank_1"])  # a fresh view: gloo waits for the new rank 1's address
    store.set("0/rank_1", "the new rank 1")
    assert agent_store.get("ddp_helpers/attempt1/0/rank_1") == b"the new rank 1"  # in the same agent store
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert not attempt_store(_env(agent_store), T).check(["0/rank_1"])  # and each attempt has its own


@pytest.mark.parametrize("env", [
    {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"},  # the first attempt
    {"TORCHELASTIC_USE_AGENT_STORE": "True"},  # launch(): no restarts
    {"TORCHELASTIC_USE_AGENT_STORE": "False", "TORCHELASTIC_RESTART_COUNT": "1"},  # a fresh store per attempt
])
def test_otherwise_env_init_is_left_as_torchrun_sets_it(agent_store, monkeypatch, env):
    for k in ("TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert attempt_store(_env(agent_store), T) is None
