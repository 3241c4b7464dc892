"""Bounded input (issue 49, B3 and B7): every argument a probe found raw, failing only in the ranks or silently
accepted is refused by name, on one line, before any process starts; so are more ranks or threads than this
machine can run (ranks/checks.py)."""
from __future__ import annotations

import math
import multiprocessing.forkserver
import multiprocessing.process
import subprocess

import pytest

from ddp_helpers import ConfigError, TrainConfig, launch, run_training
from ddp_helpers.cli import train as cli_train
from ddp_helpers.cli.train import main
from ddp_helpers.data import DataError
from ddp_helpers.ranks import checks, cores


def _ok(rank, world_size):
    return rank


@pytest.fixture
def no_process(monkeypatch):
    """Any process start fails the test: a refusal must come before."""
    def started(*a, **k):
        raise AssertionError("a process was started before the refusal")
    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", started)
    monkeypatch.setattr(subprocess.Popen, "__init__", started)
    monkeypatch.setattr(multiprocessing.forkserver, "ensure_running", started)


API_CASES = [
    ("world_size", {"world_size": 10**6}), ("poll_s", {"poll_s": math.nan}), ("poll_s", {"poll_s": -1}),
    ("on_poll", {"on_poll": 42}), ("port", {"port": -1}), ("port", {"port": 70000}), ("port", {"port": "x"}),
    ("run_dir", {"run_dir": __file__}), ("fn", {"fn": None}), ("fn", {"fn": lambda: 0}), ("args", {"args": 5}),
    ("args", {"args": None}), ("threads_per_rank", {"threads_per_rank": -2}),
    ("threads_per_rank", {"threads_per_rank": 2.5}), ("threads_per_rank", {"threads_per_rank": 0}),
    ("threads_per_rank", {"threads_per_rank": 100000}), ("backend", {"backend": "mpi"}),
    ("backend", {"backend": ""}), ("init_group", {"init_group": "yes"}), ("bind_cores", {"bind_cores": "yes"}),
    ("watch_shared", {"watch_shared": 1}), ("host", {"host": "a\nb"}), ("start_method", {"start_method": 5}),
]


def _case_id(value: object) -> str:
    """A test id that is the same in every process (xdist's workers compare them): no object addresses."""
    return getattr(value, "__name__", None) or repr(value)


@pytest.mark.parametrize("name,kwargs", API_CASES, ids=[f"{n}={_case_id(v)}" for n, kw in API_CASES for v in kw.values()])
def test_launch_refuses_by_name_before_any_process(no_process, name, kwargs):
    kwargs = {"fn": _ok, "world_size": 2, "start_method": "fork", **kwargs}
    with pytest.raises(ConfigError) as e:
        launch(**kwargs)
    message = str(e.value)
    assert f"{name}=" in message and "\n" not in message, message


TRAINING_CASES = [
    ("progress", {"progress": "yes"}), ("seed", {"seed": 2**64}), ("world_size", {"world_size": 100000}),
    ("threads_per_rank", {"threads_per_rank": 100000}), ("on_progress", {"on_progress": 3}),
    ("data_root", {"data_root": "no\nsuch"}), ("cfg", {"cfg": {"world_size": 2}}), ("nosuch", {"nosuch": 1}),
]


@pytest.mark.parametrize("name,kwargs", TRAINING_CASES, ids=[n for n, _ in TRAINING_CASES])
def test_run_training_refuses_by_name_before_any_process(no_process, name, kwargs):
    with pytest.raises((ConfigError, DataError)) as e:  # data_root: a folder without MNIST, said on one line
        run_training(**kwargs)
    assert name in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_train_config_is_keyword_only():
    with pytest.raises(ConfigError, match=r"TrainConfig\(1, 2, 3\) is not accepted: settings are given by name"):
        TrainConfig(1, 2, 3)
    assert TrainConfig(world_size=3).world_size == 3


CLI_CASES = [
    ("--world-size", ["--world-size", "100000"]), ("--seed", ["--seed", "18446744073709551616"]),
    ("--threads-per-rank", ["--threads-per-rank", "100000"]), ("--data-root", ["--data-root", "a\nb"]),
    ("--master-addr", ["--master-addr", "x\ny"]),
]


@pytest.mark.parametrize("flag,argv", CLI_CASES, ids=[f for f, _ in CLI_CASES])
def test_command_line_refuses_on_one_line_before_any_process(no_process, monkeypatch, tmp_path, capsys, flag, argv):
    if flag in ("--data-root", "--master-addr"):  # checked with the data and the machine, after the CLI's
        monkeypatch.setattr(cli_train, "_start_forkserver_early", lambda method: None)  # early forkserver
    assert main(argv + ["--out", str(tmp_path / "out"), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and flag in err, err


def _machine(n_cores: int) -> cores.MachineRoom:
    """A machine with n_cores usable cores and no process limit."""
    return cores.MachineRoom(tuple(range(n_cores)), n_cores, ())


def test_the_limit_names_the_stated_maximum():
    """On a machine with many cores the stated maximum binds, and is named."""
    with pytest.raises(ConfigError, match=rf"at most {checks.MAX_WORLD_SIZE} ranks.*MAX_WORLD_SIZE"):
        checks.check_world_size(checks.MAX_WORLD_SIZE + 1, None, _machine(1024), owner="x()")
    checks.check_world_size(checks.MAX_WORLD_SIZE, None, _machine(1024), owner="x()")


def test_ranks_per_core_bound_allows_the_lessons_oversubscription():
    """The lessons run 4 ranks on 2 cores (and on a 1-core VM): allowed; more than MAX_RANKS_PER_CORE are not."""
    checks.check_world_size(4, None, _machine(1), owner="x()")
    with pytest.raises(ConfigError, match=r"x\(world_size=9\) is not accepted: at most 8 ranks.*MAX_RANKS_PER_CORE"):
        checks.check_world_size(checks.MAX_RANKS_PER_CORE + 1, None, _machine(1), owner="x()")


def test_process_limit_is_named(monkeypatch, no_process):
    """A cgroup allowing 20 more tasks refuses 4 ranks (each needs its threads and TASKS_PER_RANK more)."""
    monkeypatch.setattr(cores, "room_limits", lambda: [(20, "/sys/fs/cgroup/x/pids.max=1500, 1460 in use")])
    with pytest.raises(ConfigError, match=r"launch\(world_size=4\) is not accepted: 4 ranks need about \d+ .*"
                                          r"only 20 more may start here \(/sys/fs/cgroup/x/pids.max=1500"):
        launch(_ok, 4, start_method="fork", threads_per_rank=1)


def test_cgroup_pids_room_reads_v2_and_v1(tmp_path):
    """pids.max on the process's cgroup and its parents, the tightest room wins; 'max' is no limit."""
    v2 = tmp_path / "v2"
    (v2 / "user" / "job").mkdir(parents=True)
    (v2 / "pids.max").write_text("max\n")
    (v2 / "user" / "pids.max").write_text("1500\n")
    (v2 / "user" / "pids.current").write_text("1400\n")
    (v2 / "user" / "job" / "pids.max").write_text("1000\n")
    (v2 / "user" / "job" / "pids.current").write_text("10\n")
    cg = tmp_path / "cgroup"
    cg.write_text("0::/user/job\n")
    room, what = cores.cgroup_pids_room(str(cg), str(v2))
    assert room == 100 and "user/pids.max=1500" in what
    v1 = tmp_path / "v1"
    (v1 / "pids" / "a").mkdir(parents=True)
    (v1 / "pids" / "a" / "pids.max").write_text("50\n")
    cg.write_text("4:pids:/a\n3:cpu,cpuacct:/a\n")
    assert cores.cgroup_pids_room(str(cg), str(v1))[0] == 50
    cg.write_text("0::/none\n")
    assert cores.cgroup_pids_room(str(cg), str(tmp_path / "empty")) is None


def test_under_torchrun_the_running_ranks_are_not_counted_again(monkeypatch):
    """A torchrun rank checks its settings while its node's ranks already run: only the launcher checks room."""
    from ddp_helpers.engine.config import check_before_torch
    from ddp_helpers.ranks.env import under_torchrun

    monkeypatch.setattr(cores, "room_limits", lambda: [(0, "pids.max=40, 40 in use")])
    with pytest.raises(ConfigError, match=r"only 0 more may start here"):
        check_before_torch(TrainConfig(world_size=2), 2)
    for name, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "x", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    assert under_torchrun()
    check_before_torch(TrainConfig(world_size=2), 2)
