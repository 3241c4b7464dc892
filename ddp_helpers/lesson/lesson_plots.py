"""Figures for the bucket-timeline, batch-size and precision lessons: a per-rank Gantt chart, loss curves on two
axes, and losses against a reference run's.

Built without pyplot, like plots.py, so a notebook shows each figure once (as the cell's value).
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from .plots import _color, _smooth

DPI = 150
BUCKET_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
                 "#7f7f7f")
# Where a rank's backward() returned: black, one line style per rank, so no rank line takes a bucket's colour.
RANK_LINES = ("-", "--", "-.", ":")


def _check_marks(record: dict, names: Sequence[str]) -> None:
    missing = [n for n in names if n not in record.get("marks", {})]
    if missing:
        raise ValueError(f"plot_timeline: a record has no {missing} mark(s); set them in the training loop with "
                         "Timeline.mark(...) before returning Timeline.records()")


def _timeline_legend(fig: Figure) -> None:
    """What each bar and line of plot_timeline stands for, below the panels."""
    handles = [Patch(color="#d9d9d9", label="forward"),
               Patch(color="#7f7f7f", label="backward, computing gradients"),
               Patch(facecolor="white", edgecolor="#7f7f7f", hatch="///",
                     label="backward, waiting for the last all-reduces"),
               Patch(color=BUCKET_COLORS[0],
                     label="a bucket (its number): handed to the hook -> its future's callback ran"),
               Line2D([], [], color="black", lw=1.2, ls=RANK_LINES[0], label="rank 0's backward() returned"),
               Line2D([], [], color="black", lw=1.2, ls=RANK_LINES[1], label="rank 1's backward() returned")]
    fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=7, frameon=False)


def plot_timeline(panels: Dict[str, Sequence[dict]], unit_ms: bool = True) -> Figure:
    """One Gantt chart per panel (title -> one Timeline record per rank): compute above, one lane per bucket below.

    For each rank: forward (light grey), backward up to the last bucket's hand-over, i.e. computing gradients
    (dark grey), then backward waiting for the last all-reduces (hatched); below, one bar per bucket from the
    moment DDP handed it to the hook to the moment the callback chained to its future ran (bucket index left
    of the bar); a black line over the rank's own rows, one style per rank, where its backward() returned. The
    panels share one time axis, so bars of the same length take the same time in every panel; a legend below
    says what each mark stands for.
    """
    if not panels:
        raise ValueError("plot_timeline needs at least one panel: {title: [record of rank 0, record of rank 1, ...]}")
    scale = 1e3 if unit_ms else 1.0
    if any(not recs for recs in panels.values()):
        raise ValueError("plot_timeline: every panel needs one record per rank, got an empty list")
    # Each rank: a compute row, one lane per bucket, a gap; each panel as tall as its lanes need.
    heights = [len(recs) * (1.4 + 0.45 * max(len(r["buckets"]) for r in recs)) for recs in panels.values()]
    fig = Figure(figsize=(7.5, 1.5 + 0.32 * sum(heights) + 0.5 * len(panels)), layout="constrained", dpi=DPI)
    axes = fig.subplots(len(panels), 1, squeeze=False, sharex=True, gridspec_kw={"height_ratios": heights})[:, 0]
    for ax, (title, records) in zip(axes, panels.items()):
        rank_h = 1.4 + 0.45 * max(len(r["buckets"]) for r in records)
        ticks = []
        for rank, rec in enumerate(records):
            _check_marks(rec, ("backward_start", "backward_end"))
            m = rec["marks"]
            top = (len(records) - rank) * rank_h  # rank 0 at the top
            y_compute = top - 1.0
            last_handed = max((b["handed"] for b in rec["buckets"]), default=m["backward_end"])
            bars = [((0.0, m["backward_start"]), dict(color="#d9d9d9")),
                    ((m["backward_start"], last_handed), dict(color="#7f7f7f")),
                    ((last_handed, m["backward_end"]), dict(facecolor="white", edgecolor="#7f7f7f", hatch="///"))]
            for (a, b), style in bars:
                ax.broken_barh([(a * scale, (b - a) * scale)], (y_compute, 0.8), **style)
            ticks.append((y_compute + 0.4, f"rank {rank}: fwd | bwd"))
            for lane, b in enumerate(rec["buckets"]):
                y = y_compute - 0.45 * (lane + 1)
                ax.broken_barh([(b["handed"] * scale, (b["done"] - b["handed"]) * scale)], (y, 0.38),
                               color=BUCKET_COLORS[b["index"] % len(BUCKET_COLORS)], alpha=0.9)
                # the number left of the bar: right of it, a rank's backward() line can fall on it
                ax.text(b["handed"] * scale, y + 0.19, f"{b['index']} ", ha="right", va="center", fontsize=9,
                        fontweight="bold")
            if rec["buckets"]:
                ticks.append((y_compute - 0.45 * (len(rec["buckets"]) + 1) / 2 + 0.19, f"rank {rank}: buckets"))
            # over this rank's rows only, so that it crosses no other rank's bars or numbers
            ax.plot([m["backward_end"] * scale] * 2, [y_compute - 0.45 * len(rec["buckets"]), y_compute + 0.8],
                    color="black", lw=1.2, ls=RANK_LINES[rank % len(RANK_LINES)])
        pos, names = zip(*ticks)
        ax.set_yticks(pos, names, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("ms since the iteration started" if unit_ms else "s since the iteration started", fontsize=8)
        ax.xaxis.set_tick_params(labelbottom=True)  # sharex hides the upper panels' tick labels; keep them
        ax.grid(axis="x", alpha=0.3)
    _timeline_legend(fig)
    return fig


def plot_loss_curves(curves: Dict[str, dict], smooth: int = 1, title: Optional[str] = None) -> Figure:
    """Loss against optimizer steps (left) and samples seen (right); curves: label -> {"loss", "global_batch"}.

    A curve may also give "color" and "ls" (line style); smooth > 1 plots a running mean over that many steps.
    """
    if not curves:
        raise ValueError("plot_loss_curves needs at least one curve: {label: {'loss': [...], 'global_batch': B}}")
    for label, c in curves.items():
        missing = [k for k in ("loss", "global_batch") if k not in c]
        if missing:
            raise ValueError(f"plot_loss_curves: curve {label!r} has no {missing}; give each curve its per-step "
                             "'loss' list and its 'global_batch' (samples per optimizer step, all ranks together)")
    fig = Figure(figsize=(9, 3.4), layout="constrained", dpi=DPI)
    ax_steps, ax_samples = fig.subplots(1, 2, sharey=True)
    for i, (label, c) in enumerate(curves.items()):
        loss = _smooth(np.asarray(c["loss"], dtype=float), smooth)
        steps = np.arange(1, len(c["loss"]) + 1)[len(c["loss"]) - len(loss):]
        style = dict(color=c.get("color", _color(i)), ls=c.get("ls", "-"), lw=1.2,
                     label=label)
        ax_steps.plot(steps, loss, **style)
        ax_samples.plot(steps * int(c["global_batch"]), loss, **style)
    ylabel = "training loss" + (f" ({smooth}-step mean)" if smooth > 1 else "")
    ax_steps.set(xlabel="optimizer steps", ylabel=ylabel)
    ax_samples.set(xlabel="samples seen (steps x global batch)")
    ax_samples.legend(fontsize=8)
    for ax in (ax_steps, ax_samples):
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def plot_loss_gaps(losses: Dict[str, Sequence[float]], reference: str, title: Optional[str] = None) -> Figure:
    """Top: each run's loss per step (the reference on top, black dashed with markers); below: each other run's
    loss minus the reference run's, per step.

    Runs that agree closely draw one line at the top; the lower panel shows how far apart they are (0: the
    same number at that step), so "close, not bitwise" can be seen. losses: label -> per-step losses.
    """
    if reference not in losses or len(losses) < 2:
        raise ValueError(f"plot_loss_gaps needs the reference run {reference!r} and at least one other: "
                         f"{{label: per-step losses}}, got {list(losses)}")
    ref = np.asarray(losses[reference], dtype=float)
    fig = Figure(figsize=(6.4, 6.4), layout="constrained", dpi=DPI)  # stacked: reads on a phone
    ax_loss, ax_gap = fig.subplots(2, 1, sharex=True)
    for i, (label, loss) in enumerate(losses.items()):
        loss = np.asarray(loss, dtype=float)
        steps = np.arange(1, len(loss) + 1)
        if label == reference:  # drawn last and on top, black and dashed with markers: never hidden by the others
            ax_loss.plot(steps, loss, color="black", lw=1.6, ls="--", marker="o", markersize=3, zorder=5,
                         label=f"{label} (reference)")
            continue
        ax_loss.plot(steps, loss, color=_color(i), lw=1.2, label=label)
        n = min(len(loss), len(ref))
        ax_gap.plot(steps[:n], loss[:n] - ref[:n], color=_color(i), lw=1.2, marker="o", markersize=2.5,
                    label=f"{label} - {reference}")
    ax_gap.axhline(0.0, color="black", lw=1.2, ls="--", label=f"{reference} (0)", zorder=5)
    ax_loss.set(xlabel="optimizer steps", ylabel="training loss")
    ax_gap.set(xlabel="optimizer steps", ylabel=f"loss minus the {reference} run's loss")
    for ax in (ax_loss, ax_gap):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig
