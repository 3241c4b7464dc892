"""What a rank reports is said whatever it holds (issue 61, N4 and N5): an error whose __str__ raises is named
by its type with whatever of it can be rendered, and a report file that is corrupt or forged is named as such,
with its rank; neither is ever raised raw or blamed on os._exit() or native code."""
from __future__ import annotations

import json
import os
import pickle
import sys
import tempfile

import pytest

from ddp_helpers import RankFailedError, launch
from ddp_helpers.ranks import rank as rank_module
from ddp_helpers.ranks.folders import report_path
from ddp_helpers.ranks.reports import read_report_data
from ddp_helpers.ranks.reports import Report, diagnose, read_rank_reports

needs_fork = pytest.mark.skipif(sys.platform == "win32", reason="the rank inherits a patched writer by fork")


class Unprintable(Exception):
    """An error whose text can't be made: its __str__ raises."""

    def __str__(self) -> str:
        raise ValueError("no text for you")


class Unrepresentable:
    def __repr__(self) -> str:
        raise RuntimeError("no repr either")


def _raise_unprintable(rank: int, world_size: int) -> None:
    if rank == 1:
        raise Unprintable("rank one's", 7, Unrepresentable())


@needs_fork
def test_an_error_whose_str_raises_is_named_by_its_type():
    with pytest.raises(RankFailedError) as e:
        launch(_raise_unprintable, 2, start_method="fork", quiet=True)
    err = e.value
    assert err.rank == 1
    assert err.message == ("Unprintable: \"rank one's\", 7, <a Unrepresentable that can't be shown> (its str() "
                           "raised ValueError)")
    assert "os._exit()" not in str(err) and "native code" not in str(err)
    assert "_raise_unprintable" in err.traceback_text  # the rank's own traceback ...
    assert f"ranks{os.sep}reports.py" not in err.traceback_text  # ... not one from the package's report code
    assert isinstance(err.original, Unprintable)


def test_torchruns_error_file_names_an_unprintable_error(tmp_path, monkeypatch):
    """Under torchrun, elastic's @record formats f"{type(e).__name__}: {e}" itself: the handler keeps it whole."""
    from ddp_helpers.cli.torchrun import AtomicErrorHandler

    file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(file))
    try:
        raise Unprintable("in a torchrun rank")
    except Unprintable as e:
        AtomicErrorHandler().record_exception(e)
    said = json.loads(file.read_text())["message"]
    assert said["message"] == "Unprintable: 'in a torchrun rank' (its str() raised ValueError)"
    assert "raise Unprintable" in said["extraInfo"]["py_callstack"]


FORGED = {
    "cut short": pickle.dumps(Report(True, value=pickle.dumps(1)))[:-9],
    "garbage": b"\x80\x04not a pickle at all",
    "a class that isn't there": b"cddp_helpers.ranks.reports\nNoSuchReport\n.",
    "another object": pickle.dumps({"ok": True}),
}
WHY = {"cut short": r"(UnpicklingError|EOFError) while unpickling it", "garbage": "UnpicklingError while unpickling it",
       "a class that isn't there": "AttributeError while unpickling it",
       "another object": "it holds a dict, not a rank's report"}


@pytest.mark.parametrize("kind", list(FORGED))
def test_a_corrupt_or_forged_report_file_is_named_with_its_rank(kind):
    run_dir = tempfile.mkdtemp()
    try:
        with open(report_path(run_dir, 0), "wb") as fh:
            pickle.dump(Report(True, value=pickle.dumps("fine")), fh)
        with open(report_path(run_dir, 1), "wb") as fh:
            fh.write(FORGED[kind])
        reports = read_rank_reports(run_dir, 2)
        assert reports[0].ok and not reports[1].ok
        err = diagnose(reports, run_dir, 2, first=1, codes=[0, 0])
        assert err.rank == 1
        assert str(err).startswith(f"rank 1 failed: its report file {report_path(run_dir, 1)} can't be read (")
        assert __import__("re").search(WHY[kind], str(err)), str(err)
    finally:
        import shutil

        shutil.rmtree(run_dir)


def _forge_rank_ones_report(contents: bytes):
    real = rank_module.write_report

    def write(run_dir: str, rank: int, report) -> None:
        if rank != 1:
            return real(run_dir, rank, report)
        with open(report_path(run_dir, rank), "wb") as fh:
            fh.write(contents)
    return write


def _returns(rank: int, world_size: int) -> int:
    return rank


@needs_fork
@pytest.mark.slow  # a launch each
@pytest.mark.parametrize("kind", ["garbage", "a class that isn't there", "a value that can't be unpickled"])
def test_a_launch_whose_rank_left_an_unreadable_report_names_the_rank(kind, monkeypatch):
    contents = pickle.dumps(Report(True, value=b"\x80\x04cut")) if kind.startswith("a value") else FORGED[kind]
    monkeypatch.setattr(rank_module, "write_report", _forge_rank_ones_report(contents))
    with pytest.raises(RankFailedError) as e:
        launch(_returns, 2, start_method="fork", quiet=True)
    assert e.value.rank == 1
    if kind.startswith("a value"):
        assert "its returned value can't be unpickled in the launching process (UnpicklingError" in str(e.value)
    else:
        assert f"{os.sep}report1.pkl can't be read ({WHY[kind]})" in str(e.value)
    assert "os._exit()" not in str(e.value)


def test_a_torchrun_report_that_is_not_a_json_object_is_named(tmp_path):
    (tmp_path / "report0.json").write_text("{cut")
    (tmp_path / "report1.json").write_text("[1, 2]")
    (tmp_path / "report2.json").write_text('{"ok": true, "text": ""}')
    found = read_report_data(str(tmp_path), 3)
    assert found[0] == {"ok": False, "text": f"its report file {tmp_path / 'report0.json'} can't be read (not JSON): "
                                             "it is corrupt or cut short, or was not written by a rank of this "
                                             "package"}
    assert "(JSON list, not an object)" in found[1]["text"] and found[2]["ok"] is True
