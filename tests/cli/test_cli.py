"""Result files, the command line (spawn) and the same module under torchrun."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

from ddp_helpers import TrainResult

ENV = {**os.environ, "DDP_HELPERS_PROGRESS": "0"}


def test_save_load_round_trip(small_run, tmp_path):
    path = small_run.save(str(tmp_path / "r.json"))
    text = open(path).read()
    json.loads(text)  # strict JSON: no NaN tokens, no pickle
    back = TrainResult.load(path)
    assert back.config == small_run.config and back.dataset == small_run.dataset
    assert back.test_accuracy == small_run.test_accuracy
    for a, b in zip(small_run.ranks, back.ranks):
        for field in ("step", "loss", "local_grad_norm", "synced_grad_norm", "sample_indices", "step_time_s"):
            assert np.array_equal(getattr(a, field), getattr(b, field)), field
        assert a.param_fingerprint == b.param_fingerprint and a.samples_hash == b.samples_hash
    assert np.array_equal(back.final_params, small_run.final_params)
    assert len(back.peak_cuda_mb) == 2 and all(np.isnan(back.peak_cuda_mb))  # gloo on CPU: no GPU memory, saved as null
    assert back.peak_rss_mb == small_run.peak_rss_mb and back.bytes_allreduced == small_run.bytes_allreduced
    assert sorted(back.captured_grads) == sorted(small_run.captured_grads)
    assert np.array_equal(back.captured_grads[3]["local"], small_run.captured_grads[3]["local"])
    assert back.records()[5] == small_run.records()[5]


def test_load_rejects_other_files(tmp_path):
    p = tmp_path / "x.json"
    p.write_text('{"format": "something else"}')
    with pytest.raises(ValueError, match="not a ddp_helpers.TrainResult"):
        TrainResult.load(str(p))


def _cli(args, cwd, **kw):
    return subprocess.run([sys.executable, "-m", "ddp_helpers.train", *args], cwd=cwd, env=ENV,
                          capture_output=True, text=True, timeout=180, **kw)


def test_cli_end_to_end(tmp_path, small_run, capsys):
    """In this process, its ranks forked (a real command line's run: notebook 06, and the tests that run two at
    once or fill the disk): the summary, result.json and the three plots, and the run itself."""
    from ddp_helpers.cli.train import main

    out = tmp_path / "run"
    assert main(["--dataset", "mnist-5k", "--max-steps", "8", "--threads-per-rank", "1", "--start-method", "fork",
                 "--out", str(out)]) == 0
    assert "parameters identical on all ranks after every step: True" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["fingerprints.png", "grad_norms.png", "loss.png", "result.json"]
    for png in ("loss.png", "grad_norms.png", "fingerprints.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    res = TrainResult.load(str(out / "result.json"))
    assert res.ranks[0].param_fingerprint == small_run.ranks[0].param_fingerprint  # same config, same run


@pytest.mark.parametrize("flags", [["--batch-size", "0"], ["--lr", "-1"], ["--epochs", "0"]])
def test_a_bad_flag_value_is_said_before_torch_is_imported(flags, tmp_path):
    """A typo costs a tenth of a second, not the ~2 s of importing torch (and its data) first."""
    code = ("import sys; from ddp_helpers.cli.train import main; code = main(sys.argv[1:]); "
            "print(code, 'torch' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code, *flags, "--out", str(tmp_path / "x")], capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)
    assert p.stdout.split() == ["2", "False"], (p.stdout, p.stderr)
    assert p.stderr.startswith(f"error: {flags[0]} ") and "is not accepted" in p.stderr, p.stderr


@pytest.mark.parametrize("flags, said", [
    (["--out", "{tmp}/file"], "--out '{tmp}/file' is an existing file, not a folder"),
    (["--resume-from", "{tmp}"], "--resume-from {tmp} is not accepted: it is a directory"),
    (["--resume-from", "{tmp}/nope.pt"], "--resume-from {tmp}/nope.pt is not accepted: an existing checkpoint file"),
    (["--checkpoint-dir", "{tmp}/file/ck"], "--checkpoint-dir {tmp}/file/ck is not accepted: a directory this user "
                                            "can write ('{tmp}/file' is a file"),
], ids=["out-is-a-file", "resume-from-a-folder", "resume-from-nothing", "checkpoint-dir-under-a-file"])
def test_a_bad_path_is_said_before_any_process_starts(flags, said, tmp_path):
    """A path that can't work is refused before the forkserver starts (it would import torch for nothing)."""
    (tmp_path / "file").write_text("x")
    code = ("import sys, psutil; from ddp_helpers.cli.train import main; code = main(sys.argv[1:]); "
            "print(code, 'torch' in sys.modules, len(psutil.Process().children()))")
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    out = [] if "--out" in flags else ["--out", str(tmp_path / "out")]
    p = subprocess.run([sys.executable, "-c", code, "--dataset", "mnist-5k", *flags, *out], capture_output=True,
                       text=True, timeout=60, cwd=tmp_path)
    assert p.stdout.split() == ["2", "False", "0"], (p.stdout, p.stderr)  # exit 2, no torch, no process started
    assert p.stderr.startswith("error: " + said.replace("{tmp}", str(tmp_path))), p.stderr
    assert p.stderr.count("\n") == 1, p.stderr


# ------------------------------------------------------------------ errors in the words of the command line
FIELD_WORDS = re.compile(r"TrainConfig|\b[a-z]+(?:_[a-z]+)*=")  # a field (resume_from=None) instead of a flag


@pytest.mark.parametrize("flags, expected", [
    (["--checkpoint-every", "5"], "error: --checkpoint-every 5 is not accepted: needs --checkpoint-dir set as well"),
    (["--backend", "mpi"], "error: --backend mpi is not accepted: one of"),
    (["--resume-from", "{tmp}/nope.pt"], "error: --resume-from {tmp}/nope.pt is not accepted: an existing checkpoint "
                                         "file (ckpt-*.pt written by a run); '{tmp}/nope.pt' doesn't exist"),
    (["--resume-from", "{tmp}"], "error: --resume-from {tmp} is not accepted: it is a directory, not a checkpoint "
                                 "file; give one of its ckpt-*.pt files, e.g. the latest '{tmp}/ckpt-0000012.pt'"),
    (["--resume-from", "{tmp}/ckpt-0000012.pt", "--max-steps", "12"],
     "error: --resume-from {tmp}/ckpt-0000012.pt is not accepted with --max-steps 12, --epochs 1: the checkpoint is "
     "at step 12"),
    (["--dataset", "fashion-mnist", "--data-root", "{tmp}/fashon"], "error: --data-root {tmp}/fashon is not accepted: "
                                                                    "the folder {tmp}/fashon doesn't exist"),
], ids=["needs-another-flag", "choice", "missing-checkpoint", "directory-as-checkpoint", "past-the-end", "data-root"])
def test_cli_errors_name_flags_not_fields(flags, expected, tmp_path, capsys):
    """The checks speak TrainConfig (right in a notebook); the CLI says which flag to change, in one place."""
    from ddp_helpers.engine.checkpoint import save_checkpoint
    from ddp_helpers.engine.model import build_model
    from ddp_helpers.cli.train import main

    import torch

    model = build_model(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    save_checkpoint(str(tmp_path), 12, model.state_dict(), optimizer.state_dict(),
                    {"dataset": "mnist-5k", "world_size": 2, "batch_size": 64, "seed": 0})
    flags = [f.replace("{tmp}", str(tmp_path)) for f in flags]
    assert main(["--dataset", "mnist-5k", *flags, "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(expected.replace("{tmp}", str(tmp_path))), err
    assert not FIELD_WORDS.search(err) and err.count("\n") == 1, err


@pytest.mark.slow
def test_cli_errors_name_flags_in_a_real_process(tmp_path):
    p = _cli(["--dataset", "mnist-5k", "--resume-from", str(tmp_path), "--out", str(tmp_path / "o")], tmp_path)
    assert p.returncode == 2 and p.stdout == "", p.stderr
    assert p.stderr == (f"error: --resume-from {tmp_path} is not accepted: it is a directory, not a checkpoint file; "
                        "it holds no ckpt-*.pt: give a checkpoint file that a run with --checkpoint-dir wrote\n")


def _marked_error():
    from ddp_helpers.common.errors import refused, setting

    return refused("resume_from", "/a b/c.pt", f"x; with {setting('max_steps', None)}, {setting('world_size')}<=2, "
                   f"{setting('bind_cores', None)}, {setting('capture_grad_steps', (0, -1))}; "
                   f"{setting('dataset', 'mnist-5k', lead='set ')} {setting('backend', 'gloo', lead='or ')}; "
                   f"{setting('resume_from', None, lead='set ')} {setting('resume_from', None, lead='or ')}; "
                   f"{setting('start_method', 'fork')}, {setting('port', 0, owner='launch()')}; files in "
                   "/tmp/data_root/batch_size and download=True")


def test_an_error_names_its_settings_in_python_and_as_flags():
    """One marked message, two words: Python's (str) in a notebook, the flags' on the command line."""
    from ddp_helpers.cli.words import for_flags

    error = _marked_error()
    assert (error.field, error.value) == ("resume_from", "/a b/c.pt")
    assert error.accepted.startswith("x; with max_steps=None, world_size<=2") and error.accepted in str(error)
    assert str(error) == (
        "TrainConfig.resume_from='/a b/c.pt' is not accepted: x; with max_steps=None, world_size<=2, bind_cores=None, "
        "capture_grad_steps=(0, -1); set dataset='mnist-5k' or backend='gloo'; set resume_from=None or "
        "resume_from=None; start_method='fork', launch(port=0); files in /tmp/data_root/batch_size and download=True")
    assert for_flags(error) == (
        "--resume-from '/a b/c.pt' is not accepted: x; with no --max-steps, --world-size<=2, --bind-cores auto, "
        "--capture-grad-steps 0 -1; use --dataset mnist-5k or --backend gloo; leave out --resume-from or leave out "
        "--resume-from; --start-method fork, launch(port=0); files in /tmp/data_root/batch_size and download=True")


def test_a_marked_value_stays_one_line_and_unmarked_errors_pass_through():
    from ddp_helpers.cli.words import for_flags
    from ddp_helpers.common.errors import ConfigError, refused

    error = refused("data_root", "a\nb", "a folder")  # a value's newline is shown escaped, in both words
    assert "\n" not in str(error) and "\n" not in for_flags(error)
    assert for_flags(error).startswith("--data-root ") and for_flags(ValueError("plain\ntext")) == "plain\\ntext"
    assert for_flags(ConfigError("no setting here")) == "no setting here"


def test_cli_failure_keeps_partial_metrics(tmp_path, capsys):
    """In this process (a real torchrun job's failure: test_a_failed_torchrun_job_keeps_every_ranks_rows)."""
    from ddp_helpers.cli.train import main

    out = tmp_path / "run"
    code = main(["--dataset", "mnist-5k", "--max-steps", "8", "--fault-rank", "1", "--fault-step", "4",
                 "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("error: rank 1 failed: InjectedFault: ") and "partial_result.json" in err, err
    partial = TrainResult.load(str(out / "partial_result.json"))
    assert not partial.complete and partial.n_steps == 4


@pytest.mark.skipif(shutil.which("torchrun", path=os.path.dirname(sys.executable)) is None,
                    reason="torchrun not installed next to this Python")
@pytest.mark.slow
def test_a_failed_torchrun_job_keeps_every_ranks_rows(tmp_path):
    """Rank 1 is killed (no code of its own runs) and the agent stops rank 0: rank 0's rows and rank 1's, both
    in their files already, reach partial_result.json, which also names the rank that failed."""
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "ddp_helpers.train", "--dataset", "mnist-5k", "--max-steps", "12",
                        "--threads-per-rank", "1", "--no-plots", "--fault-rank", "1", "--fault-step", "7",
                        "--fault-kind", "kill", "--out", str(out)], cwd=tmp_path, env=ENV, capture_output=True,
                       text=True, timeout=240)
    assert p.returncode != 0
    partial = TrainResult.load(str(out / "partial_result.json"))
    assert [list(r.step) for r in partial.ranks] == [list(range(7))] * 2, p.stderr[-3000:]
    assert len(set(partial.ranks[0].param_fingerprint) & set(partial.ranks[1].param_fingerprint)) == 7
    assert any("failed: rank 1: reported nothing" in n for n in partial.notes), partial.notes


@pytest.mark.parametrize("text, expected", [("false", False), ("true", True), ("auto", None), ("off", False)])
def test_cli_bind_cores_flag_accepts_auto(text, expected):
    from ddp_helpers.cli.train import build_parser, config_from_args

    assert config_from_args(build_parser().parse_args(["--bind-cores", text])).bind_cores is expected


def test_cli_plain_bool_flag_refuses_auto(capsys):
    from ddp_helpers.cli.train import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["--telemetry", "auto"])  # telemetry has no automatic setting
    assert "--telemetry" in capsys.readouterr().err


def test_default_threads_follow_the_usable_cores(monkeypatch):
    import ddp_helpers.ranks.checks as C
    import ddp_helpers.ranks.cores as P

    monkeypatch.setattr(P, "usable_cores", lambda: [4, 5, 6, 7, 8, 9])  # e.g. taskset -c 4-9
    monkeypatch.setattr(P, "cpu_quota", lambda: None)
    assert C.default_threads(2) == 3 and C.default_threads(4) == 1 and C.default_threads(8) == 1


# ------------------------------------------------------------------ an explicit data root never falls back
def _mnist_downloadable() -> bool:
    from _torchvision import torchvision_loads

    if not torchvision_loads():
        return False  # nothing downloads MNIST then: the package refuses the folder all the same
    from torchvision import datasets

    from ddp_helpers.data import sources

    return sources._mirrors_reachable(datasets.MNIST.mirrors)


def _check_explicit_root_refusal(root, tmp_path, code: int, out: str, err: str) -> None:
    assert code == 2 and out == "", (code, out, err)
    assert err.startswith(f"error: --data-root {root} holds no MNIST: {root / 'MNIST' / 'raw'} lacks "), err
    assert "use --dataset mnist-5k" in err and f"write-mnist {root}" in err, err
    assert err.count("\n") == 1 and "Traceback" not in err and "[ddp_helpers]" not in err, err
    assert not list(tmp_path.glob("ddp_helpers-ranks-*")), "refused before any rank started"
    assert not (tmp_path / "out" / "result.json").exists()


@pytest.mark.parametrize("folder", ["missing", "empty"])
def test_cli_explicit_data_root_without_mnist_is_exit_2(folder, tmp_path, monkeypatch, capfd, recwarn):
    """`--data-root ~/data/MNIST_dta` (a typo, or an empty folder: no MNIST there) is an error, not 4,000 other
    digits and exit 0. In this process: capfd reads file descriptor 2, so torch's and torchvision's own writes
    there count, and recwarn the Python warnings a real process would print."""
    import tempfile

    from ddp_helpers.cli.train import main

    if _mnist_downloadable():
        pytest.skip("a MNIST mirror is reachable: the folder would be filled by a download")
    root = tmp_path / "MNIST_dta"
    if folder == "empty":
        root.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the ranks' log folders would appear here if any rank started
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    code = main(["--dataset", "mnist", "--data-root", str(root), "--max-steps", "5", "--start-method", "fork",
                 "--out", str(tmp_path / "out")])
    captured = capfd.readouterr()
    _check_explicit_root_refusal(root, tmp_path, code, captured.out, captured.err)
    assert not _printed_warnings(recwarn), _printed_warnings(recwarn)


def _printed_warnings(recwarn) -> list:
    """The warnings Python's default filters would print in a real process (not Deprecation, Import, Resource)."""
    quiet = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)
    return [f"{w.category.__name__}: {w.message}" for w in recwarn if not issubclass(w.category, quiet)]


class _Started(Exception):
    pass


@pytest.mark.parametrize("flags, under_torchrun, warmed", [
    ([], False, True), (["--start-method", "forkserver"], False, True), (["--start-method", "spawn"], False, False),
    (["--start-method", "fork"], False, False), ([], True, False),
])
def test_cli_starts_the_forkserver_after_its_checks_and_before_its_own_imports(monkeypatch, tmp_path, flags,
                                                                                under_torchrun, warmed):
    """The command line's ranks come from the forkserver unless spawn, fork or torchrun start them. It checks
    what needs no torch first (flags, paths, the room in --out: a refusal starts nothing), then starts the server,
    so that the server imports torch while the command line does (3.2 s instead of 4.4 s for 8 steps, measured
    with a free core), then trains."""
    import ddp_helpers.engine.runner
    import ddp_helpers.ranks.env
    import ddp_helpers.cli.torchrun
    import ddp_helpers.cli.train
    import ddp_helpers.ranks.startmethod
    from ddp_helpers.cli.train import main

    steps = []

    def warm_up():
        steps.append("server")
        raise _Started  # ends main() here: what follows would train

    def train(*args, **kwargs):
        steps.append("train")
        raise _Started  # main's next step without the server

    monkeypatch.setattr(ddp_helpers.ranks.startmethod, "warm_up", warm_up)
    monkeypatch.setattr(ddp_helpers.ranks.env, "under_torchrun", lambda *environ: under_torchrun)
    monkeypatch.setenv("RANK", "0")  # torchrun's rank 0 checks --out; read only under torchrun
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(ddp_helpers.cli.train, "_check_room", lambda *a: steps.append("room"))
    monkeypatch.setattr(ddp_helpers.engine.runner, "run_checked", train)
    monkeypatch.setattr(ddp_helpers.cli.torchrun, "run_torchrun", train)
    with pytest.raises(_Started):
        main(["--dataset", "mnist-5k", "--max-steps", "2", *flags, "--out", str(tmp_path / "out")])
    assert steps == (["room", "server"] if warmed else ["room", "train"])


def _as_srun_task(monkeypatch, **slurm) -> None:
    """This process as a task of srun (ranks/env.py), torchrun's variables absent and restored afterwards
    (the command line sets them in os.environ itself)."""
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(k, "")
        monkeypatch.delenv(k)
    for k, v in slurm.items():
        monkeypatch.setenv(k, v)


def test_cli_as_a_task_of_srun_is_one_rank_of_the_job(monkeypatch, tmp_path):
    """srun -N2 python -m ddp_helpers.train: each task is a rank of one job (run_torchrun's path, torchrun's
    variables from SLURM's), not the launcher of a job of its own."""
    import ddp_helpers.cli.torchrun
    import ddp_helpers.engine.runner
    from ddp_helpers.cli.train import main
    from ddp_helpers.ranks.env import rendezvous_port

    seen = {}

    def rank(cfg, out, plots, sizes):
        seen.update({k: os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                                                 "MASTER_ADDR", "MASTER_PORT")})
        raise _Started

    def launch(*args, **kwargs):
        seen["launched"] = True
        raise _Started

    monkeypatch.setattr(ddp_helpers.cli.torchrun, "run_torchrun", rank)
    monkeypatch.setattr(ddp_helpers.engine.runner, "run_checked", launch)
    _as_srun_task(monkeypatch, SLURM_JOB_ID="77", SLURM_STEP_ID="0", SLURM_PROCID="1", SLURM_LOCALID="0",
                  SLURM_NODEID="1", SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NODELIST="node[3-4]",
                  SLURM_STEP_TASKS_PER_NODE="1(x2)")
    with pytest.raises(_Started):
        main(["--dataset", "mnist-5k", "--max-steps", "2", "--no-plots", "--out", str(tmp_path / "out")])
    assert seen == {"RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "1",
                    "MASTER_ADDR": "node3", "MASTER_PORT": str(rendezvous_port("77"))}


def test_cli_names_an_unreadable_slurm_variable(monkeypatch, tmp_path, capfd):
    from ddp_helpers.cli.train import main

    _as_srun_task(monkeypatch, SLURM_JOB_ID="77", SLURM_STEP_ID="0", SLURM_PROCID="1", SLURM_STEP_NUM_TASKS="2",
                  SLURM_STEP_NODELIST="node[3-")
    assert main(["--dataset", "mnist-5k", "--out", str(tmp_path / "out")]) == 2
    assert "SLURM host list 'node[3-'" in capfd.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("flags, backend_set", [([], True), (["--no-plots"], False)])
def test_cli_sets_up_matplotlib_only_when_it_draws(monkeypatch, tmp_path, flags, backend_set):
    """--no-plots draws nothing, so the command line doesn't import matplotlib for it (~0.3 s of a start-up)."""
    import matplotlib

    import ddp_helpers.engine.runner
    import ddp_helpers.ranks.startmethod
    from ddp_helpers.cli.train import main

    backends = []

    def train(*args, **kwargs):
        raise _Started

    monkeypatch.setattr(matplotlib, "use", backends.append)
    monkeypatch.setattr(ddp_helpers.ranks.startmethod, "warm_up", lambda: None)
    monkeypatch.setattr(ddp_helpers.engine.runner, "run_checked", train)
    with pytest.raises(_Started):
        main(["--dataset", "mnist-5k", "--max-steps", "2", *flags, "--out", str(tmp_path / "out")])
    assert backends == (["Agg"] if backend_set else [])


def test_cli_error_line_is_one_write(monkeypatch, tmp_path):
    """Under torchrun every rank and the agent write to the same stderr: a line written in two parts (print's
    text, then its newline) can get another process's log line in between (seen in the torchrun test)."""
    from ddp_helpers.cli.train import main

    writes = []

    class Recorder:
        def write(self, text):
            writes.append(text)
            return len(text)

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stderr", Recorder())
    assert main(["--batch-size", "0", "--out", str(tmp_path / "x")]) == 2
    assert len(writes) == 1 and writes[0].startswith("error: --batch-size") and writes[0].endswith("\n"), writes
    assert writes[0].count("\n") == 1, writes
