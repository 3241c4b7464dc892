"""The buffer and uneven-input lessons' figures: what they draw from the records, and bad records named."""
from __future__ import annotations

import numpy as np
import pytest
from matplotlib.figure import Figure

from ddp_helpers.lesson.figures.uneven_inputs import STEP_STYLES, plot_rank_steps
from ddp_helpers.lesson.figures.buffers import plot_buffer_sync


def _run(entry, after):
    return {"at_entry": np.array(entry, dtype=float)[:, None], "after_step": np.array(after, dtype=float)[:, None]}


def test_buffer_sync_draws_each_rank_through_its_entry_and_after_step_values():
    r0, r1 = _run([0, 1, 2], [1, 2, 3]), _run([0, 1, 2], [5, 6, 7])
    fig = plot_buffer_sync({"sync on": [r0, r1]}, reference={"sync on": [3, 4, 5]})
    assert isinstance(fig, Figure) and fig.dpi >= 150
    ax = fig.axes[0]
    line = ax.lines[0]  # rank 0's line: entry of step s at s - 0.5, after step s at s
    assert list(line.get_xdata()) == [0.5, 1, 1.5, 2, 2.5, 3]
    assert list(line.get_ydata()) == [0, 1, 1, 2, 2, 3]
    hollow = ax.lines[1]
    assert list(hollow.get_ydata()) == [0, 1, 2] and hollow.get_markerfacecolor() == "white"
    assert list(ax.lines[3].get_ydata()) == [0, 5, 1, 6, 2, 7]  # rank 1 meets rank 0 at every entry
    assert list(ax.lines[-1].get_ydata()) == [3, 4, 5] and ax.lines[-1].get_linestyle() == "--"
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "after the step" in legend and any("receives it" in t for t in legend)


def test_buffer_sync_names_what_a_record_lacks():
    with pytest.raises(ValueError, match="after_step"):
        plot_buffer_sync({"x": [{"at_entry": np.zeros((2, 1))}]})
    with pytest.raises(ValueError, match="differ in shape"):
        plot_buffer_sync({"x": [{"at_entry": np.zeros((2, 1)), "after_step": np.zeros((3, 1))}]})
    with pytest.raises(ValueError, match="at least one panel"):
        plot_buffer_sync({})


def test_rank_steps_draws_one_box_per_iteration_in_its_state_style():
    fig = plot_rank_steps({"without Join": [["trained"] * 3 + ["left"] * 2, ["trained"] * 3 + ["blocked"]],
                           "with Join": [["trained"] * 3 + ["shadowed"] * 2, ["trained"] * 5]})
    top, bottom = fig.axes
    assert len(top.collections) == 5 + 4 and len(bottom.collections) == 5 + 5
    hatched = [c for c in bottom.collections if c.get_hatch()]
    assert len(hatched) == 2, "rank 0's two shadowed iterations"
    assert [t.get_text() for t in top.get_yticklabels()] == ["rank 1", "rank 0"]  # rank 0 drawn at the top
    assert top.get_xlim() == bottom.get_xlim()
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert legend == [STEP_STYLES[s]["label"] for s in ("trained", "shadowed", "blocked", "left")]


def test_rank_steps_refuses_an_unknown_state_by_name():
    with pytest.raises(ValueError, match=r"unknown state\(s\) \['waiting'\].*'shadowed'"):
        plot_rank_steps({"x": [["trained", "waiting"]]})
    with pytest.raises(ValueError, match="at least one panel"):
        plot_rank_steps({})
