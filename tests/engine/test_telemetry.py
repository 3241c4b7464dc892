"""How a run's times are cut into start-up and training loop."""
from __future__ import annotations

import math

import pytest

from ddp_helpers.engine.result import collect_result
from ddp_helpers.engine.telemetry import RankField, RunRows, TableShape, create_rank_tables


@pytest.fixture
def result_of(tmp_path):
    def make(firsts, ends, t_launch=10.0, t_done=20.0):
        for r, (first, end) in enumerate(zip(firsts, ends)):
            info = create_rank_tables(str(tmp_path), r, TableShape(4, 2, 0, 3))["info"]
            info[RankField.T_FIRST], info[RankField.T_END] = first, end
        rows = RunRows(str(tmp_path), len(firsts))
        try:
            return collect_result(rows.all_tables(), {}, "gloo", "mnist-5k", "test", t_launch, t_done, (), None, 0.0)
        finally:
            rows.close()
    return make


def test_loop_starts_when_the_last_rank_starts(result_of):
    # Rank 0 reaches its first step 0.5 s before rank 1 and waits there in the all-reduce: that wait is start-up.
    r = result_of(firsts=[11.0, 11.5], ends=[14.0, 14.1])
    assert r.startup_s == 1.5
    assert math.isclose(r.loop_time_s, 14.1 - 11.5)
    assert r.startup_s + r.loop_time_s <= r.wall_time_s


def test_loop_of_a_failed_run_counts_the_ranks_that_got_there(result_of):
    r = result_of(firsts=[11.0, float("nan")], ends=[float("nan"), float("nan")])
    assert r.startup_s == 1.0 and math.isnan(r.loop_time_s)  # nobody finished: no loop time, and no exception
    r = result_of(firsts=[11.0, 11.2], ends=[13.0, float("nan")])  # rank 1 died in the loop
    assert math.isclose(r.loop_time_s, 13.0 - 11.2)


def test_a_real_runs_start_up_and_loop_do_not_overlap(small_run):
    assert 0 < small_run.startup_s and 0 < small_run.loop_time_s
    assert small_run.startup_s + small_run.loop_time_s <= small_run.wall_time_s
