"""The launcher's supervision: it waits without spinning, can start ranks without a process group, classifies
communication errors once for everyone, hands large captured arrays over once, and sets torchrun's variables."""
from __future__ import annotations

import os
import resource
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist

from ddp_helpers import RankFailedError, launch
from ddp_helpers.ranks.launcher import raised_in_collective
from ddp_helpers.ranks.starting import dumps


def _one_rank_ends_early(rank: int, world_size: int, wait_s: float) -> int:
    if rank == 1:
        time.sleep(wait_s)
    return rank


def _parent_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime + ru.ru_stime


def test_waiting_for_a_slow_rank_after_another_finished_does_not_spin():
    # Rank 0 ends at once; the parent then waits 2 s for rank 1. A poll loop that kept waking on the finished
    # rank's sentinel burned ~2.8 s of CPU in 3.1 s; waiting only on live ranks costs a few polls.
    launch(_one_rank_ends_early, 2, args=(0.0,), start_method="fork")  # warm: imports and first-launch costs
    cpu0, t0 = _parent_cpu_s(), time.monotonic()
    out = launch(_one_rank_ends_early, 2, args=(2.0,), start_method="fork", init_group=False)
    cpu, wall = _parent_cpu_s() - cpu0, time.monotonic() - t0
    assert out == [0, 1]
    assert wall >= 2.0
    assert cpu < 0.5 * wall, f"the parent used {cpu:.2f} s of CPU in {wall:.2f} s while waiting"


def _group_state(rank: int, world_size: int) -> bool:
    return dist.is_initialized()


def test_init_group_false_starts_ranks_without_a_process_group():
    assert launch(_group_state, 2, start_method="fork", init_group=False) == [False, False]
    assert launch(_group_state, 2, start_method="fork") == [True, True]


def _fails_without_group(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("no group here")


def test_a_failing_rank_without_a_group_is_still_named():
    with pytest.raises(RankFailedError) as e:
        launch(_fails_without_group, 2, start_method="fork", init_group=False)
    assert e.value.rank == 1 and isinstance(e.value.original, ValueError)


# ------------------------------------------------------------------ large values captured by a cell's function
def test_a_large_captured_array_travels_once_through_shared_memory():
    big = np.arange(8 * 2**20, dtype=np.float32)  # 32 MiB

    def rank_sees(rank, world_size):
        return float(big[-1]), big.flags.writeable

    assert len(dumps(rank_sees)) < 2**20, "the array was pickled by value"
    assert launch(rank_sees, 2, start_method="forkserver") == [(float(big[-1]), False)] * 2
    small = np.arange(10)
    assert len(dumps(lambda: small)) < 2**16


def _raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    raise AssertionError("nothing raised")


def test_errors_from_collectives_are_told_from_the_learners_own_by_where_they_were_raised():
    def learners_own():
        raise ValueError("shapes (3,) and (4,) differ")

    assert raised_in_collective(_raised(lambda: dist.all_reduce(torch.ones(1)))) is True  # inside torch.distributed
    assert raised_in_collective(_raised(learners_own)) is False
    assert raised_in_collective(dist.DistBackendError("peer closed")) is True  # torch's own type, wherever raised


def _raised_in_autograd(message):
    """An error whose innermost frame is the autograd engine's, as the engine re-raises one from C++."""
    engine = os.path.join(os.path.dirname(torch.autograd.__file__), "graph.py")
    return _raised(lambda: exec(compile(f"raise RuntimeError({message!r})", engine, "exec")))


def test_an_error_the_autograd_engine_raises_is_the_learners_unless_it_comes_from_the_collectives():
    """A hook that returns a value is refused by autograd, inside its engine: no peer was lost (issue 58)."""
    p = torch.nn.Parameter(torch.ones(3))
    p.register_post_accumulate_grad_hook(lambda q: q.grad)  # returns a value
    refused = _raised(lambda: (p * 2).sum().backward())
    assert "should return None" in str(refused)
    assert raised_in_collective(refused) is False
    # DDP's reducer waits for its all-reduces inside backward: gloo's error then comes out of the engine
    lost = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
            "[127.0.0.1]:57501")
    assert raised_in_collective(_raised_in_autograd(lost)) is True
    assert raised_in_collective(_raised_in_autograd("Function MulBackward0 returned an invalid gradient")) is False


def _big_result_while_the_peer_fails(rank: int, world_size: int, failed_at: str) -> bytes:
    if rank == 1:
        with open(failed_at, "w") as fh:
            fh.write(repr(time.monotonic()))  # CLOCK_MONOTONIC: one clock for every process here
        raise ValueError("rank 1 fails first")
    while not os.path.exists(failed_at):  # rank 0 reports once rank 1 failed: while the parent ends the launch
        time.sleep(0.01)
    return bytes(8 * 2**20)  # far more than a pipe holds: the write is still going on when rank 0 is ended


@pytest.mark.timeout(60)
def test_a_rank_ended_while_reporting_a_large_result_does_not_hang_the_parent(tmp_path):
    failed_at = tmp_path / "failed_at"
    with pytest.raises(RankFailedError) as info:
        launch(_big_result_while_the_peer_fails, 2, args=(str(failed_at),), init_group=False)
    raised = time.monotonic()
    assert info.value.rank == 1 and "rank 1 fails first" in str(info.value)
    took = raised - float(failed_at.read_text())
    assert took < 15, f"launch raised {took:.1f} s after rank 1 failed"  # ending rank 0: a grace, then SIGKILL


def _as_under_torchrun(rank: int, world_size: int):
    import os

    seen = {k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR")}
    dist.init_process_group("gloo")  # no arguments: env://, exactly as a torchrun script
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return seen, t.item()


def test_a_launched_function_reads_torchruns_variables_and_joins_with_no_arguments():
    out = launch(_as_under_torchrun, 2, init_group=False)
    assert [seen["RANK"] for seen, _ in out] == ["0", "1"] and [seen["LOCAL_RANK"] for seen, _ in out] == ["0", "1"]
    assert all(seen["WORLD_SIZE"] == seen["LOCAL_WORLD_SIZE"] == "2" and seen["MASTER_ADDR"] == "127.0.0.1"
               for seen, _ in out)
    assert [total for _, total in out] == [2.0, 2.0]


# What torchrun's agent sets for a worker (local_elastic_agent.py, _start_workers), in the same words for a rank
# launch() starts. Values that differ by job, with the reason each may:
PER_JOB = {"MASTER_ADDR": "the host each was given (torchrun --standalone says localhost)",
           "MASTER_PORT": "a free port, picked per job", "TORCHELASTIC_RUN_ID": "one id per job"}
TORCHRUN_ONLY = {"TORCHELASTIC_ERROR_FILE": "torchrun's agent reads each rank's error from it; launched ranks leave "
                                            "their outcome in the run folder (ranks/folders.py)",
                 "TORCHELASTIC_SIGNALS_TO_HANDLE": "the agent's own setting (torchrun's run.py), inherited"}
ENV_DUMP = """import json, os
with open(os.path.join({out!r}, "env" + os.environ["RANK"] + ".json"), "w") as fh:
    json.dump(dict(os.environ), fh)
"""


def _own_env(rank: int, world_size: int) -> dict:
    return dict(os.environ)


@pytest.mark.slow
def test_a_launched_rank_sees_torchruns_variables_with_torchruns_values(tmp_path):
    import json
    import subprocess
    import sys

    (tmp_path / "dump.py").write_text(ENV_DUMP.format(out=str(tmp_path)))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}  # as a fresh shell has it
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    str(tmp_path / "dump.py")], check=True, capture_output=True, env=env, timeout=120)
    before = dict(os.environ)
    try:
        os.environ.pop("OMP_NUM_THREADS", None)
        launched = launch(_own_env, 2, init_group=False, threads_per_rank=1)
    finally:
        os.environ.clear()
        os.environ.update(before)
    for rank in range(2):
        torchrun = json.loads((tmp_path / f"env{rank}.json").read_text())
        added = {k: v for k, v in torchrun.items() if before.get(k) != v}  # what the agent set for the worker
        assert added, "the torchrun worker saw nothing of the agent's"
        for key, value in sorted(added.items()):
            if key in TORCHRUN_ONLY:
                continue
            assert key in launched[rank], f"rank {rank}: launch() doesn't set {key} (torchrun: {value!r})"
            if key not in PER_JOB:
                assert launched[rank][key] == value, f"rank {rank}: {key} is {launched[rank][key]!r}, " \
                                                     f"torchrun sets {value!r}"
        assert {"RANK", "ROLE_RANK", "LOCAL_RANK", "GROUP_RANK", "OMP_NUM_THREADS"} <= set(added)


# -------------------------------------------------------------- no rank leaves init before its peers have a group
SLOW_GROUP_S = 1.0  # rank 1 finishes building its process group this much later than rank 0


def _slow_group_on_rank_1(monkeypatch, ready_file) -> None:
    """Rank 1's process group is built SLOW_GROUP_S late, as a rank on a busy core finishes connectFullMesh late,
    and the moment it exists is written to ready_file (patched in this process: forked ranks inherit it)."""
    from torch.distributed import distributed_c10d as c10d

    build = c10d._new_process_group_helper

    def late(*args, **kwargs):
        out = build(*args, **kwargs)
        if os.environ.get("RANK") == "1":
            time.sleep(SLOW_GROUP_S)
            ready_file.write_text(repr(time.monotonic()))  # CLOCK_MONOTONIC: one clock for every process
        return out

    monkeypatch.setattr(c10d, "_new_process_group_helper", late)


def _left_init(rank: int, world_size: int) -> float:
    return time.monotonic()


def _own_init_then_left(rank: int, world_size: int) -> float:
    dist.init_process_group("gloo")
    left = time.monotonic()
    dist.destroy_process_group()
    return left


@pytest.mark.parametrize("init_group", [True, False])
def test_no_rank_leaves_init_process_group_before_every_rank_has_its_group(monkeypatch, tmp_path, init_group):
    """Else a rank whose function returns at once exits while a peer still connects, and that peer fails with
    gloo's "Connection closed by peer" (ranks.rank.run_rank: TORCH_DIST_INIT_BARRIER). Both the group launch
    makes and the function's own init_process_group (init_group=False, as a torchrun script's)."""
    ready = tmp_path / "rank1_group_ready"
    _slow_group_on_rank_1(monkeypatch, ready)
    fn = _left_init if init_group else _own_init_then_left
    left = launch(fn, 2, start_method="fork", threads_per_rank=1, init_group=init_group)
    assert left[0] >= float(ready.read_text()), "rank 0 left init_process_group before rank 1's group existed"


class _Finalized:
    """Garbage (a cycle) whose finalizer writes the pid of the process that runs it."""

    def __init__(self, path: str):
        self.path, self.me = path, self

    def __del__(self):
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()}\n")


def _collect(rank: int, world_size: int) -> bool:
    import gc

    return gc.collect() >= 0


def test_a_forked_rank_never_collects_its_parents_garbage(tmp_path):
    """A forked rank inherits the parent's uncollected garbage; finalized there, a torch object's C++ destructor
    aborts the rank (its threads are not in the child), so the rank freezes what it inherits (boot.rank_main)."""
    import gc
    import weakref

    marker = tmp_path / "finalized"
    gc.disable()  # the cycle must still be garbage in the parent's heap when the ranks fork
    try:
        ref = weakref.ref(_Finalized(str(marker)))
        assert launch(_collect, world_size=2, start_method="fork", init_group=False) == [True, True]
        assert ref() is not None  # the parent has not collected it: each rank held it as garbage
    finally:
        gc.enable()
    gc.collect()
    assert marker.read_text().split() == [str(os.getpid())]  # finalized once, by the parent, never by a rank
