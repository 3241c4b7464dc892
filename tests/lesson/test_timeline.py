"""Per-bucket timestamps: timed() records every bucket DDP hands over without changing the result, waiting()
removes the overlap, the record helpers read them right, and the lesson's figures are drawn from them."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from matplotlib.figure import Figure
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_helpers import launch
from ddp_helpers.lesson import timeline
from ddp_helpers.lesson.figures.training import plot_loss_curves
from ddp_helpers.lesson.figures.buckets import plot_timeline


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 4))


def _traced(rank, world_size, mode, steps=3):
    """Three DDP iterations with a 0.25 MB cap; the hook is timed, timed+waiting, or DDP's built-in all-reduce."""
    model = _mlp()
    ddp = DDP(model, bucket_cap_mb=0.25)
    state = timeline.Timeline(model)
    if mode == "timed":
        ddp.register_comm_hook(state, timeline.timed(allreduce_hook))
    elif mode == "waiting":
        ddp.register_comm_hook(state, timeline.timed(timeline.waiting(allreduce_hook)))
    gen = torch.Generator().manual_seed(rank)
    grads = []
    for _ in range(steps):
        x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 4, (32,), generator=gen)
        state.start_iteration()
        loss = F.cross_entropy(ddp(x), y)
        state.mark("backward_start")
        loss.backward()
        state.mark("backward_end")
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().copy())
        ddp.zero_grad(set_to_none=True)
    return {"records": state.records(), "grads": grads, "n_params": len(list(model.parameters()))}


@pytest.fixture(scope="module")
def timed_run():
    return launch(_traced, world_size=2, args=("timed",), threads_per_rank=1)


def test_first_iteration_one_bucket_then_rebuilt_in_reverse_parameter_order(timed_run):
    for rank_out in timed_run:
        first, second, third = rank_out["records"]
        assert len(first["buckets"]) == 1 and first["buckets"][0]["is_last"]
        # Weights of 256 KB and 64 KB with a 256 KB cap: more than one bucket once rebuilt.
        assert len(second["buckets"]) >= 2
        assert timeline.bucket_params(second) == timeline.bucket_params(third)
        order = [p for ps in timeline.bucket_params(second) for p in ps]
        assert order == list(range(rank_out["n_params"]))[::-1]
        assert [b["index"] for b in second["buckets"]] == list(range(len(second["buckets"])))
        assert [b["is_last"] for b in second["buckets"]] == [False] * (len(second["buckets"]) - 1) + [True]


def test_bucket_bytes_add_up_to_the_gradients(timed_run):
    model = _mlp()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for rec in timed_run[0]["records"]:
        assert sum(b["nbytes"] for b in rec["buckets"]) == total


def test_timestamps_are_ordered_within_each_iteration(timed_run):
    for rank_out in timed_run:
        for rec in rank_out["records"]:
            m = rec["marks"]
            assert m["start"] == 0.0 and 0 < m["backward_start"] < m["backward_end"]
            handed = [b["handed"] for b in rec["buckets"]]
            assert handed == sorted(handed)
            for b in rec["buckets"]:
                assert m["backward_start"] < b["handed"] <= b["returned"]
                assert b["handed"] < b["done"] <= m["backward_end"], "DDP waits for every future inside backward()"


def test_timed_hook_leaves_the_averaged_gradients_as_ddp_computes_them(timed_run):
    plain = launch(_traced, world_size=2, args=("builtin",), threads_per_rank=1)
    for step in range(3):
        np.testing.assert_allclose(timed_run[0]["grads"][step], plain[0]["grads"][step], rtol=1e-6, atol=1e-8)
        assert np.array_equal(timed_run[0]["grads"][step], timed_run[1]["grads"][step])


def test_waiting_hook_finishes_each_all_reduce_before_returning():
    out = launch(_traced, world_size=2, args=("waiting",), threads_per_rank=1)
    for rank_out in out:
        for rec in rank_out["records"]:
            assert not any(timeline.still_running_on_return(rec))
            buckets = rec["buckets"]
            for a, b in zip(buckets, buckets[1:]):
                assert a["done"] <= b["handed"], "no all-reduce may be in flight while the next gradients are computed"


# ---------------------------------------------------------------------------------------------- no ranks
class _FakeBucket:
    def __init__(self, index, params, last):
        self._i, self._p, self._last = index, params, last

    def index(self):
        return self._i

    def buffer(self):
        return torch.cat([p.detach().reshape(-1) for p in self._p])

    def parameters(self):
        return self._p

    def is_last(self):
        return self._last


def test_records_are_relative_to_each_iteration_start():
    ticks = iter([10.0, 10.5, 11.0, 12.0, 20.0, 20.25])
    model = nn.Linear(3, 2)
    state = timeline.Timeline(model, clock=lambda: next(ticks))
    state.start_iteration()  # 10.0
    state.mark("backward_start")  # 10.5
    ev = state.handed(_FakeBucket(0, list(model.parameters())[::-1], True))  # 11.0
    ev["returned"], ev["done"] = 11.5, 13.0
    state.mark("backward_end")  # 12.0
    state.start_iteration()  # 20.0
    state.mark("backward_start")  # 20.25
    first, second = state.records()
    assert first["marks"] == {"start": 0.0, "backward_start": 0.5, "backward_end": 2.0}
    b = first["buckets"][0]
    assert (b["handed"], b["returned"], b["done"]) == (1.0, 1.5, 3.0)
    assert b["params"] == [1, 0] and b["nbytes"] == 8 * 4 and b["is_last"]
    assert second["marks"] == {"start": 0.0, "backward_start": 0.25} and second["buckets"] == []
    assert state.iterations[0]["marks"]["start"] == 10.0, "records() must not change the stored times"


def test_mark_before_start_iteration_is_a_clear_error():
    with pytest.raises(RuntimeError, match="start_iteration"):
        timeline.Timeline(nn.Linear(2, 2)).mark("backward_start")


def _rec(buckets, start=0.0, end=10.0):
    return {"marks": {"start": 0.0, "backward_start": start, "backward_end": end},
            "buckets": [{"index": i, "handed": h, "returned": r, "done": d, "nbytes": 4, "is_last": False,
                         "params": [i]} for i, (h, r, d) in enumerate(buckets)]}


def test_backward_times_and_errors():
    recs = [_rec([], 1.0, 2.0), _rec([], 1.0, 4.0), _rec([], 0.0, 100.0)]
    assert timeline.backward_s(recs[1]) == 3.0
    assert timeline.still_running_on_return(_rec([(1, 1.5, 3), (4, 4.5, 4.2)])) == [True, False]
    with pytest.raises(KeyError, match="backward_end"):
        timeline.backward_s({"marks": {"backward_start": 0.0}, "buckets": []})


def test_plot_timeline_draws_one_lane_per_bucket_and_names_missing_marks():
    recs = [_rec([(1, 1, 3), (2, 2, 5)]), _rec([(1.5, 1.5, 3), (2.5, 2.5, 5)])]
    fig = plot_timeline({"two buckets": recs, "one bucket": [_rec([(8, 8, 9)]), _rec([(8, 8, 9.5)])]})
    assert isinstance(fig, Figure) and len(fig.axes) == 2 and fig.dpi >= 150
    labels = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert labels.count("rank 0: buckets") == 1 and "rank 1: fwd | bwd" in labels
    bucket_bars = [c for c in fig.axes[0].collections if c.get_facecolor()[0][3] > 0 and c.get_hatch() is None]
    assert len(bucket_bars) == 2 * (2 + 2), "per rank: forward, computing backward, and one bar per bucket"
    with pytest.raises(ValueError, match="backward_end"):
        plot_timeline({"bad": [{"marks": {"start": 0.0, "backward_start": 1.0}, "buckets": []}]})
    with pytest.raises(ValueError, match="at least one panel"):
        plot_timeline({})


def test_plot_timeline_puts_every_panel_on_one_time_scale_and_names_each_mark():
    short = [_rec([(1, 1, 2)], 0.5, 3.0), _rec([(1, 1, 2)], 0.5, 3.0)]
    long = [_rec([(8, 8, 30)], 5.0, 40.0), _rec([(8, 8, 31)], 5.0, 41.0)]
    fig = plot_timeline({"short": short, "long": long})
    top, bottom = fig.axes
    assert top.get_xlim() == bottom.get_xlim(), "panels on different time scales can't be compared by eye"
    assert all(t.get_visible() for t in top.get_xticklabels()), "the upper panel keeps its time labels"
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert any("backward() returned" in lab for lab in labels), "the dotted lines are explained in the legend"
    assert any("waiting" in lab for lab in labels) and any("forward" == lab for lab in labels)


def test_plot_loss_curves_puts_samples_on_the_second_axis():
    fig = plot_loss_curves({"W=1": {"loss": [3.0, 2.0, 1.0], "global_batch": 64},
                            "W=4": {"loss": [3.0, 1.5, 0.5], "global_batch": 256}})
    ax_steps, ax_samples = fig.axes
    assert list(ax_steps.lines[1].get_xdata()) == [1, 2, 3]
    assert list(ax_samples.lines[1].get_xdata()) == [256, 512, 768]
    assert fig.dpi >= 150
    with pytest.raises(ValueError, match="at least one curve"):
        plot_loss_curves({})
    with pytest.raises(ValueError, match="global_batch"):
        plot_loss_curves({"W=2": {"loss": [1.0]}})
    assert not math.isnan(ax_samples.lines[0].get_ydata()[0])


def test_plot_loss_gaps_draws_each_run_against_the_reference():
    from ddp_helpers.lesson.figures.training import plot_loss_gaps

    fig = plot_loss_gaps({"fp32": [3.0, 2.0, 1.0], "bf16": [3.0, 2.1, 0.9], "hook": [3.0, 2.0, 1.05]}, "fp32")
    ax_loss, ax_gap = fig.axes
    assert len(ax_loss.lines) == 3
    gaps = {line.get_label(): list(np.round(line.get_ydata(), 6)) for line in ax_gap.lines[:2]}
    assert gaps == {"bf16 - fp32": [0.0, 0.1, -0.1], "hook - fp32": [0.0, 0.0, 0.05]}
    with pytest.raises(ValueError, match="reference run 'fp64'"):
        plot_loss_gaps({"fp32": [1.0], "bf16": [1.0]}, "fp64")
