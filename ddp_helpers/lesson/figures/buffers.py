"""Buffers under DDP: BatchNorm's running mean per rank, at entry and after each step (notebook 9).

Built without pyplot, so a notebook shows each figure once (as the cell's value).
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence

import numpy as np
from matplotlib.lines import Line2D

from .style import DPI, Plot, listed, rank_color


def _sawtooth(at_entry: np.ndarray, after_step: np.ndarray) -> tuple:
    """x and y of one rank's running mean: at step s's entry (x = s - 0.5), then after step s (x = s)."""
    steps = np.arange(1, len(after_step) + 1, dtype=float)
    xs = np.column_stack([steps - 0.5, steps]).reshape(-1)
    ys = np.column_stack([at_entry, after_step]).reshape(-1)
    return xs, ys


def plot_buffer_sync(panels: Dict[str, Sequence[Mapping]], channel: int = 0,
                     reference: Optional[Dict[str, Sequence[float]]] = None) -> Plot:
    """One panel per setting (title -> one record per rank): a BatchNorm running-mean channel, step by step.

    A record holds "at_entry" and "after_step", arrays [step, channel]: the running mean as BatchNorm received
    it in the step's forward (after any buffer sync) and after the step. Each rank's line goes through both,
    hollow marker at the entry (x = step - 0.5), filled after the step (x = step), so a sync shows as the
    lines meeting at the hollow markers. reference (title -> one value per step) adds a dashed line.
    """
    if not panels:
        raise ValueError("plot_buffer_sync needs at least one panel: {title: [record of rank 0, record of rank 1]}")
    for title, records in panels.items():
        for rank, rec in enumerate(records):
            missing = [k for k in ("at_entry", "after_step") if k not in rec]
            if missing:
                raise ValueError(f"plot_buffer_sync: panel {title!r}, rank {rank} has no {missing}; record the "
                                 "running mean at BatchNorm's entry (a forward pre-hook) and after each step")
            if np.shape(rec["at_entry"]) != np.shape(rec["after_step"]):
                raise ValueError(f"plot_buffer_sync: panel {title!r}, rank {rank}: at_entry and after_step differ "
                                 f"in shape ({np.shape(rec['at_entry'])} vs {np.shape(rec['after_step'])})")
    fig = Plot(figsize=(10, 3.6), layout="constrained", dpi=DPI)
    axes = fig.subplots(1, len(panels), squeeze=False, sharey=True)[0]
    for ax, (title, records) in zip(axes, panels.items()):
        for rank, rec in enumerate(records):
            xs, ys = _sawtooth(np.asarray(rec["at_entry"])[:, channel], np.asarray(rec["after_step"])[:, channel])
            color = rank_color(rank)
            ax.plot(xs, ys, color=color, lw=1.0, label=f"rank {rank}")
            ax.plot(xs[0::2], ys[0::2], ls="none", marker="o", ms=4, mfc="white", mec=color)
            ax.plot(xs[1::2], ys[1::2], ls="none", marker="o", ms=3, color=color)
        if reference is not None and title in reference:
            ref = np.asarray(reference[title], dtype=float)
            ax.plot(np.arange(1, len(ref) + 1), ref, "k--", lw=1, label="global batch")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"running_mean[{channel}]")
    handles, _ = axes[0].get_legend_handles_labels()
    handles += [Line2D([], [], ls="none", marker="o", ms=4, mfc="white", mec="black",
                       label="as BatchNorm receives it in the step's forward"),
                Line2D([], [], ls="none", marker="o", ms=3, color="black", label="after the step")]
    fig.legend(handles=handles, loc="outside lower center", ncols=len(handles), fontsize=8, frameon=False)
    return fig.describe(_buffer_alt(panels, channel, reference))


def _buffer_alt(panels: Dict[str, Sequence[Mapping]], channel: int,
                reference: Optional[Dict[str, Sequence[float]]]) -> str:
    """The panels in words: per setting, whether every rank's forward received the same running mean."""
    def agreement(records: Sequence[Mapping]) -> str:
        entries = [np.asarray(rec["at_entry"])[:, channel] for rec in records]
        same = all(np.array_equal(e, entries[0]) for e in entries)
        return "every rank's forward receives the same value" if same else "each rank's forward receives its own value"
    steps = max(len(rec["after_step"]) for records in panels.values() for rec in records)
    said = "; ".join(f"{' '.join(title.split())}: {agreement(records)}" for title, records in panels.items())
    dashed = " A dashed line is the value on the global batch." if reference else ""
    return (f"{len(panels)} line chart(s), one per setting ({listed([' '.join(t.split()) for t in panels])}), of "
            f"BatchNorm's running_mean[{channel}] on each rank over {steps} steps: a hollow marker where the step's "
            f"forward receives it, a filled one after the step. {said}.{dashed}")
