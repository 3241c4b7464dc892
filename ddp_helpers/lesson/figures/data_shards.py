"""Which rank reads which sample: the data split drawn epoch by epoch (notebooks 0 and 2).

Built without pyplot, so a notebook shows each figure once (as the cell's value).
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import numpy as np
from matplotlib.colors import BoundaryNorm, ListedColormap
from matplotlib.patches import Patch

from .style import Plot, listed, rank_color


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
                     title: str = "Which rank reads each sample") -> Plot:
    """One row per epoch (label -> each rank's indices), one cell per sample index, coloured by the owning rank."""
    shown = n if first is None else min(first, n)
    rows = [shard_owners(by_rank, n)[:shown] for by_rank in epochs.values()]
    world_size = max(len(by_rank) for by_rank in epochs.values())
    img = np.array(rows)
    # Colour table indexed by owner code + 2: none (white), several ranks (grey), then rank 0, 1, ...
    colors = ["white", "#9e9e9e"] + [rank_color(r) for r in range(world_size)]
    fig = Plot(figsize=(7, 0.9 + 0.38 * len(rows)), dpi=150, layout="constrained")
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
    legend = [Patch(color=rank_color(r), label=f"rank {r}") for r in range(world_size)]
    if (img == SHARED_BY_RANKS).any():
        legend.append(Patch(color=colors[1], label="several ranks (padding)"))
    if (img == OWNED_BY_NONE).any():
        legend.append(Patch(facecolor="white", edgecolor="black", label="no rank"))
    fig.legend(handles=legend, loc="outside lower center", ncol=len(legend), fontsize=8, frameon=False)
    return fig.describe(_strip_alt(title, list(epochs), rows[0], shown, n, world_size))


def _strip_alt(title: str, labels: Sequence[str], first_row: np.ndarray, shown: int, n: int, world_size: int) -> str:
    """The strip in words: its rows and colours, and how many of the shown samples each rank reads in the first."""
    counts = [f"rank {r} reads {int((first_row == r).sum())}" for r in range(world_size)]
    counts += [f"{int((first_row == code).sum())} {words}" for code, words in
               ((SHARED_BY_RANKS, "are read by several ranks (padding)"), (OWNED_BY_NONE, "by none"))
               if (first_row == code).any()]
    span = f"sample indices 0 to {shown - 1}" + (f" of {n}" if shown < n else "")
    return (f"{' '.join(title.split()).rstrip('.:')}. A strip of {span}, one row per label ({'; '.join(labels)}), "
            f"each index coloured by the rank that reads it. In {labels[0]}, {listed(counts)}.")
