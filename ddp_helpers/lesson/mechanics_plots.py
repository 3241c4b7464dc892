"""Figures for the lessons on buffers and uneven inputs: BatchNorm's running mean per rank, per-rank DDP steps.

Built without pyplot, like plots.py, so a notebook shows each figure once (as the cell's value).
"""
from __future__ import annotations

from typing import Dict, Mapping, Optional, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from .plots import _color

DPI = 150
# What a rank does in one DDP iteration, and how plot_rank_steps draws it.
STEP_STYLES = {
    "trained": dict(color="#1f77b4", label="trains on its own batch"),
    "shadowed": dict(facecolor="white", edgecolor="#1f77b4", hatch="///",
                     label="joined: answers the others' all-reduces with zeros"),
    "blocked": dict(color="#d62728", label="blocked in its all-reduce: no rank answers"),
    "left": dict(color="#e0e0e0", label="left the loop: no collective"),
}


def _sawtooth(at_entry: np.ndarray, after_step: np.ndarray) -> tuple:
    """x and y of one rank's running mean: at step s's entry (x = s - 0.5), then after step s (x = s)."""
    steps = np.arange(1, len(after_step) + 1, dtype=float)
    xs = np.column_stack([steps - 0.5, steps]).reshape(-1)
    ys = np.column_stack([at_entry, after_step]).reshape(-1)
    return xs, ys


def plot_buffer_sync(panels: Dict[str, Sequence[Mapping]], channel: int = 0,
                     reference: Optional[Dict[str, Sequence[float]]] = None) -> Figure:
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
    fig = Figure(figsize=(10, 3.6), layout="constrained", dpi=DPI)
    axes = fig.subplots(1, len(panels), squeeze=False, sharey=True)[0]
    for ax, (title, records) in zip(axes, panels.items()):
        for rank, rec in enumerate(records):
            xs, ys = _sawtooth(np.asarray(rec["at_entry"])[:, channel], np.asarray(rec["after_step"])[:, channel])
            color = _color(rank)
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
    return fig


def plot_rank_steps(panels: Dict[str, Sequence[Sequence[str]]]) -> Figure:
    """One panel per run (title -> per rank, what it did in each DDP iteration): a row of boxes per rank.

    The states are STEP_STYLES' keys: "trained", "shadowed" (joined, answering with zeros), "blocked" (waiting
    in an all-reduce nobody answers) and "left" (out of the loop, issuing no collective).
    """
    if not panels:
        raise ValueError("plot_rank_steps needs at least one panel: {title: [states of rank 0, states of rank 1]}")
    for title, ranks in panels.items():
        for rank, states in enumerate(ranks):
            unknown = sorted(set(states) - set(STEP_STYLES))
            if unknown:
                raise ValueError(f"plot_rank_steps: panel {title!r}, rank {rank}: unknown state(s) {unknown}; "
                                 f"use one of {sorted(STEP_STYLES)}")
    n_steps = max(len(states) for ranks in panels.values() for states in ranks)
    n_rows = sum(len(ranks) for ranks in panels.values())
    fig = Figure(figsize=(7.5, 1.3 + 0.45 * n_rows + 0.4 * len(panels)), layout="constrained", dpi=DPI)
    axes = fig.subplots(len(panels), 1, squeeze=False, sharex=True,
                        gridspec_kw={"height_ratios": [len(r) for r in panels.values()]})[:, 0]
    for ax, (title, ranks) in zip(axes, panels.items()):
        for rank, states in enumerate(ranks):
            y = len(ranks) - 1 - rank  # rank 0 at the top
            for step, state in enumerate(states, start=1):
                ax.broken_barh([(step - 0.45, 0.9)], (y - 0.35, 0.7), **{k: v for k, v in STEP_STYLES[state].items()
                                                                          if k != "label"})
        ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in reversed(range(len(ranks)))], fontsize=8)
        ax.set_ylim(-0.6, len(ranks) - 0.4)
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(1, n_steps + 1))
        ax.xaxis.set_tick_params(labelbottom=True)
        ax.set_xlim(0.4, n_steps + 0.6)
    axes[-1].set_xlabel("DDP iteration (one all-reduce of the gradients each)", fontsize=8)
    used = {s for ranks in panels.values() for states in ranks for s in states}
    handles = [Patch(**STEP_STYLES[s]) for s in STEP_STYLES if s in used]
    fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=7, frameon=False)
    return fig
