"""torchrun's error file is written by rename: the agent never reads half of one (it died of that)."""
from __future__ import annotations

import json

import pytest
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, ProcessFailure
from torch.distributed.elastic.multiprocessing.errors import error_handler as torch_handler

from ddp_helpers.cli.torchrun import AtomicErrorHandler, record_atomically


class Killed(BaseException):
    """Stands for the SIGTERM that ends a rank while it writes (the agent's close() of the other ranks)."""


def _dump_cut_short(data, fp):
    fp.write(json.dumps(data)[:20])
    fp.flush()
    raise Killed


@pytest.mark.parametrize("handler, leaves_partial", [(ErrorHandler, True), (AtomicErrorHandler, False)])
def test_a_rank_killed_while_writing_leaves_no_half_file(handler, leaves_partial, tmp_path, monkeypatch):
    """torch's own handler (the control) leaves a cut file that the agent's json.load fails on; ours leaves none."""
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setattr(torch_handler.json, "dump", _dump_cut_short)
    with pytest.raises(Killed):
        handler().record_exception(ValueError("boom"))
    assert error_file.exists() == leaves_partial
    if leaves_partial:
        with pytest.raises(json.JSONDecodeError):
            ProcessFailure(local_rank=0, pid=1, exitcode=1, error_file=str(error_file))


def test_a_recorded_error_is_the_file_torchs_agent_reads(tmp_path, monkeypatch):
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))

    @record_atomically
    def fails():
        raise ValueError("boom at step 40")

    with pytest.raises(ValueError):
        fails()
    failure = ProcessFailure(local_rank=1, pid=1, exitcode=1, error_file=str(error_file))
    assert failure.message["message"] == "ValueError: boom at step 40"
    assert "in fails" in failure.message["extraInfo"]["py_callstack"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["error.json"]  # nothing left beside it
    assert str(error_file) == __import__("os").environ["TORCHELASTIC_ERROR_FILE"]  # the variable is restored
