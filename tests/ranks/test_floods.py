"""A rank's output can't grow the launcher or its log, nor drive the terminal or the cell (issue 61, N3 and N6).

A rank writing 200 MB without a newline once raised the launching process's memory by 342-400 MB (the echo read
the whole unread log at each poll) and left a 122-200 MiB log against its 4 MiB cap (the cap was looked at every
0.2 s). ESC, BEL, C1 and NUL bytes reached the cell unfiltered: in a terminal a rank could overwrite another
rank's "[rank r]" prefix.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from ddp_helpers import launch
from ddp_helpers.ranks import output_shown as echo
from ddp_helpers.ranks.output_shown import ECHO_LINE_CHARS, RankEcho
from ddp_helpers.ranks.output_log import LOG_CAP_BYTES, printable, read_tail

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FLOOD = textwrap.dedent('''
    import json, os, resource, sys
    from ddp_helpers import launch
    from ddp_helpers.ranks.folders import new_run_dir, remove_run_dir
    from ddp_helpers.ranks.folders import log_path

    def flood(rank, world_size, mib):
        chunk = b"x" * 2**20
        for _ in range(mib if rank == 0 else 0):
            os.write(1, chunk)  # no newline, ever: straight to fd 1, as C++ output goes
        return rank

    def peak_mib():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024

    if __name__ == "__main__":
        mib = int(sys.argv[1])
        launch(flood, 2, args=(0,))  # the forkserver and the echo's imports: not the flood's growth
        before = peak_mib()
        run_dir = new_run_dir()
        logs = [log_path(run_dir, 0), log_path(run_dir, 0) + ".1"]
        seen = [0]

        def look():  # the launcher's poll: the largest log file seen while the rank writes
            for path in logs:
                try:
                    seen[0] = max(seen[0], os.stat(path).st_size)
                except OSError:
                    pass

        assert launch(flood, 2, args=(mib,), on_poll=look, run_dir=run_dir) == [0, 1]
        look()
        sizes = [os.stat(p).st_size if os.path.exists(p) else 0 for p in logs]
        remove_run_dir(run_dir)
        print(json.dumps({"grew_mib": peak_mib() - before, "largest": seen[0], "sizes": sizes}))
''')


@pytest.mark.slow
def test_a_flood_without_newlines_grows_neither_the_launcher_nor_the_log(tmp_path):
    """200 MB on fd 1 without a newline: the launcher's peak memory stays flat and no log file passes the cap."""
    script = tmp_path / "flood.py"
    script.write_text(FLOOD)
    out = subprocess.run([sys.executable, str(script), "200"], capture_output=True, text=True, timeout=600,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    shown = [line for line in lines if line.startswith("[rank 0] ")]
    assert shown and shown[0] == "[rank 0] " + "x" * ECHO_LINE_CHARS + " [... cut]", lines[:3]
    figures = json.loads(lines[-1])
    assert figures["grew_mib"] < 50, figures  # was 342-400 MB
    assert figures["largest"] <= LOG_CAP_BYTES and max(figures["sizes"]) <= LOG_CAP_BYTES, figures
    assert sum(figures["sizes"]) > LOG_CAP_BYTES  # the newest output kept: a full set-aside file and the new one


def test_the_echo_reads_a_bounded_amount_per_poll_and_holds_no_long_line_whole(tmp_path, capsys, monkeypatch):
    """A log far larger than a poll's read: each poll reads at most ECHO_READ_BYTES; a line without end is shown
    cut once, the rest of it counted, not held."""
    monkeypatch.setattr(echo, "ECHO_READ_BYTES", 64 * 1024)
    path = str(tmp_path / "rank0.log")
    with open(path, "wb") as fh:
        fh.write(b"y" * (16 * 64 * 1024) + b"\nlast\n")
    reader = RankEcho(path, 0)
    reads = []
    real_read = reader._read
    monkeypatch.setattr(reader, "_read", lambda: reads.append(real_read()) or reads[-1])
    reader.poll()
    assert len(reads[-1]) <= 64 * 1024 and len(reader.pending) <= 4 * ECHO_LINE_CHARS
    for _ in range(20):
        reader.poll()
        assert len(reads[-1]) <= 64 * 1024 and len(reader.pending) <= 4 * ECHO_LINE_CHARS
    reader.finish()
    reader.close()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "[rank 0] " + "y" * ECHO_LINE_CHARS + " [... cut]"
    assert lines[1] == "[rank 0] last"
    assert lines[2] == f"[rank 0] ... 1 line cut at ECHO_LINE_CHARS: {16 * 64 * 1024 - ECHO_LINE_CHARS:,} bytes not shown"


FORGERIES = ["\x1b[1G\x1b[2K[rank 1] forged by rank 0", "over\r[rank 1] written by rank 0", "bell\x07", "nul\x00byte", "c1\x9b31mred", "del\x7f",
             "osc\x1b]0;title\x07", "line\u2028separator", "back\x08space", "tab\tkept"]


def _writes_controls(rank: int, world_size: int) -> int:
    if rank == 0:
        for text in FORGERIES:
            print(text)
    return rank


def test_control_characters_are_escaped_so_no_rank_forges_anothers_prefix(capsys):
    """Every control character but newline and tab reaches the cell escaped (\\x1b ...); each echoed line begins
    with its own rank's prefix and nothing can move the cursor back over it. A carriage return is no exception:
    a line shows what follows its last one (a progress bar's last state), as before, and never the CR itself."""
    launch(_writes_controls, 2)
    out = capsys.readouterr().out
    lines = out.split("\n")[:-1]
    assert all(line.startswith(("[rank 0] ", "[rank 1] ")) for line in lines), lines
    zero = [line[len("[rank 0] "):] for line in lines if line.startswith("[rank 0] ")]
    assert zero == [printable(text.rsplit("\r", 1)[-1]) for text in FORGERIES]
    assert zero[:2] == ["\\x1b[1G\\x1b[2K[rank 1] forged by rank 0", "[rank 1] written by rank 0"]
    assert zero[-1] == "tab\tkept"
    assert not any(ch in out for ch in "\x1b\x07\x00\x9b\x7f\u2028\x08\r")


def test_a_failed_ranks_log_tail_is_escaped_too(tmp_path):
    path = str(tmp_path / "rank0.log")
    with open(path, "w") as fh:
        fh.write("ok\n\x1b[31mred\x07\n")
    assert read_tail(path, 100) == "ok\n\\x1b[31mred\\x07\n"


def _counts(rank: int, world_size: int) -> int:
    print(f"hello from rank {rank}\x07")
    return rank


def test_where_no_pipe_reaches_a_rank_it_writes_its_log_itself(monkeypatch, capsys):
    """Windows' branch (no pipe handed to a rank): the rank sends its output to the log file itself."""
    from ddp_helpers.ranks import launcher

    monkeypatch.setattr(launcher, "keeper_for", lambda paths: None)
    assert launch(_counts, 2) == [0, 1]
    out = capsys.readouterr().out
    assert "[rank 0] hello from rank 0\\x07\n" in out and "[rank 1] hello from rank 1\\x07\n" in out


def _raises_with_controls(rank: int, world_size: int) -> int:
    if rank == 1:
        raise ValueError("\x1b[2K\rforged\x07")
    return rank


def test_a_ranks_error_reaches_the_cell_escaped():
    from ddp_helpers import RankFailedError

    with pytest.raises(RankFailedError) as info:
        launch(_raises_with_controls, 2, quiet=True)
    text = str(info.value)
    assert "ValueError: \\x1b[2K\\rforged\\x07" in text and not any(ch in text for ch in "\x1b\x07\r")
