"""A failing torchrun rank writes the job's partial result only once its peers have recorded the steps they
finished together with it (under load a peer can still be writing the last one's row)."""
from __future__ import annotations

from typing import List

from ddp_helpers.cli.torchrun import Leaver, wait_for_peer_rows
from ddp_helpers.ranks.report import Report


class _Rows:
    """Two ranks' step counts: rank 1 (the failing one) has 40, rank 0 reaches 40 at its 5th read."""

    world_size = 2

    def __init__(self, behind: int = 39, catches_up: bool = True):
        self.counts, self.reads, self.catches_up = {0: behind, 1: 40}, 0, catches_up

    def count(self, rank: int) -> int:
        if rank == 0:
            self.reads += 1
            if self.reads == 5 and self.catches_up:
                self.counts[0] = 40  # rank 0 has written the row of step 39
        return self.counts[rank]

    def missing(self) -> List[int]:
        return []


class _Partial:
    def __init__(self, counts):
        self.counts, self.notes = counts, []

    def save(self, path: str) -> str:
        return path


class _Job:
    class cfg:
        world_size = 2

    def __init__(self, rows: _Rows):
        self.rows, self.partials = rows, []

    def result(self, complete: bool) -> _Partial:
        self.partials.append(_Partial(dict(self.rows.counts)))
        return self.partials[-1]


def test_the_partial_result_waits_for_the_peers_last_row(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    job = _Job(_Rows())
    Leaver(job, rank=1, out=str(tmp_path), run_dir=str(tmp_path)).leave(Report(False, text="fault at step 40"))
    (partial,) = job.partials
    assert partial.counts == {0: 40, 1: 40}  # rank 0's step 39 is in it


def test_a_peer_that_stopped_earlier_is_not_waited_for_forever():
    rows = _Rows(behind=30, catches_up=False)
    wait_for_peer_rows(rows, rank=1, stall_s=0.05)  # returns once no count has moved for stall_s
    assert rows.counts[0] == 30 and rows.reads > 1
