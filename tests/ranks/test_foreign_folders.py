"""Nothing another local user made is trusted: a torchrun run folder, a launch's reports or a checkpoint folder
planted by another user is refused by name, with nothing in it run, read or written through.

The other user is `nobody`: the test (as root) plants the files from a child that drops to that user
(os.setgid/os.setuid), as a second student on a shared classroom server would."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest

from ddp_helpers import ConfigError
from ddp_helpers.common.files import atomic_write, check_writable_dir
from ddp_helpers.ranks.reports import read_reports

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NOBODY = 65534
needs_root = pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0 or sys.platform != "linux",
                                reason="needs root on Linux (to plant files as another user)")


class Boom:
    """A pickle that, once loaded, leaves a marker file: what a planted report would run as the job's owner."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def as_nobody(action) -> None:
    """Run action() in a child process as user nobody (and wait for it)."""
    pid = os.fork()
    if pid == 0:
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            action()
            os._exit(0)
        except BaseException:  # noqa: BLE001
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the planting child failed"


@pytest.fixture
def shared_tmp(tmp_path, monkeypatch):
    """A temp dir like /tmp (mode 1777: every user may create, none may remove another's), used as TMPDIR; made
    in the system's temp dir, which every user can reach (pytest's own tmp_path is root's alone)."""
    import shutil
    import tempfile

    folder = tempfile.mkdtemp(prefix="ddp-helpers-test-shared-", dir="/tmp")
    os.chmod(folder, 0o1777)
    monkeypatch.setenv("TMPDIR", folder)
    monkeypatch.setattr(tempfile, "tempdir", folder)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def plant_run_folder(folder: str, marker: str) -> None:
    """As nobody: the job's predictable run folder, open to all, with a report of each kind in it."""
    def plant():
        os.mkdir(folder)
        os.chmod(folder, 0o777)
        with open(os.path.join(folder, "report0.pkl"), "wb") as fh:
            pickle.dump(Boom(marker), fh)
        with open(os.path.join(folder, "report0.json"), "w") as fh:
            fh.write('{"ok": false, "text": "planted"}')
    as_nobody(plant)


TORCHRUN_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29561", "TORCHELASTIC_RUN_ID": "none",
                "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "DDP_HELPERS_PROGRESS": "0"}


@needs_root
def test_a_torchrun_job_refuses_a_run_folder_another_user_made(shared_tmp, tmp_path):
    """The job (a torchrun rank, started with torchrun's variables) stops before training, naming the folder;
    the planted pickle never runs, and nothing is written into the folder."""
    folder = os.path.join(shared_tmp, "ddp_helpers-ranks-torchrun-none-127.0.0.1-29561-a0")
    marker = str(tmp_path / "ran-as-owner")
    plant_run_folder(folder, marker)
    before = sorted(os.listdir(folder))
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "-m", "ddp_helpers.train", "--dataset", "mnist-5k", "--max-steps", "2",
                        "--no-plots", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, **TORCHRUN_ENV, "TMPDIR": str(shared_tmp), "PYTHONPATH": ROOT})
    assert p.returncode == 2, p.stderr[-3000:]
    assert f"the torchrun run folder {folder} is refused: it is owned by another user (uid {NOBODY})" in p.stderr
    assert "nothing in it was read or written" in p.stderr and "Remove it" in p.stderr
    assert not os.path.exists(marker)
    assert sorted(os.listdir(folder)) == before  # no lock, no rows, no report of ours
    assert not (out / "result.json").exists()


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX modes and links")
@pytest.mark.parametrize("kind", ["open to all", "a link to a private folder"])
def test_a_run_folder_of_ours_that_others_could_enter_or_a_link_is_refused(kind, tmp_path):
    from ddp_helpers.common.files import make_private_dir

    target = tmp_path / "private"
    target.mkdir(mode=0o700)
    folder = tmp_path / "run"
    if kind == "open to all":
        folder.mkdir()
        os.chmod(folder, 0o777)
    else:
        folder.symlink_to(target)
    why = "(it is a symbolic link|its mode is 0777)"
    with pytest.raises(PermissionError, match=f"run folder {folder} is refused: {why}"):
        make_private_dir(str(folder), "the torchrun run folder", "Remove it.")
    made = make_private_dir(str(tmp_path / "new"), "the torchrun run folder", "Remove it.")
    assert oct(os.lstat(made).st_mode & 0o777) == "0o700"


@needs_root
def test_reports_are_never_unpickled_from_a_folder_another_user_made(shared_tmp, tmp_path):
    folder = os.path.join(shared_tmp, "ddp_helpers-ranks-planted")
    marker = str(tmp_path / "ran-as-owner")
    plant_run_folder(folder, marker)
    with pytest.raises(PermissionError, match=f"run folder {folder} is refused: it is owned by another user"):
        read_reports(folder, 1)
    assert not os.path.exists(marker)


@needs_root
def test_a_report_file_another_user_made_in_a_private_folder_is_not_unpickled(tmp_path):
    """Even in a folder of ours (made 0700 and then opened, say, by a chmod), a file not ours is not loaded."""
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    marker = str(tmp_path / "ran-as-owner")
    with open(folder / "report0.pkl", "wb") as fh:
        pickle.dump(Boom(marker), fh)
    os.chown(folder / "report0.pkl", NOBODY, NOBODY)
    with pytest.raises(PermissionError, match="report0.pkl is refused: not a regular file of this user's"):
        read_reports(str(folder), 1)
    assert not os.path.exists(marker)


def plant_checkpoint_folder(folder: str, victim: str) -> None:
    """As nobody: a checkpoint folder open to all, with links to the owner's file at every temp name a writer
    could pick for step 5 (ckpt-0000005.pt.tmp<pid>, for every pid), and at the final name's neighbours."""
    def plant():
        os.mkdir(folder)
        os.chmod(folder, 0o777)
        top = int(open("/proc/sys/kernel/pid_max").read())
        for pid in range(max(os.getpid() - 2000, 1), min(os.getpid() + 20000, top)):
            os.symlink(victim, os.path.join(folder, f"ckpt-0000005.pt.tmp{pid}"))
    as_nobody(plant)


@needs_root
def test_a_checkpoint_folder_another_user_made_is_refused_by_name(shared_tmp, tmp_path):
    from ddp_helpers import TrainConfig, run_training

    victim = tmp_path / "owners-file"
    victim.write_bytes(b"the owner's data")
    folder = os.path.join(shared_tmp, "ckpts")
    plant_checkpoint_folder(folder, str(victim))
    with pytest.raises(ConfigError, match=r"checkpoint_dir=.* is not accepted: a directory of this user's own "
                                          rf"\('.*ckpts' is owned by another user \(uid {NOBODY}\)"):
        check_writable_dir("checkpoint_dir", folder)
    with pytest.raises(ConfigError, match=r"TrainConfig\.checkpoint_dir=.* owned by another user"):
        run_training(TrainConfig(dataset="mnist-5k", max_steps=5, checkpoint_dir=folder), progress=False)
    assert victim.read_bytes() == b"the owner's data"
    assert not any(n.endswith(".pt") for n in os.listdir(folder))


@needs_root
def test_a_checkpoint_written_where_links_were_planted_never_goes_through_them(shared_tmp, tmp_path):
    """The writer itself, past the settings check (the folder changed hands after it): the planted links at the
    old temp names and at the final name are never written through, and the save is refused by name."""
    import torch

    from ddp_helpers.engine.checkpoint import save_checkpoint

    victim = tmp_path / "owners-file"
    victim.write_bytes(b"the owner's data")
    folder = os.path.join(shared_tmp, "ckpts")
    plant_checkpoint_folder(folder, str(victim))
    with pytest.raises(PermissionError, match=r"checkpoint_dir=.* is not accepted: .* owned by another user"):
        save_checkpoint(folder, 5, {"w": torch.zeros(3)}, {}, {})
    assert victim.read_bytes() == b"the owner's data"


@pytest.mark.skipif(sys.platform == "win32", reason="symbolic links need privileges on Windows")
def test_atomic_write_never_writes_through_a_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    target = tmp_path / "result.json"
    for pid in range(max(os.getpid() - 50, 1), os.getpid() + 50):  # the old predictable temp names
        os.symlink(victim, f"{target}.tmp{pid}")
    target.symlink_to(victim)  # and the final name

    def write(tmp: str) -> None:
        with open(tmp, "w") as fh:
            fh.write("new")
    atomic_write(str(target), write)
    assert victim.read_bytes() == b"keep"
    assert not target.is_symlink() and target.read_text() == "new"
    leftovers = [n for n in os.listdir(tmp_path) if n.startswith(".result.json.")]
    assert not leftovers


@needs_root
def test_stale_folder_cleanup_leaves_another_users_folders_and_links_alone(shared_tmp, tmp_path):
    """remove_stale judges only real folders of this user's: another user's folder that looks dead (an unheld
    lock) is neither read nor removed, and a link to a folder of ours is not followed."""
    from ddp_helpers.ranks import folders as C

    theirs = os.path.join(shared_tmp, C.RUN_DIR_PREFIX + "theirs")

    def plant():
        os.mkdir(theirs, 0o700)
        open(os.path.join(theirs, C.LOCK), "w").close()  # nobody holds it: it looks like a dead launch's
    as_nobody(plant)
    ours = tmp_path / "ours"
    ours.mkdir()
    (ours / C.LOCK).write_text("")
    link = os.path.join(shared_tmp, C.RUN_DIR_PREFIX + "link")
    os.symlink(ours, link)
    C.remove_stale()
    assert os.listdir(theirs) == [C.LOCK]
    assert os.path.islink(link) and (ours / C.LOCK).exists()


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX modes")
def test_a_checkpoint_folder_every_user_can_write_is_refused_unless_sticky(tmp_path):
    folder = tmp_path / "ckpts"
    folder.mkdir()
    os.chmod(folder, 0o777)
    with pytest.raises(ConfigError, match=r"checkpoint_dir=.* is writable by every user \(mode 0777, without the "
                                          r"sticky bit\).* choose a folder this user owns"):
        check_writable_dir("checkpoint_dir", str(folder))
    os.chmod(folder, 0o1777)  # like /tmp: nobody can replace another's files
    check_writable_dir("checkpoint_dir", str(folder))
    check_writable_dir("checkpoint_dir", str(folder / "new"))  # made by the run itself
