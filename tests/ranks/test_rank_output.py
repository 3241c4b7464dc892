"""What a launched rank prints reaches the launching process (a notebook's cell), prefixed by rank, capped."""
from __future__ import annotations

import os
import warnings

import pytest

from ddp_helpers import RankFailedError, launch
from ddp_helpers.ranks import output_shown as echo
from ddp_helpers.ranks.output_shown import ECHO_LINE_CHARS, ECHO_LINES, RankEcho


def _lines_of(out: str, rank: int) -> list:
    prefix = f"[rank {rank}] "
    return [line[len(prefix):] for line in out.splitlines() if line.startswith(prefix)]


def _counts(rank: int, world_size: int, n: int) -> int:
    print("hello")
    for i in range(n):
        print(f"step {i} on rank {rank}")
    return rank


def test_each_ranks_prints_reach_the_caller_prefixed_and_in_their_order(capsys):
    assert launch(_counts, 2, args=(30,)) == [0, 1]
    out = capsys.readouterr().out
    for rank in (0, 1):
        assert _lines_of(out, rank) == ["hello"] + [f"step {i} on rank {rank}" for i in range(30)]


def test_quiet_shows_nothing(capfd):
    assert launch(_counts, 2, args=(3,), quiet=True) == [0, 1]
    captured = capfd.readouterr()
    assert captured.out == "" and captured.err == ""


def _warns(rank: int, world_size: int) -> int:
    warnings.warn(f"a warning from rank {rank}", UserWarning)
    print("no newline at the end", end="")
    return rank


def test_a_ranks_warning_and_its_last_unended_line_are_shown(capsys):
    launch(_warns, 2)
    out = capsys.readouterr().out
    for rank in (0, 1):
        lines = _lines_of(out, rank)
        assert any(f"UserWarning: a warning from rank {rank}" in line for line in lines), out
        assert lines[-1] == "no newline at the end"


def _floods(rank: int, world_size: int, n: int) -> int:
    print("[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1")
    print("x" * (ECHO_LINE_CHARS + 500))
    for i in range(n):
        print(f"line {i}")
    return rank


def test_a_print_loop_is_capped_per_rank_and_the_rest_counted(capsys):
    extra = 5000
    launch(_floods, 2, args=(ECHO_LINES + extra,))
    out = capsys.readouterr().out
    for rank in (0, 1):
        lines = _lines_of(out, rank)
        assert not any("[Gloo]" in line for line in lines), "gloo's connection notice is noise, not shown"
        assert lines[0] == "x" * ECHO_LINE_CHARS + " [... cut]"
        shown = [line for line in lines if line.startswith("line ")]
        assert shown == [f"line {i}" for i in range(ECHO_LINES - 1)]  # the cut line was the first of them
        assert lines[ECHO_LINES].startswith("... further lines not shown (ECHO_LINES")
        assert lines[-1] == f"... {extra + 1:,} more lines not shown"


def _prints_then_dies(rank: int, world_size: int) -> int:
    print(f"last words of rank {rank}", flush=True)
    if rank == 1:
        os._exit(3)  # no report: the error would show the rank's log tail
    return rank


def test_a_failed_ranks_output_is_shown_once_not_again_in_the_error(capsys):
    with pytest.raises(RankFailedError) as info:
        launch(_prints_then_dies, 2)
    out = capsys.readouterr().out
    assert info.value.rank == 1
    assert _lines_of(out, 1) == ["last words of rank 1"]
    assert "last words" not in str(info.value) and "(shown above, in its [rank 1] lines)" in str(info.value)


def test_quiet_failure_still_shows_the_ranks_last_output(capsys):
    with pytest.raises(RankFailedError) as info:
        launch(_prints_then_dies, 2, quiet=True)
    assert capsys.readouterr().out == ""
    assert "last words of rank 1" in str(info.value)


def test_the_echo_follows_a_log_across_its_rotation_and_reads_only_whole_lines(tmp_path, capsys):
    path = str(tmp_path / "rank0.log")
    reader = RankEcho(path, 0)
    reader.poll()  # no log yet: nothing
    with open(path, "w") as fh:
        fh.write("one\ntw")
    reader.poll()
    assert capsys.readouterr().out == "[rank 0] one\n"
    with open(path, "a") as fh:
        fh.write("o\nthree before the rotation\n")
    os.replace(path, path + ".1")  # what output_log does at its cap
    with open(path, "w") as fh:
        fh.write("four\r\n40%\r100%\nfive")
    reader.finish()
    assert capsys.readouterr().out == ("[rank 0] two\n[rank 0] three before the rotation\n[rank 0] four\n"
                                       "[rank 0] 100%\n[rank 0] five\n")
    reader.close()


def test_the_cap_is_per_launch(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(echo, "ECHO_LINES", 2)
    path = str(tmp_path / "rank3.log")
    with open(path, "w") as fh:
        fh.write("a\nb\nc\nd\n")
    reader = RankEcho(path, 3)
    reader.finish()
    assert not reader.shown_all
    assert capsys.readouterr().out.splitlines() == [
        "[rank 3] a", "[rank 3] b",
        "[rank 3] ... further lines not shown (ECHO_LINES = 2 per rank and launch, in ddp_helpers/ranks/output_shown.py; "
        "launch(quiet=True) shows none)",
        "[rank 3] ... 2 more lines not shown"]
    reader.close()


def test_a_cell_function_keeps_its_file_name_on_the_way_to_the_ranks():
    """cloudpickle would name its code (and a lambda's inside it) "<dynamic-code>": no cell could be named."""
    import pickle

    from ddp_helpers.ranks.starting import dumps

    ns = {"__name__": "__main__"}
    exec(compile("def f(x):\n    g = lambda y: 1 / y\n    return g(x)\n", "/tmp/ipykernel_1/123.py", "exec"), ns)
    f = pickle.loads(dumps(ns["f"]))
    inner = [c for c in f.__code__.co_consts if hasattr(c, "co_filename")]
    assert f.__code__.co_filename == "/tmp/ipykernel_1/123.py" and inner[0].co_filename == f.__code__.co_filename
    with pytest.raises(ZeroDivisionError) as info:
        f(0)
    assert [str(t.path) for t in info.traceback][-2:] == ["/tmp/ipykernel_1/123.py"] * 2


CELL = '''\
import warnings
from ddp_helpers import RankFailedError, launch

def fails_on_rank_1(rank, world_size):
    print("hello from rank", rank)
    warnings.warn("look here")
    if rank == 1:
        raise ValueError("broken on purpose")
    return rank

try:
    launch(fails_on_rank_1, 2)
except RankFailedError as e:
    print("ERROR:", e)
'''


@pytest.mark.slow
def test_in_a_real_kernel_prints_reach_the_cell_and_the_traceback_names_the_cell():
    from tests._kernel import cell_outputs

    text = "".join(o.get("text", "") for o in cell_outputs(CELL) if o["msg_type"] == "stream")
    for rank in (0, 1):
        assert f"[rank {rank}] hello from rank {rank}" in text
        assert f"[rank {rank}] Cell In[1], line 6: UserWarning: look here" in text
    trace = text.split("--- traceback from rank 1 ---", 1)[1]
    assert 'Cell In[1], line 8, in fails_on_rank_1\n    raise ValueError("broken on purpose")' in trace
    assert "<dynamic-code>" not in text and "ipykernel_" not in text
