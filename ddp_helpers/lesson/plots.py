"""Figures that show the synchronization: per-rank losses, local vs synced gradient norms, fingerprints, shards.

Each function returns a matplotlib Figure built without pyplot, so a notebook shows it exactly once
(as the cell's value) and scripts can save it with fig.savefig(...).
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import numpy as np
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from ..engine.result import TrainResult

RANK_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def _color(rank: int) -> str:
    return RANK_COLORS[rank % len(RANK_COLORS)]


def _smooth(y: np.ndarray, window: int) -> np.ndarray:
    if window <= 1 or len(y) < window:
        return y
    kernel = np.ones(window) / window
    return np.convolve(y, kernel, mode="valid")


def plot_losses(result: TrainResult, reference_loss: Optional[np.ndarray] = None, smooth: int = 1) -> Figure:
    """Each rank's loss per step (different data, so different curves), optionally with a one-process reference."""
    fig = Figure(figsize=(7, 3.6), dpi=150, layout="constrained")
    ax = fig.add_subplot()
    for r in result.ranks:
        y = _smooth(r.loss, smooth)
        ax.plot(r.step[len(r.step) - len(y):], y, color=_color(r.rank), lw=1.2, label=f"rank {r.rank}")
    if reference_loss is not None:
        y = _smooth(np.asarray(reference_loss), smooth)
        first = int(result.ranks[0].step[0]) if result.n_steps else 0
        ax.plot(np.arange(first, first + len(y)) + (len(reference_loss) - len(y)), y, color="black", lw=1.0,
                ls="--", label="one process, global batch")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy loss" + (f" ({smooth}-step mean)" if smooth > 1 else ""))
    ax.set_title(f"Per-rank loss ({result.dataset}, {result.world_size} ranks)")
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    return fig


def plot_grad_norms(result: TrainResult, max_steps: Optional[int] = None) -> Figure:
    """Local gradient norms differ by rank; after the all-reduce every rank holds the same gradient."""
    fig = Figure(figsize=(7, 3.6), dpi=150, layout="constrained")
    ax = fig.add_subplot()
    n = result.n_steps if max_steps is None else min(max_steps, result.n_steps)
    for r in result.ranks:
        ax.plot(r.step[:n], r.local_grad_norm[:n], color=_color(r.rank), lw=1.0, alpha=0.8,
                label=f"rank {r.rank}: local (before all-reduce)")
    for r in result.ranks:
        ax.plot(r.step[:n], r.synced_grad_norm[:n], color="black" if r.rank == 0 else _color(r.rank),
                lw=2.2 if r.rank == 0 else 1.0, ls="-" if r.rank == 0 else ":",
                label=f"rank {r.rank}: synced (after)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("gradient L2 norm")
    ax.set_title("Local vs synchronized gradient norms")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def plot_fingerprints(result: TrainResult, max_steps: int = 10) -> Figure:
    """After every step each rank's parameter fingerprint, side by side: one value per column, a new one per step.

    Top: the first `max_steps` steps, each cell showing the rank's fingerprint (first 6 hex digits), green where
    it equals rank 0's. Bottom: over all steps, how many ranks hold parameters that differ from rank 0's (a
    sentence instead when none ever does).
    """
    n, w = min(max_steps, result.n_steps), result.world_size
    ref = result.ranks[0].param_fingerprint
    fig = Figure(figsize=(7.5, 1.9 + 0.42 * w), dpi=150, layout="constrained")
    ax, ax2 = fig.subplots(2, 1, height_ratios=[max(w, 1), 1.5])
    same = np.array([[r.param_fingerprint[i] == ref[i] for i in range(n)] for r in result.ranks], dtype=float)
    ax.imshow(same.reshape(w, n), cmap=ListedColormap(["#f4a6a6", "#c7e9c0"]), vmin=0, vmax=1, aspect="auto")
    for k, r in enumerate(result.ranks):
        for i in range(n):
            ax.text(i, k, r.param_fingerprint[i][:6], ha="center", va="center", fontsize=6.5, family="monospace")
    steps = result.ranks[0].step
    ax.set_xticks(range(n), [str(int(s)) for s in steps[:n]], fontsize=8)
    ax.set_yticks(range(w), [f"rank {r.rank}" for r in result.ranks])
    ax.set_xticks(np.arange(n + 1) - 0.5, minor=True)
    ax.set_yticks(np.arange(w + 1) - 0.5, minor=True)
    ax.grid(which="minor", color="white", lw=2)  # one cell per (rank, step)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel("step (green: the same fingerprint as rank 0, red: a different one)", fontsize=8)
    distinct = len(set(ref[:result.n_steps]))
    ax.set_title(f"Parameter fingerprint after each step (first {n}): equal down each column, "
                 f"{distinct} different values in {result.n_steps} steps", fontsize=9)
    differing = [sum(r.param_fingerprint[i] != ref[i] for r in result.ranks) for i in range(result.n_steps)]
    if not any(differing):  # a line at 0 says nothing a sentence doesn't: say it
        ax2.axis("off")
        ax2.text(0.5, 0.5, f"all {result.n_steps} steps: every rank's fingerprint equals rank 0's (no step differs)",
                 ha="center", va="center", fontsize=9, transform=ax2.transAxes)
        return fig
    ax2.step(steps[:result.n_steps], differing, where="mid", color="black", lw=1.2)
    ax2.set_ylim(-0.3, max(w - 1, 1) + 0.3)
    ax2.set_yticks(range(max(w - 1, 1) + 1))
    ax2.set_ylabel("ranks that\ndiffer from\nrank 0", fontsize=8)
    ax2.set_xlabel(f"optimizer step (all {result.n_steps} steps)")
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.grid(alpha=0.3)
    return fig


# Owner codes in plot_shard_strip's image: a rank number, or one of these two.
SHARED_BY_RANKS, OWNED_BY_NONE = -1, -2


def shard_owners(indices_by_rank: Sequence[Sequence[int]], n: int) -> np.ndarray:
    """Owner of each sample index 0..n-1: its rank, SHARED_BY_RANKS (padding repeats it) or OWNED_BY_NONE."""
    counts = np.zeros((len(indices_by_rank), n), dtype=np.int64)
    for rank, idx in enumerate(indices_by_rank):
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= n):
            raise ValueError(f"plot_shard_strip: rank {rank} holds an index outside 0..{n - 1}; pass the data set's "
                             "size as n")
        np.add.at(counts[rank], idx, 1)
    owners = np.full(n, OWNED_BY_NONE, dtype=np.int64)
    held = counts > 0
    holders = held.sum(axis=0)  # how many ranks hold each index
    owners[holders == 1] = held.argmax(axis=0)[holders == 1]
    owners[holders > 1] = SHARED_BY_RANKS
    return owners


def plot_shard_strip(epochs: Dict[str, Sequence[Sequence[int]]], n: int, first: Optional[int] = None,
                     title: str = "Which rank reads each sample") -> Figure:
    """One row per epoch (label -> each rank's indices), one cell per sample index, coloured by the owning rank."""
    shown = n if first is None else min(first, n)
    rows = [shard_owners(by_rank, n)[:shown] for by_rank in epochs.values()]
    world_size = max(len(by_rank) for by_rank in epochs.values())
    img = np.array(rows)
    # Colour table indexed by owner code + 2: none (white), several ranks (grey), then rank 0, 1, ...
    colors = ["white", "#9e9e9e"] + [_color(r) for r in range(world_size)]
    fig = Figure(figsize=(7, 0.9 + 0.38 * len(rows)), dpi=150, layout="constrained")
    ax = fig.add_subplot()
    ax.imshow(img, aspect="auto", interpolation="nearest", cmap=ListedColormap(colors),
              norm=BoundaryNorm(np.arange(-2.5, world_size), len(colors)),
              extent=(-0.5, shown - 0.5, len(rows) - 0.5, -0.5))
    if shown <= 120:  # few enough cells to draw their borders: each index reads as one box
        ax.vlines(np.arange(0.5, shown - 1), -0.5, len(rows) - 0.5, color="white", lw=0.6)
    if shown <= 30:
        ax.set_xticks(range(shown))
    ax.hlines(np.arange(0.5, len(rows) - 1), -0.5, shown - 0.5, color="white", lw=2.0)
    ax.set_yticks(range(len(rows)), list(epochs))
    ax.set_xlabel(f"sample index (0 to {shown - 1}" + (f" of {n}" if shown < n else "") + ")")
    ax.set_title(title)
    legend = [Patch(color=_color(r), label=f"rank {r}") for r in range(world_size)]
    if (img == SHARED_BY_RANKS).any():
        legend.append(Patch(color=colors[1], label="several ranks (padding)"))
    if (img == OWNED_BY_NONE).any():
        legend.append(Patch(facecolor="white", edgecolor="black", label="no rank"))
    fig.legend(handles=legend, loc="outside lower center", ncol=len(legend), fontsize=8, frameon=False)
    return fig


def plot_captured_grads(result: TrainResult, step: int = 0, max_points: int = 2000) -> Figure:
    """Scatter of rank 0's vs rank 1's gradient entries at one step, before and after the all-reduce."""
    cap = result.captured_grads[step]
    return plot_gradient_pairs(cap["local"], cap["synced"], step, max_points)


def plot_gradient_pairs(local: np.ndarray, synced: np.ndarray, step: int = 0, max_points: int = 2000) -> Figure:
    """Scatter of rank 0's vs rank 1's gradient entries, before (local) and after (synced) the all-reduce; each
    array holds one row per rank."""
    local, synced = np.asarray(local), np.asarray(synced)
    fig = Figure(figsize=(7, 3.4), dpi=150, layout="constrained")
    a1, a2 = fig.subplots(1, 2, sharex=True, sharey=True)
    m = min(max_points, local.shape[1])
    sel = np.linspace(0, local.shape[1] - 1, m).astype(int)
    other = 1 if local.shape[0] > 1 else 0
    a1.scatter(local[0, sel], local[other, sel], s=4, color=_color(1))
    a1.set_title(f"step {step}: local gradients")
    a2.scatter(synced[0, sel], synced[other, sel], s=4, color="black")
    a2.set_title("after all-reduce")
    for a in (a1, a2):
        lo, hi = float(min(local.min(), synced.min())), float(max(local.max(), synced.max()))
        a.plot([lo, hi], [lo, hi], color="gray", lw=0.8, ls="--")
        a.set_xlabel("rank 0 entry")
    a1.set_ylabel(f"rank {other} entry")
    return fig
