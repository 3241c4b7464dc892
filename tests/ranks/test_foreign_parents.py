"""No folder on the way to an output that another user owns or can write without the sticky bit is trusted
(issue 61, N1): a checkpoint folder, --out, the temp dir of the run folders. Each path is judged from the root,
and a checkpoint is written and pruned relative to the folder it opened, so a swap after the check can't
redirect a write or an unlink.

The other user is `nobody`, as in test_foreign_folders.py: the test (as root) plants from a child that drops to
that user."""
from __future__ import annotations

import os
import sys

import pytest

from ddp_helpers import ConfigError
from ddp_helpers.common.files import check_writable_dir, probe_output_dir
from tests.ranks.test_foreign_folders import NOBODY, as_nobody, needs_root, shared_tmp  # noqa: F401 - a fixture

posix_only = pytest.mark.skipif(sys.platform == "win32", reason="POSIX modes and links")


def precious_folder(tmp_path) -> dict:
    """The owner's folder another user would aim at: two files named like checkpoints, and their bytes."""
    precious = tmp_path / "precious"
    precious.mkdir()
    files = {"ckpt-0000001.pt": b"the owner's first", "ckpt-0000002.pt": b"the owner's second"}
    for name, data in files.items():
        (precious / name).write_bytes(data)
    return {"folder": precious, "files": files}


def unchanged(precious: dict) -> bool:
    folder = precious["folder"]
    return {n: (folder / n).read_bytes() for n in sorted(os.listdir(folder))} == precious["files"]


@needs_root
def test_the_issues_scenario_writes_and_removes_nothing_in_the_owners_folder(shared_tmp, tmp_path, monkeypatch):
    """checkpoint_dir <tmp>/x/sub/ckpt, none of it there when the settings are checked; then another user makes
    <tmp>/x/sub (0777, theirs) and, after the first save, swaps ckpt for a link to the owner's folder. The first
    save is refused, naming <tmp>/x and its owner; nothing in the owner's folder is overwritten or pruned."""
    from ddp_helpers import TrainConfig, run_training
    from ddp_helpers.engine import checkpoint, config
    from ddp_helpers.ranks.reports import RankFailedError

    precious = precious_folder(tmp_path)
    x = os.path.join(shared_tmp, "x")
    ckpt = os.path.join(x, "sub", "ckpt")
    real_check, real_save = config.check_writable_dir, checkpoint.save_checkpoint

    def check_then_plant(name, path, *a, **k):
        real_check(name, path, *a, **k)  # nothing there yet: accepted

        def plant():
            os.makedirs(os.path.join(x, "sub"))
            os.chmod(x, 0o777)
            os.chmod(os.path.join(x, "sub"), 0o777)
        as_nobody(plant)

    def save_then_swap(directory, step, *a, **k):
        if step == 2:  # after the first save: ckpt becomes a link to the owner's folder
            as_nobody(lambda: (os.rename(ckpt, ckpt + ".old"), os.symlink(precious["folder"], ckpt)))
        return real_save(directory, step, *a, **k)

    monkeypatch.setattr(config, "check_writable_dir", check_then_plant)
    monkeypatch.setattr(checkpoint, "save_checkpoint", save_then_swap)
    cfg = TrainConfig(dataset="mnist-5k", max_steps=3, checkpoint_dir=ckpt, checkpoint_every=1, checkpoint_keep=1)
    with pytest.raises(RankFailedError) as e:
        run_training(cfg, progress=False, start_method="fork")
    said = str(e.value)
    assert f"checkpoint_dir={ckpt!r} is not accepted: {x!r} is owned by another user (uid {NOBODY})" in said, said
    assert "nothing was written" in said and "Choose a folder this user owns" in said
    assert unchanged(precious)
    assert not os.path.exists(ckpt) or not any(n.endswith(".pt") for n in os.listdir(ckpt))


@needs_root
@pytest.mark.parametrize("whose", ["another user's", "root's, open to all"])
def test_a_parent_open_to_others_made_before_is_refused_by_name(whose, shared_tmp, tmp_path):
    """<tmp>/x/sub (0777) exists before the check, and only the last component is missing: the check names the
    folder on the way another user can change (not only the nearest existing one), before any process starts."""
    from ddp_helpers import TrainConfig, run_training

    x, sub = os.path.join(shared_tmp, "x"), os.path.join(shared_tmp, "x", "sub")

    def make():
        os.makedirs(sub)
        os.chmod(sub, 0o777)
    if whose == "another user's":
        as_nobody(make)
        why = rf"'{x}' is owned by another user \(uid {NOBODY}\) named nobody"
    else:
        make()
        why = rf"'{sub}' is writable by every user \(mode 0777, without the sticky bit\)"
    ckpt = os.path.join(sub, "ckpt")
    with pytest.raises(ConfigError, match=rf"checkpoint_dir='{ckpt}' is not accepted: .*{why}.* choose a folder "
                                          "this user owns"):
        check_writable_dir("checkpoint_dir", ckpt)
    with pytest.raises(ConfigError, match=rf"TrainConfig\.checkpoint_dir=.*{why}"):
        run_training(TrainConfig(dataset="mnist-5k", max_steps=2, checkpoint_dir=ckpt), progress=False)
    with pytest.raises(ValueError, match=rf"--out '{sub}/out' is not accepted: {why}"):
        probe_output_dir("--out", os.path.join(sub, "out"))
    assert os.listdir(sub) == []  # nothing made, nothing probed


@needs_root
def test_a_temp_dir_another_user_can_change_is_refused_before_any_rank_starts(shared_tmp, monkeypatch, capfd,
                                                                            tmp_path):
    import tempfile

    from ddp_helpers import launch
    from ddp_helpers.cli.train import main

    theirs = os.path.join(shared_tmp, "theirs")
    as_nobody(lambda: (os.mkdir(theirs), os.chmod(theirs, 0o777)))
    monkeypatch.setattr(tempfile, "tempdir", theirs)
    with pytest.raises(ConfigError, match=rf"TMPDIR='{theirs}' \(the temp dir.*\) is not accepted: '{theirs}' is "
                                          rf"owned by another user \(uid {NOBODY}\) named nobody.* Set TMPDIR to"):
        launch(print, 1)
    assert main(["--dataset", "mnist-5k", "--max-steps", "2", "--no-plots", "--out", str(tmp_path / "out")]) == 2
    assert f"error: TMPDIR='{theirs}' (the temp dir, where a launch's folders go) is not accepted" in capfd.readouterr().err
    assert os.listdir(theirs) == []
    assert not (tmp_path / "out").exists()  # the --out it probed before the temp dir was judged is removed again


@posix_only
def test_a_checkpoint_folder_swapped_after_opening_is_neither_written_nor_pruned(tmp_path):
    """The writer's own guarantee, whoever swaps: the folder opened is the one written into and pruned."""
    import torch

    from ddp_helpers.engine.checkpoint import drop_older, open_checkpoint_dir, save_checkpoint

    precious = precious_folder(tmp_path)
    ckpt = tmp_path / "run" / "ckpt"
    with open_checkpoint_dir(str(ckpt)) as folder:
        save_checkpoint(folder, 1, {"w": torch.zeros(3)}, {}, {})
        os.rename(ckpt, tmp_path / "run" / "moved")
        os.symlink(precious["folder"], ckpt)
        save_checkpoint(folder, 2, {"w": torch.ones(3)}, {}, {})
        assert drop_older(folder, 1) == [str(ckpt / "ckpt-0000001.pt")]
    assert unchanged(precious)
    assert sorted(os.listdir(tmp_path / "run" / "moved")) == ["ckpt-0000002.pt"]


@posix_only
def test_pruning_removes_only_regular_files(tmp_path):
    from ddp_helpers.engine.checkpoint import drop_older

    victim = tmp_path / "victim"
    victim.write_bytes(b"keep")
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    os.symlink(victim, ckpt / "ckpt-0000001.pt")  # a link and a folder named like old checkpoints
    (ckpt / "ckpt-0000002.pt").mkdir()
    (ckpt / "ckpt-0000003.pt").write_bytes(b"old")
    (ckpt / "ckpt-0000004.pt").write_bytes(b"new")
    assert drop_older(str(ckpt), 1) == [str(ckpt / "ckpt-0000003.pt")]
    assert sorted(os.listdir(ckpt)) == ["ckpt-0000001.pt", "ckpt-0000002.pt", "ckpt-0000004.pt"]
    assert victim.read_bytes() == b"keep"


def test_without_dir_fds_or_owners_outputs_are_written_by_path(tmp_path, monkeypatch):
    """Windows' branch: no dir_fd and no os.getuid; checkpoints are still written, renamed and pruned."""
    import torch

    from ddp_helpers.common import trusted
    from ddp_helpers.engine.checkpoint import drop_older, open_checkpoint_dir, save_checkpoint

    monkeypatch.setattr(trusted, "dir_fds_work", lambda: False)
    monkeypatch.delattr(os, "getuid", raising=False)
    ckpt = tmp_path / "a" / "ckpt"
    with open_checkpoint_dir(str(ckpt)) as folder:
        assert folder.fd is None
        for step in (1, 2, 3):
            save_checkpoint(folder, step, {"w": torch.full((2,), float(step))}, {}, {})
        drop_older(folder, 2)
    assert sorted(os.listdir(ckpt)) == ["ckpt-0000002.pt", "ckpt-0000003.pt"]
    assert torch.load(ckpt / "ckpt-0000003.pt", weights_only=True)["model"]["w"].tolist() == [3.0, 3.0]


@needs_root
def test_a_folder_on_the_way_that_may_be_entered_but_not_listed_is_walked(shared_tmp):
    """root's 0711 folder above the user's own (a shared server's /home, say): the user writes below it as before
    (Linux opens the folders on the way with O_PATH, which needs no read permission)."""
    from ddp_helpers.common.trusted import OutputFolder

    above = os.path.join(shared_tmp, "entered-not-listed")
    os.mkdir(above, 0o711)
    os.mkdir(os.path.join(above, "theirs"))
    os.chown(os.path.join(above, "theirs"), NOBODY, NOBODY)
    import grp  # noqa: F401 - imported here: the child, as nobody, may not read the interpreter's library
    import pwd  # noqa: F401

    def write():
        with OutputFolder(os.path.join(above, "theirs", "ckpt")) as out:
            out.write("ckpt-0000001.pt", lambda fh: fh.write(b"saved"))
            assert out.names() == ["ckpt-0000001.pt"]
    as_nobody(write)
    with open(os.path.join(above, "theirs", "ckpt", "ckpt-0000001.pt"), "rb") as fh:
        assert fh.read() == b"saved"


def test_without_o_path_a_folder_that_cant_be_opened_is_walked_by_path(tmp_path, monkeypatch):
    """macOS has no O_PATH: a folder on the way this user may enter but not read fails os.open, and the path is
    then judged and written by name, as on Windows."""
    from ddp_helpers.common import trusted

    real_walk, tried = trusted.walk, []

    def walk(path, create, by_fd=None):
        tried.append(by_fd)
        if by_fd is None:
            raise PermissionError(13, "Permission denied", "a folder on the way")
        return real_walk(path, create, by_fd)
    monkeypatch.delattr(os, "O_PATH", raising=False)
    monkeypatch.setattr(trusted, "walk", walk)
    with trusted.OutputFolder(str(tmp_path / "ckpt")) as out:
        out.write("f", lambda fh: fh.write(b"x"))
    assert tried == [None, False] and (tmp_path / "ckpt" / "f").read_bytes() == b"x"


@needs_root
def test_a_parent_its_group_can_write_is_refused_when_another_user_is_in_the_group(shared_tmp):
    """Group nogroup is nobody's primary group: its members could swap what is below a folder it can write.
    This user's own private group (root's here) with no other member is not another user."""
    shared = os.path.join(shared_tmp, "group-shared")
    os.mkdir(shared)
    os.chown(shared, 0, NOBODY)
    os.chmod(shared, 0o775)
    with pytest.raises(ConfigError, match=rf"'{shared}' is writable by its group \(gid {NOBODY}; mode 0775, without "
                                          r"the sticky bit\)"):
        check_writable_dir("checkpoint_dir", os.path.join(shared, "ckpt"))
    os.chown(shared, 0, 0)
    check_writable_dir("checkpoint_dir", os.path.join(shared, "ckpt"))
    os.chown(shared, 0, NOBODY)
    os.chmod(shared, 0o3775)  # setgid and sticky, a shared project folder: nobody can replace another's entries
    check_writable_dir("checkpoint_dir", os.path.join(shared, "ckpt"))
