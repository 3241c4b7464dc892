"""A crashed job resumed from its last checkpoint, drawn on the steps it ran (notebook 6).

Built without pyplot, so a notebook shows each figure once (as the cell's value).
"""
from __future__ import annotations

from typing import Optional, Sequence

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from .style import DPI, Diagram


def draw_resume(crashed_at: int, checkpoints: Sequence[int], total_steps: int, steps_per_epoch: int,
                crashed_rank: Optional[int] = None, final_equal: Optional[bool] = None) -> Diagram:
    """A job that crashed at step crashed_at, with checkpoints written at the given steps, resumed from the
    latest one before the crash and run to total_steps, against the same job never interrupted; final_equal:
    whether the two ended with bitwise equal parameters (said on the figure when given)."""
    before = [c for c in checkpoints if c <= crashed_at]
    if not before:
        raise ValueError(f"draw_resume: no checkpoint at or before step {crashed_at} in {list(checkpoints)}: "
                         "the job would restart from step 0")
    resume = max(before)
    fig = Figure(figsize=(8, 2.4), layout="constrained", dpi=DPI)
    ax = fig.add_subplot()
    rows = (("first run", 0, crashed_at, "#1f77b4"), ("resumed run", resume, total_steps, "#2ca02c"),
            ("never interrupted", 0, total_steps, "#7f7f7f"))
    for i, (label, a, b, color) in enumerate(rows):
        y = 2 - i
        ax.broken_barh([(a, b - a)], (y - 0.3, 0.6), color=color, alpha=0.85)
    ax.broken_barh([(resume, crashed_at - resume)], (2 - 0.3, 0.6), facecolor="none", edgecolor="#d62728",
                   hatch="///", lw=0)
    ax.plot(checkpoints, [2] * len(checkpoints), ls="none", marker="D", ms=6, color="white", mec="black")
    ax.plot([crashed_at], [2], marker="X", ms=11, color="#d62728")
    who = f"rank {crashed_rank} fails" if crashed_rank is not None else "a rank fails"
    ax.text(crashed_at + 0.6, 2.35, f"{who} at step {crashed_at}", fontsize=7, color="#d62728")
    ax.annotate("", xy=(resume, 1.3), xytext=(resume, 1.7), arrowprops=dict(arrowstyle="-|>", color="black"))
    ax.text(resume + 0.6, 1.45, f"loads the step-{resume} checkpoint", fontsize=7)
    if final_equal is not None:
        ax.text(total_steps, 0.5, "final parameters " + ("bitwise equal" if final_equal else "differ"),
                ha="right", va="center", fontsize=7)
    for e in range(steps_per_epoch, total_steps, steps_per_epoch):
        ax.axvline(e, color="black", lw=0.6, ls=":")
        ax.text(e, -0.65, f" epoch {e // steps_per_epoch}", fontsize=7)
    ax.set_yticks([2, 1, 0], [r[0] for r in rows], fontsize=8)
    ax.set_ylim(-0.8, 2.8)
    ax.set_xlim(0, total_steps + 1)
    ax.set_xlabel("optimizer step", fontsize=8)
    handles = [Line2D([], [], ls="none", marker="D", color="white", mec="black", label="checkpoint written by rank 0"),
               Patch(facecolor="none", edgecolor="#d62728", hatch="///", label="steps lost and redone")]
    fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=7, frameon=False)
    alt = (f"Three runs of the same {total_steps}-step job on one step axis. The first run writes checkpoints at "
           f"steps {', '.join(map(str, checkpoints))} and stops when {who} at step {crashed_at}; the resumed run "
           f"loads the checkpoint of step {resume} and trains steps {resume} to {total_steps - 1}, redoing the "
           f"{crashed_at - resume} steps after it, and ends "
           + ("with parameters bitwise equal to those of" if final_equal else
              "with other parameters than" if final_equal is False else "where") +
           " the run that was never interrupted" + (" ends." if final_equal is None else "."))
    return Diagram(fig, alt)
