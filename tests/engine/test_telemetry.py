"""How a run's times are cut into start-up and training loop."""
from __future__ import annotations

import math

from ddp_helpers.engine.result import collect_result
from ddp_helpers.engine.telemetry import RankField, TelemetryBuffers


def _result(firsts, ends, t_launch=10.0, t_done=20.0):
    buf = TelemetryBuffers(world_size=len(firsts), max_steps=4, samples_per_step=2, n_capture=0, n_params=3)
    for r, (first, end) in enumerate(zip(firsts, ends)):
        buf.rank_info[r, RankField.T_FIRST] = first
        buf.rank_info[r, RankField.T_END] = end
    return collect_result(buf, {}, "gloo", "mnist-5k", "test", t_launch, t_done, (), None, 0.0)


def test_loop_starts_when_the_last_rank_starts():
    # Rank 0 reaches its first step 0.5 s before rank 1 and waits there in the all-reduce: that wait is start-up.
    r = _result(firsts=[11.0, 11.5], ends=[14.0, 14.1])
    assert r.startup_s == 1.5
    assert math.isclose(r.loop_time_s, 14.1 - 11.5)
    assert r.startup_s + r.loop_time_s <= r.wall_time_s


def test_loop_of_a_failed_run_counts_the_ranks_that_got_there():
    r = _result(firsts=[11.0, float("nan")], ends=[float("nan"), float("nan")])
    assert r.startup_s == 1.0 and math.isnan(r.loop_time_s)  # nobody finished: no loop time, and no exception
    r = _result(firsts=[11.0, 11.2], ends=[13.0, float("nan")])  # rank 1 died in the loop
    assert math.isclose(r.loop_time_s, 13.0 - 11.2)


def test_a_real_runs_start_up_and_loop_do_not_overlap(small_run):
    assert 0 < small_run.startup_s and 0 < small_run.loop_time_s
    assert small_run.startup_s + small_run.loop_time_s <= small_run.wall_time_s
