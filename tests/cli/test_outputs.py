"""--out on a disk that is full, or fills during training: refused before the work, or the result kept elsewhere.

The real cases use a small tmpfs (root, as CI is); they skip where mounting is refused. The monkeypatched ones
run everywhere and cover the same code paths. The refusals run in a fresh interpreter, to show that nothing was
started and torch not imported; a disk filling during training runs main() in the test's process.
"""
from __future__ import annotations

import errno
import glob
import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from ddp_helpers import TrainResult
from ddp_helpers.cli.outputs import KEPT_PREFIX, OutputError, estimate_bytes

ENV = {**os.environ, "DDP_HELPERS_PROGRESS": "0"}


def _mount_tmpfs(path, size: str) -> None:
    """A real filesystem of `size` at path, or skip: only root (or CAP_SYS_ADMIN) may mount."""
    os.makedirs(path, exist_ok=True)
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"can't mount a tmpfs here ({p.stderr.strip() or p.returncode})")


@pytest.fixture
def small_disk(tmp_path):
    """A mounter: small_disk(size) -> a folder on a new tmpfs of that size, unmounted at the test's end."""
    mounted = []

    def mount(size: str):
        path = tmp_path / f"disk{len(mounted)}"
        _mount_tmpfs(path, size)
        mounted.append(path)
        return path

    yield mount
    for path in mounted:
        subprocess.run(["umount", str(path)], capture_output=True)


def _free(path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _fill(folder, leave: int = 0) -> None:
    """Write a file until `leave` bytes are free on folder's filesystem."""
    with open(os.path.join(folder, "filler"), "wb") as fh:
        try:
            fh.write(b"\0" * max(_free(folder) - leave, 0))
            fh.flush()
        except OSError:
            pass  # full already: that is the point


# ------------------------------------------------------------------------------------ the estimate
def test_estimate_bounds_what_a_run_writes(small_cfg, small_run, tmp_path):
    from ddp_helpers.cli.outputs import write_outputs

    paths = write_outputs(small_run, str(tmp_path), plots=True)
    sizes = {os.path.basename(p): os.path.getsize(p) for p in paths}
    result_bytes, plot_bytes = estimate_bytes(small_cfg)
    assert sizes["result.json"] <= result_bytes <= 2 * sizes["result.json"] + 64_000, (sizes, result_bytes)
    drawn = sum(v for k, v in sizes.items() if k.endswith(".png"))
    assert drawn <= plot_bytes <= 10 * drawn, (sizes, plot_bytes)


# ------------------------------------------------------------------------------------ refused up front
def test_the_estimate_counts_the_models_parameters_without_building_it():
    """--out is sized before torch is imported, from a count of the listing's model, not the model itself."""
    from ddp_helpers.engine.model import build_model, n_params
    from ddp_helpers.cli.outputs import MODEL_PARAMS

    assert MODEL_PARAMS == n_params(build_model(0))


@pytest.mark.slow
def test_full_out_is_refused_before_any_process_starts(small_disk, tmp_path):
    disk = small_disk("200k")
    env = {**ENV, "TMPDIR": str(tmp_path)}  # a started rank would leave its log folder here
    code = ("import sys, psutil; from ddp_helpers.cli.train import main; code = main(sys.argv[1:]); "
            "print(code, 'torch' in sys.modules, len(psutil.Process().children()))")
    p = subprocess.run([sys.executable, "-c", code, "--dataset", "mnist-5k", "--max-steps", "5", "--out",
                        str(disk / "run")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert p.stdout.split() == ["2", "False", "0"], (p.stdout, p.stderr)  # exit 2, no torch, no process started
    assert p.stderr.startswith(f"error: --out '{disk / 'run'}' has ") and "bytes free, and this run writes up to " \
        in p.stderr and "--no-plots" in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert not glob.glob(str(tmp_path / "ddp_helpers-ranks-*")), "no rank may start"


@pytest.mark.parametrize("out, why", [("{tmp}/file", "is an existing file"), ("/proc/ddp-out", "can't be written"),
                                      ("{ro}/out", "Read-only file system")], ids=["a-file", "proc", "read-only"])
def test_an_output_folder_that_cant_be_written_is_refused_before_training(out, why, small_disk, tmp_path):
    """Refused at once: exit 2 in one line, before torch is imported or any process started."""
    (tmp_path / "file").write_text("x")
    if "{ro}" in out:
        out = out.replace("{ro}", str(small_disk("1m,ro")))
    out = out.replace("{tmp}", str(tmp_path))
    code = ("import sys, psutil; from ddp_helpers.cli.train import main; code = main(sys.argv[1:]); "
            "print(code, 'torch' in sys.modules, len(psutil.Process().children()))")
    p = subprocess.run([sys.executable, "-c", code, "--dataset", "mnist-5k", "--no-plots", "--out", out],
                       cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=60)
    assert p.stdout.split() == ["2", "False", "0"], (p.stdout, p.stderr)  # exit 2, no torch, no process started
    assert why in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.count("\n") == 1 and "--out" in p.stderr, p.stderr


# ------------------------------------------------------------------------------------ writing still fails
def _main_filling(disk, tmp_path, monkeypatch, capfd, leave: int):
    """The command line's main() in this process (its ranks forked) with --out on disk: the disk fills while the
    ranks train, after the up-front check passed. Returns (exit status, stdout, stderr) as a process would have
    them (capfd: file descriptors 1 and 2, so torch's and PIL's own writes count)."""
    import tempfile

    import ddp_helpers.engine.runner as R
    from ddp_helpers.cli.train import main

    real = R.run_checked
    filled = []

    def fill_once(steps, total):
        if not filled and min(steps) >= 1:
            _fill(disk, leave)
            filled.append(min(steps))

    monkeypatch.setattr(R, "run_checked", lambda *a, **k: real(*a, on_progress=fill_once, **k))
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # where a result --out can't take is kept
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    code = main(["--dataset", "mnist-5k", "--epochs", "3", "--batch-size", "16", "--threads-per-rank", "1",
                 "--start-method", "fork", "--out", str(disk / "run")])
    assert filled, "the disk was not filled during training"
    captured = capfd.readouterr()
    return code, captured.out, captured.err


def test_disk_full_after_training_keeps_the_result_and_says_where(small_disk, tmp_path, monkeypatch, capfd):
    disk = small_disk("4m")
    code, out, err = _main_filling(disk, tmp_path, monkeypatch, capfd, leave=0)
    assert code == 1 and "Traceback" not in err and err.count("\n") == 1, err
    kept = glob.glob(str(tmp_path / f"{KEPT_PREFIX}*" / "result.json"))
    assert len(kept) == 1, (err, os.listdir(tmp_path))
    assert re.fullmatch(re.escape(f"error: can't write {disk / 'run' / 'result.json'} (No space left on device, ")
                        + r"[\d,]+" + re.escape(f" bytes free): the run's result.json is kept at {kept[0]}; free some "
                                                 f"space in {disk / 'run'} or choose another --out\n"), err), err
    res = TrainResult.load(kept[0])
    assert res.complete and res.n_steps == 3 * 125 and res.fingerprints_agree()  # 4,000 / (2 x 16) per epoch
    assert os.listdir(disk / "run") == [], "no half-written file left in --out"


def test_plot_that_no_longer_fits_keeps_result_json(small_disk, tmp_path, monkeypatch, capfd):
    disk = small_disk("4m")
    # result.json (~380 KB) fits, not all 3 plots
    code, out, err = _main_filling(disk, tmp_path, monkeypatch, capfd, leave=480_000)
    assert code == 1 and "Traceback" not in err and err.count("\n") == 1, err
    assert err.startswith(f"error: result.json was written ({disk / 'run' / 'result.json'}), but ") and \
        "could not be (No space left on device" in err and "--no-plots" in err, err
    assert "PIL" not in err and "encoder" not in err, err
    assert TrainResult.load(str(disk / "run" / "result.json")).complete
    left = sorted(os.listdir(disk / "run"))
    assert not [f for f in left if ".tmp" in f], left  # the PNG being written is removed, never half there
    for png in left:
        if png.endswith(".png"):
            assert (disk / "run" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------------------ where no disk can be filled
@pytest.fixture
def full_out(tmp_path, monkeypatch):
    """An --out folder (tmp_path/out) where saving a result fails with ENOSPC; TMPDIR (where it is kept) is tmp_path."""
    real_save = TrainResult.save
    out = tmp_path / "out"

    def save(self, path):
        if str(path).startswith(str(out)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(self, path)

    monkeypatch.setattr(TrainResult, "save", save)
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile
    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    return out


def test_write_failure_keeps_the_result_monkeypatched(small_run, tmp_path, full_out):
    from ddp_helpers.cli.outputs import write_outputs

    out = full_out
    with pytest.raises(OutputError) as e:
        write_outputs(small_run, str(out), plots=True)
    kept = glob.glob(str(tmp_path / f"{KEPT_PREFIX}*" / "result.json"))
    assert len(kept) == 1 and f"kept at {kept[0]}" in str(e.value), str(e.value)
    back = TrainResult.load(kept[0])
    assert np.array_equal(back.final_params, small_run.final_params)
    json.loads(open(kept[0]).read())


def test_failed_runs_partial_result_is_kept_when_out_is_full(tmp_path, full_out, capsys):
    """A failed run's partial_result.json too: kept in the temp dir when --out can't take it."""
    from ddp_helpers.cli.train import main

    out = full_out
    code = main(["--dataset", "mnist-5k", "--max-steps", "8", "--threads-per-rank", "1", "--fault-rank", "1",
                 "--fault-step", "4", "--start-method", "fork", "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 1 and "rank 1 failed" in err, err
    kept = glob.glob(str(tmp_path / f"{KEPT_PREFIX}*" / "partial_result.json"))
    assert len(kept) == 1 and f"partial_result.json is kept at {kept[0]}" in err, err
    partial = TrainResult.load(kept[0])
    assert not partial.complete and partial.n_steps == 4
