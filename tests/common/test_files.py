"""The leaf file helpers: a write is whole or absent, and a bad path is refused naming its setting and the fix."""
from __future__ import annotations

import errno
import os

import pytest

from ddp_helpers.common.errors import ConfigError
from ddp_helpers.common.files import atomic_write, check_readable_file, check_writable_dir, probe_output_dir


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "result.json"
    path.write_text("old")

    def half(tmp: str) -> None:
        with open(tmp, "w") as fh:
            fh.write("half of the new")
        raise KeyboardInterrupt  # an interrupt in the middle of the write

    with pytest.raises(KeyboardInterrupt):
        atomic_write(str(path), half)
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["result.json"]


def test_a_full_disk_is_named_with_the_file_and_the_room_left(tmp_path):
    def full(tmp: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError) as e:
        atomic_write(str(tmp_path / "ckpt.pt"), full)
    assert e.value.errno == errno.ENOSPC and "ckpt.pt" in str(e.value) and "bytes free" in str(e.value)


def test_a_folder_given_for_a_file_suggests_its_latest_match(tmp_path):
    for step in (3, 12):
        (tmp_path / f"ckpt-{step:07d}.pt").write_bytes(b"x")
    with pytest.raises(ConfigError) as e:
        check_readable_file("resume_from", str(tmp_path), "a checkpoint", pattern="ckpt-*.pt",
                            kind="checkpoint file")
    assert "not a checkpoint file" in str(e.value) and str(tmp_path / "ckpt-0000012.pt") in str(e.value)


def test_a_missing_file_is_named_as_missing(tmp_path):
    with pytest.raises(ConfigError, match="TrainConfig.resume_from=.* doesn't exist"):
        check_readable_file("resume_from", str(tmp_path / "nope.pt"), "a checkpoint")
    check_readable_file("resume_from", __file__, "a checkpoint")  # a readable file passes


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file_is_named_as_unreadable(tmp_path):
    f = tmp_path / "ckpt.pt"
    f.write_bytes(b"x")
    f.chmod(0)
    with pytest.raises(ConfigError, match="can't read the file"):
        check_readable_file("resume_from", str(f), "a checkpoint")


def test_a_file_in_the_way_of_a_folder_is_named(tmp_path):
    (tmp_path / "runs").write_text("")
    with pytest.raises(ConfigError, match="is a file, not a folder"):
        check_writable_dir("checkpoint_dir", str(tmp_path / "runs" / "ckpt"))
    check_writable_dir("checkpoint_dir", str(tmp_path / "new" / "ckpt"))  # made when needed: fine


def test_an_output_folder_is_made_and_probed(tmp_path):
    assert probe_output_dir("--out", str(tmp_path / "a" / "b")) == str(tmp_path / "a" / "b")
    assert os.listdir(tmp_path / "a" / "b") == []  # the probe file is gone
    (tmp_path / "f").write_text("")
    with pytest.raises(ValueError, match="--out .* is an existing file"):
        probe_output_dir("--out", str(tmp_path / "f"))
