"""Each value checked once, where it is made (issue 60): a TrainConfig refuses a bad field when it is built, and
run_training, launch() and the command line make each check of the machine once, before any process starts."""
from __future__ import annotations

import ast
import collections
import dataclasses
import pathlib
import pickle

import pytest

from ddp_helpers import ConfigError, TrainConfig
from ddp_helpers.cli.from_env import TrainTask

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "ddp_helpers"


# ------------------------------------------------------------------ TrainConfig checks itself when it is made
@pytest.mark.parametrize("kwargs, said", [
    ({"world_size": -1}, "TrainConfig.world_size=-1 is not accepted: an int >= 1, e.g. world_size=2"),
    ({"world_size": 2.0}, "TrainConfig.world_size=2.0 is not accepted: an int >= 1"),
    ({"lr": 0}, "TrainConfig.lr=0 is not accepted: a finite number with 0 < lr <= 10"),
    ({"backend": "mpi"}, "TrainConfig.backend='mpi' is not accepted: one of ('auto', 'gloo', 'nccl')"),
    ({"capture_grad_steps": [0]}, "TrainConfig.capture_grad_steps=[0] is not accepted: a tuple of step numbers"),
    ({"checkpoint_every": 5}, "TrainConfig.checkpoint_every=5 is not accepted: needs checkpoint_dir set as well"),
    ({"resume_from": "latest"}, "TrainConfig.resume_from='latest' is not accepted: 'latest' is the newest ckpt-*.pt "
                                "in checkpoint_dir"),
    ({"world_size": 2, "fault_rank": 2}, "TrainConfig.fault_rank=2 is not accepted: None or a rank from 0 to 1"),
], ids=["world_size=-1", "world_size=2.0", "lr=0", "backend", "capture_grad_steps", "needs-checkpoint_dir",
        "latest-needs-checkpoint_dir", "fault_rank"])
def test_a_bad_field_is_refused_when_the_config_is_made(kwargs, said):
    with pytest.raises(ConfigError) as e:
        TrainConfig(**kwargs)
    assert str(e.value).startswith(said), str(e.value)
    assert e.value.field == said.split(".")[1].split("=")[0]  # the setting, apart from the words


def test_replace_and_from_dict_make_a_checked_config_too():
    cfg = TrainConfig(world_size=2)
    for make in (lambda: cfg.replace(world_size=-1), lambda: dataclasses.replace(cfg, world_size=-1),
                 lambda: TrainConfig.from_dict({**cfg.to_dict(), "world_size": -1})):
        with pytest.raises(ConfigError, match=r"TrainConfig\.world_size=-1 is not accepted"):
            make()
    with pytest.raises(ConfigError, match=r"TrainConfig\.fault_rank=1 is not accepted: None or a rank from 0 to 0"):
        TrainConfig(world_size=2, fault_rank=1).replace(world_size=1)  # the rule between two settings too


def test_a_checked_config_travels_to_ranks_and_to_submitit_unchanged():
    """Pickling (the ranks' payload, submitit's TrainTask) makes no new values: nothing is checked again, and a
    config comes back equal."""
    cfg = TrainConfig(world_size=3, checkpoint_dir="/tmp/ck", checkpoint_every=5)
    assert pickle.loads(pickle.dumps(cfg)) == cfg
    task = pickle.loads(pickle.dumps(TrainTask(cfg, "out")))
    assert task.cfg == cfg
    assert task.cfg.replace(resume_from="latest").resume_from == "latest"  # what TrainTask.checkpoint requeues


def test_the_command_line_says_a_refused_field_as_its_flag(tmp_path, capsys):
    from ddp_helpers.cli.train import main

    assert main(["--world-size", "-1", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --world-size -1 is not accepted: an int >= 1") and err.count("\n") == 1, err


# ------------------------------------------------------------------ each machine check once on each path
COUNTED = {"ddp_helpers.ranks.checks": ["check_world_size", "resolve_backend", "check_binding", "check_address",
                                        "check_start_method"],
           "ddp_helpers.engine.config": ["check_resume_path", "check_writable_dir", "check_types"]}


class _Stop(Exception):
    pass


@pytest.fixture
def counted(monkeypatch):
    """Calls of every check of a run's values (checks.py's of the machine, config.py's of the paths)."""
    import importlib

    calls = collections.Counter()
    for module_name, names in COUNTED.items():
        module = importlib.import_module(module_name)
        for name in names:
            real = getattr(module, name)

            def counting(*args, _real=real, _name=name, **kwargs):
                calls[_name] += 1
                return _real(*args, **kwargs)
            monkeypatch.setattr(module, name, counting)
    return calls


def _stop_at_the_start(monkeypatch):
    from ddp_helpers.ranks import launcher

    def stop(*args, **kwargs):
        raise _Stop
    monkeypatch.setattr(launcher, "_launch", stop)  # every check made, the data loaded: no rank starts


def test_run_training_checks_each_value_once(counted, monkeypatch, tmp_path):
    from ddp_helpers import run_training

    _stop_at_the_start(monkeypatch)
    cfg = TrainConfig(dataset="mnist-5k", checkpoint_dir=str(tmp_path / "ck"), threads_per_rank=1)
    counted.clear()  # the config's own check, made above
    with pytest.raises(_Stop):
        run_training(cfg, progress=False, start_method="fork")
    assert counted == {"check_world_size": 1, "resolve_backend": 1, "check_binding": 1, "check_address": 1,
                       "check_start_method": 1, "check_resume_path": 1, "check_writable_dir": 1}


def test_the_command_line_checks_each_value_once(counted, monkeypatch, tmp_path):
    """The checks it makes before torch loads are handed on to run_training, not made again."""
    from ddp_helpers.cli.train import main

    _stop_at_the_start(monkeypatch)
    with pytest.raises(_Stop):
        main(["--dataset", "mnist-5k", "--checkpoint-dir", str(tmp_path / "ck"), "--threads-per-rank", "1",
              "--start-method", "fork", "--no-plots", "--out", str(tmp_path / "out")])
    assert counted == {"check_types": 1, "check_world_size": 1, "resolve_backend": 1, "check_binding": 1,
                       "check_address": 1, "check_start_method": 1, "check_resume_path": 1,
                       "check_writable_dir": 1}


def test_launch_checks_each_argument_once(counted, monkeypatch):
    from ddp_helpers import launch

    _stop_at_the_start(monkeypatch)
    with pytest.raises(_Stop):
        launch(print, 2, start_method="fork", threads_per_rank=1, watch_shared=False)
    assert counted == {"check_world_size": 1, "resolve_backend": 1, "check_binding": 1, "check_address": 1,
                       "check_start_method": 1}


def test_a_launch_reads_the_machine_once(monkeypatch):
    """The cores, the CPU quota and the process limits are read once (cores.machine_room), and every check of the
    launch judges that one reading: the world size, the default threads, the core binding."""
    from ddp_helpers import launch
    from ddp_helpers.ranks import cores

    reads = collections.Counter()
    for name in ("usable_cores", "cpu_quota", "room_limits"):
        def reading(*args, _real=getattr(cores, name), _name=name, **kwargs):
            reads[_name] += 1
            return _real(*args, **kwargs)
        monkeypatch.setattr(cores, name, reading)
    _stop_at_the_start(monkeypatch)
    with pytest.raises(_Stop):
        launch(print, 2, start_method="fork", watch_shared=False)
    assert reads == {"usable_cores": 1, "cpu_quota": 1, "room_limits": 1}


# ------------------------------------------------------------------ each rule has one checker
def _calls(name: str) -> list:
    """Where the package calls a function of this name (by name or as an attribute)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == name:
                found.append(f"{path.relative_to(PACKAGE)}")
    return found


@pytest.mark.parametrize("name, where", [
    ("check_world_size", "ranks/checks.py"), ("resolve_backend", "ranks/checks.py"),
    ("check_binding", "ranks/checks.py"), ("check_address", "ranks/checks.py"),
    ("check_start_method", "ranks/checks.py"), ("check_types", "engine/config.py"),
    ("check_before_torch", None), ("cgroup_limits", "ranks/cores.py"),
])
def test_each_rule_is_called_from_one_checker(name, where):
    """launch() and run_training share LaunchPlan.checked; a rule of the machine is applied in one place."""
    calls = _calls(name)
    if where is None:  # run_training's (in plan_launch), the command line's and a torchrun rank's: once a path
        assert sorted(calls) == ["cli/torchrun.py", "cli/train.py", "engine/config.py"], calls
    else:
        assert set(calls) == {where}, calls


@pytest.mark.parametrize("words", [
    "ranks per usable core", "nccl needs CUDA GPUs and none is visible", "None (bind when possible) or False here",
    "a resolvable host such as", "is not available on", "check_readable_file(\"resume_from\"",
    "check_writable_dir(\"checkpoint_dir\"", "processes and threads, and only", "bytes of telemetry",
])
def test_a_refusal_is_written_in_one_module(words):
    holding = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if words in p.read_text()]
    assert len(holding) == 1, holding
