"""A failed 2-node job's partial results merged on a shared --out (engine/partials.py): every rank's rows that any
node saw, and the blame of the node that knows, whichever node writes last (issue 57: the last writer won, with
the wrong rows and the wrong rank blamed in 3 of 3 cases)."""
from __future__ import annotations

import numpy as np

from ddp_helpers import RankRecords, TrainResult
from ddp_helpers.engine.partials import INFERRED, OWN, SCHEDULER, merge_partials, same_attempt


def _rows(rank: int, n: int) -> RankRecords:
    f = np.arange(n, dtype=np.float64)
    return RankRecords(rank, np.arange(n), f + rank, f, f, ["0" * 16] * n, ["1" * 16] * n,
                       np.zeros((n, 4), np.int32), f, f)


def _node_view(seen: int, counts, failure: dict, job: str = "j1") -> TrainResult:
    """What one node's surviving rank writes: its own rank's rows, none of the other node's."""
    ranks = [_rows(r, counts[r] if r == seen else 0) for r in range(2)]
    return TrainResult({}, "gloo", "mnist-5k", "", ranks, 0.5 if seen == 0 else float("nan"), 1.0, 0.1, 0.9,
                       [100.0 if r == seen else float("nan") for r in range(2)], 50.0, [0.0, 0.0], [0, 0],
                       notes=["data note", failure["note"]], complete=False,
                       final_params=np.ones(3) if seen == 0 else None,
                       provenance={"job": job, "attempt": "0", "seen": [seen], "writers": [seen],
                                   "failure": failure, "failure_note": failure["note"]})


RAISED = {"rank": 1, "message": "ValueError: bad batch", "weight": OWN, "note": "attempt 0 failed: rank 1: ValueError"}
GUESSED = {"rank": 1, "message": "reported nothing", "weight": INFERRED, "note": "attempt 0 failed: rank 1 (on n2)"}
WRONG = {"rank": 0, "message": "reported nothing", "weight": INFERRED, "note": "attempt 0 failed: rank 0 (on n1)"}


def test_either_order_keeps_both_nodes_rows_and_the_raising_rank():
    node1, node2 = _node_view(0, [7, 0], GUESSED), _node_view(1, [0, 7], RAISED)
    for first, last in ((node1, node2), (node2, node1)):
        merged = merge_partials(first, last)
        assert [len(r) for r in merged.ranks] == [7, 7]
        assert merged.provenance["failure"] == RAISED and RAISED["note"] in merged.notes
        assert GUESSED["note"] not in merged.notes and merged.notes.count("data note") == 1
        assert merged.final_params is not None and merged.test_accuracy == 0.5  # rank 0's node gives them
        assert merged.peak_rss_mb == [100.0, 100.0] and sorted(merged.provenance["writers"]) == [0, 1]


def test_the_scheduler_outranks_a_guess_and_equal_guesses_blame_the_lowest_rank():
    stopped = {"rank": None, "message": "the scheduler stopped the job", "weight": SCHEDULER, "note": "scheduler"}
    assert merge_partials(_node_view(0, [3, 0], stopped), _node_view(1, [0, 3], GUESSED)).provenance["failure"] \
        == stopped
    assert merge_partials(_node_view(0, [3, 0], GUESSED), _node_view(1, [0, 3], WRONG)).provenance["failure"] \
        == WRONG


def test_another_jobs_or_attempts_file_is_not_merged():
    mine = _node_view(0, [3, 0], GUESSED)
    assert same_attempt(mine, _node_view(1, [0, 3], RAISED))
    assert not same_attempt(mine, _node_view(1, [0, 3], RAISED, job="j2"))
    finished = _node_view(1, [0, 3], RAISED)
    finished.complete = True
    assert not same_attempt(mine, finished)
