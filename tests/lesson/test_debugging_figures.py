"""Notebook 12's two sequences drawn from their records: the collectives two ranks' flight recorders paired after
one skipped a step, and a torchrun job's attempts (steps trained, checkpoints, the failure, the resume)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from matplotlib.text import Text

from ddp_helpers.lesson.debugging import agent_events
from ddp_helpers.lesson.figures.debugging import (BUILT, PAIRED, SLIPPED, attempt_failures, collectives_by_step,
                                                  draw_desync, draw_restarts)


def _recorder(steps, rebuilt_at=1):
    """A read_flight_recorder dict of a rank that built DDP and ran `steps`: DDP's three collectives, then per step
    an all_reduce, after the two broadcasts of the rebuilt bucket order in step `rebuilt_at`'s forward."""
    shapes = "_verify_param_shape_across_processes"
    built = [("all_gather", shapes), ("broadcast", shapes),
             ("broadcast", "_sync_params_and_buffers")]
    entries = [{"op": f"gloo:{op}", "by": by, "where": "train_skipping, line 7"} for op, by in built]
    for step in steps:
        issued = [("broadcast", "_pre_forward")] * 2 if step == rebuilt_at else []
        entries += [{"op": f"gloo:{op}", "by": by, "where": "train_skipping, line 15"}
                    for op, by in issued + [("all_reduce", "_engine_run_backward")]]
    entries = [dict(e, seq=i + 1, sizes=[[18]], group="0") for i, e in enumerate(entries)]
    return {"last": len(entries), "groups": {"0": len(entries)}, "entries": entries}


SKIPPING = [list(range(6)), [0, 1, 2, 4, 5]]  # rank 1 skips step 3, as notebook 12's train_skipping


def _artists(diagram, kind: str) -> dict:
    """gid -> artist, of the first axes' patches or lines."""
    return {a.get_gid(): a for a in getattr(diagram.figure.axes[0], kind) if a.get_gid()}


def test_the_recorders_entries_are_placed_by_the_step_that_issued_them():
    placed = collectives_by_step(_recorder(SKIPPING[1])["entries"], SKIPPING[1])
    assert [(s, e["seq"]) for s, e in placed] == [(BUILT, 1), (BUILT, 2), (BUILT, 3), (0, 4), (1, 5), (1, 6), (1, 7),
                                                  (2, 8), (4, 9), (5, 10)]
    with pytest.raises(ValueError, match="5 all_reduce.*for 6 steps"):
        collectives_by_step(_recorder(SKIPPING[1])["entries"], SKIPPING[0])


def test_a_forwards_collective_in_step_0_is_step_0s_not_ddps_construction():
    entries = _recorder([0, 1], rebuilt_at=0)["entries"]
    assert [s for s, _ in collectives_by_step(entries, [0, 1])] == [BUILT] * 3 + [0, 0, 0, 1]


def test_the_pairs_slip_from_the_skipped_step_and_the_last_all_reduce_is_alone():
    d = draw_desync([_recorder(s) for s in SKIPPING], SKIPPING, "peer closed the connection")
    lines, patches = _artists(d, "lines"), _artists(d, "patches")
    pairs = {gid: line for gid, line in lines.items() if gid.startswith("pair")}
    assert sorted(pairs) == sorted(f"pair #{s} ranks 0-1" for s in range(1, 11))  # #11: nobody joins it
    slipped = sorted(gid for gid, line in pairs.items() if line.get_color() == SLIPPED)
    assert slipped == ["pair #10 ranks 0-1", "pair #9 ranks 0-1"]
    assert all(line.get_color() == PAIRED for gid, line in pairs.items() if gid not in slipped)
    # rank 0's #9 stands above rank 1's skipped step 3, and rank 1's #9 below rank 0's #10 (step 4)
    top, bottom = pairs["pair #9 ranks 0-1"].get_xdata()
    skipped = patches["rank 1 skipped step 3"]
    assert top == pytest.approx(skipped.get_x() + skipped.get_width() / 2)
    assert bottom == pytest.approx(pairs["pair #10 ranks 0-1"].get_xdata()[0]) and bottom > top
    assert "unmatched rank 0 #11" in patches and not any(g.startswith("unmatched rank 1") for g in patches)
    assert "rank 1 #11" not in patches and "rank 0 #11" in patches
    texts = [t.get_text() for t in d.figure.findobj(Text)]
    assert "#11: nobody joins it; it ends with 'peer closed the connection'" in texts
    assert "Rank 1 skipped step 3: from #9 on the pairs slip" in d.alt
    assert "Rank 0's #11 (step 5) has no partner, and the job ends: peer closed the connection." in d.alt


def test_ranks_that_skip_nothing_pair_every_collective_in_its_own_step():
    steps = [list(range(4))] * 2
    d = draw_desync([_recorder(s) for s in steps], steps)
    lines, patches = _artists(d, "lines"), _artists(d, "patches")
    assert len(lines) == 9 and all(line.get_color() == PAIRED for line in lines.values())
    assert all(line.get_xdata()[0] == line.get_xdata()[1] for line in lines.values())
    assert not any(g.startswith(("unmatched", "rank 1 skipped", "rank 0 skipped")) for g in patches)
    assert "every pair is of one step. Every collective is paired." in d.alt


def test_on_three_ranks_the_skipping_rank_slips_against_both_and_the_last_one_waits_for_it():
    steps = [[0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 3]]
    d = draw_desync([_recorder(s) for s in steps], steps)
    lines, patches = _artists(d, "lines"), _artists(d, "patches")
    assert [g for g, line in lines.items() if line.get_color() == SLIPPED] == ["pair #8 ranks 1-2"]
    assert {"unmatched rank 0 #9", "unmatched rank 1 #9"} <= set(patches) and "rank 2 #9" not in patches
    assert "Rank 2 skipped step 2: from #8 on the pairs slip: rank 0's #8 of step 2 meets rank 2's #8 of step 3" in d.alt
    assert "Ranks 0 and 1's #9 (step 3) is never joined by rank 2." in d.alt
    assert "#9: rank 2 never joins it" in [t.get_text() for t in d.figure.findobj(Text)]


def test_another_process_groups_entries_are_left_out():
    records = [_recorder(s) for s in SKIPPING]
    helper = dict(records[0]["entries"][0], seq=1, op="gloo:all_reduce", group="1")  # DETAIL's helper group
    records[0] = dict(records[0], entries=[helper] + records[0]["entries"])
    assert "pair #1 ranks 0-1" in _artists(draw_desync(records, SKIPPING), "lines")


def test_the_desync_drawing_refuses_records_it_cant_place():
    with pytest.raises(ValueError, match="one flight recorder record per rank"):
        draw_desync([_recorder([0])], [[0]])
    with pytest.raises(ValueError, match="give the steps this rank ran"):
        draw_desync([_recorder(s) for s in SKIPPING], [SKIPPING[0], SKIPPING[0]])


# The agent's log as torchrun 2.14 writes it, the lines lesson.agent_events keeps among others
AGENT_LOG = """\
I1206 03:08:56.813000 15363 torch/distributed/elastic/agent/server/api.py:553]   restart_count=0
I1206 03:08:56.813000 15363 torch/distributed/elastic/agent/server/api.py:553]   master_addr=localhost
W1206 03:09:01.741000 15363 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 15374 closing signal SIGTERM
E1206 03:09:01.805000 15363 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) local_rank: 1 (pid: 15375) of binary: /usr/bin/python
I1206 03:09:01.805000 15363 torch/distributed/elastic/agent/server/api.py:942] [default] Worker group FAILED. 1/1 attempts left; will restart worker group
I1206 03:09:02.180000 15363 torch/distributed/elastic/agent/server/api.py:553]   restart_count=1
I1206 03:09:07.220000 15363 torch/distributed/elastic/agent/server/api.py:932] [default] worker group successfully finished. Waiting 300 seconds for other agents to finish.
"""


def _attempt(*ranges):
    """A TrainResult's shape as draw_restarts reads it: .ranks[r].rank and .step."""
    return SimpleNamespace(ranks=[SimpleNamespace(rank=r, step=np.arange(a, b, dtype=np.int64))
                                  for r, (a, b) in enumerate(ranges)])


def _row_y(diagram, label: str) -> float:
    ax = diagram.figure.axes[0]
    return dict(zip([t.get_text() for t in ax.get_yticklabels()], ax.get_yticks()))[label]


def _bars(collection) -> list:
    """(first x, last x) of each bar of a broken_barh."""
    return [tuple(np.round(p.get_extents().intervalx, 6)) for p in collection.get_paths()]


CHECKPOINTS = ["ckpt-0000012.pt", "ckpt-0000024.pt", "ckpt-0000036.pt", "ckpt-0000048.pt", "ckpt-0000060.pt",
               "ckpt-0000064.pt", ".ckpt-0000072.pt.tmp"]  # a temp file is no checkpoint


def test_the_restart_timeline_shows_the_steps_each_attempt_trained_and_the_redone_ones():
    d = draw_restarts([_attempt((0, 40), (0, 40)), _attempt((36, 64), (36, 64))], CHECKPOINTS,
                      agent_events(AGENT_LOG))
    ax = d.figure.axes[0]
    bars = {c.get_gid(): c for c in ax.collections}
    assert _bars(bars["trained attempt 0 rank 1"]) == [(0, 40)]
    assert _bars(bars["trained attempt 1 rank 0"]) == [(36, 64)]
    assert _bars(bars["redone attempt 1 rank 0"]) == [(36, 40)] == _bars(bars["redone attempt 1 rank 1"])
    assert not any(g.startswith("redone attempt 0") for g in bars)
    lines = _artists(d, "lines")
    assert list(lines["checkpoints attempt 0"].get_xdata()) == [12, 24, 36]
    assert list(lines["checkpoints attempt 1"].get_xdata()) == [48, 60, 64]
    assert list(lines["checkpoints attempt 0"].get_ydata()) == [_row_y(d, "attempt 0, rank 0")] * 3
    crash, stop = lines["failed attempt 0"], lines["stopped attempt 0"]
    assert (crash.get_xdata()[0], crash.get_ydata()[0]) == (40.5, _row_y(d, "attempt 0, rank 1"))
    assert (stop.get_xdata()[0], stop.get_ydata()[0]) == (40.5, _row_y(d, "attempt 0, rank 0"))
    assert list(lines["resume attempt 1"].get_xdata()) == [36, 36]
    assert not any(g.endswith("attempt 1") and g.startswith(("failed", "stopped")) for g in lines)
    assert ("Attempt 0: ranks 0 and 1 train steps 0-39; rank 0 writes checkpoints after 12, 24 and 36 steps; rank 1 "
            "fails at step 40; the agent stops rank 0 at step 40. Attempt 1 loads ckpt-0000036.pt and resumes at step "
            "36: ranks 0 and 1 train steps 36-63; rank 0 writes checkpoints after 48, 60 and 64 steps.") in d.alt


def test_a_crash_before_the_first_checkpoint_starts_afresh_and_ranks_may_stop_at_other_steps():
    events = ["restart_count=0", "failed (exitcode: -9) local_rank: 0", "restart_count=1"]
    d = draw_restarts([_attempt((0, 5), (0, 7)), _attempt((0, 20), (0, 20))], ["ckpt-0000010.pt", "ckpt-0000020.pt"],
                      events)
    lines = _artists(d, "lines")
    assert lines["failed attempt 0"].get_xdata()[0] == 5.5 and lines["stopped attempt 0"].get_xdata()[0] == 7.5
    assert "checkpoints attempt 0" not in lines and list(lines["checkpoints attempt 1"].get_xdata()) == [10, 20]
    assert _bars({c.get_gid(): c for c in d.figure.axes[0].collections}["redone attempt 1 rank 1"]) == [(0, 7)]
    assert "Attempt 0: rank 0 trains steps 0-4, rank 1 trains steps 0-6" in d.alt
    assert "Attempt 1 finds no checkpoint and starts at step 0: ranks 0 and 1 train steps 0-19" in d.alt
    assert "rank 0 fails at step 5" in d.alt and "the agent stops rank 1 at step 7" in d.alt


def test_a_pruned_checkpoint_is_still_the_one_loaded_and_each_file_has_one_writer():
    # checkpoint_keep=2: ckpt-36 was loaded by attempt 1, then pruned; ckpt-10's step 9 was trained by both
    # attempts (attempt 0 died before its file was whole): only the last one that trained it wrote the file listed
    events = ["restart_count=0", "failed (exitcode: 1) local_rank: 1", "restart_count=1"]
    d = draw_restarts([_attempt((0, 40), (0, 40)), _attempt((36, 64), (36, 64))],
                      ["ckpt-0000060.pt", "ckpt-0000064.pt"], events)
    assert "Attempt 1 loads ckpt-0000036.pt (since removed) and resumes at step 36" in d.alt
    d = draw_restarts([_attempt((0, 10), (0, 10)), _attempt((0, 20), (0, 20))], ["ckpt-0000010.pt"], events)
    lines = _artists(d, "lines")
    assert "checkpoints attempt 0" not in lines and list(lines["checkpoints attempt 1"].get_xdata()) == [10]


def test_the_agents_events_split_into_attempts():
    assert attempt_failures(agent_events(AGENT_LOG)) == [[(1, 1)], []]


def test_the_restart_timeline_refuses_records_of_another_number_of_attempts():
    with pytest.raises(ValueError, match="start 2 attempt.*but 1 attempts"):
        draw_restarts([_attempt((0, 40), (0, 40))], CHECKPOINTS, agent_events(AGENT_LOG))
