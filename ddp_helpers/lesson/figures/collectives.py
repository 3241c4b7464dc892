"""Who sends what to whom: a collective's tensors on every rank before and after, and the ring
all-reduce's reduce-scatter and all-gather steps (notebooks 0 and 5).

Built without pyplot, so a notebook shows each figure once (as the cell's value).
"""
from __future__ import annotations

import itertools
from typing import Any, Optional, Sequence, Tuple

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch, Patch, Rectangle

from .style import DPI, Diagram, rank_color


def _contributors(value: float, start: np.ndarray, chunk: int) -> Optional[Tuple[int, ...]]:
    """The ranks whose starting chunk values add up to value (None if no subset does): who is in a partial sum."""
    w = start.shape[0]
    for k in range(1, w + 1):
        for subset in itertools.combinations(range(w), k):
            if np.isclose(start[list(subset), chunk].sum(), value, rtol=1e-6, atol=1e-9):
                return subset
    return None


def _fmt(v: float) -> str:
    return f"{v:.0f}" if float(v).is_integer() else f"{v:.3g}"


def ring_received(step: int, rank: int, world_size: int) -> Optional[int]:
    """The chunk rank received in step (1 .. 2(W-1)) of the ring: reduce-scatter, then all-gather; None at 0."""
    if step == 0:
        return None
    if step < world_size:  # reduce-scatter step s: chunk (r - s) from the left, added to its own
        return (rank - step) % world_size
    return (rank - (step - world_size + 1) + 1) % world_size  # all-gather: a finished chunk, copied


RING_BOX = (0.22, 0.78)  # a chunk's box inside its row: the gaps between rows hold the arrows


RING_WRAP_X = -0.5  # where the arrow coming round the ring (last rank -> rank 0) begins, left of rank 0's boxes


RING_MARGIN = 2.4  # room left of rank 0 and right of the last rank for the "from"/"to" labels of that arrow


def ring_arrow_ends(w: int, rank: int, chunk: int, y: float) -> Tuple[Tuple[float, float], Tuple[float, float]]:
    """Where the arrow of a chunk rank received in the row at y starts and ends: from the left neighbour's box
    one row up to this box. Every arrow has the same direction, so no two cross; the one that comes round the
    ring (last rank -> rank 0) starts in the left margin, parallel to the others."""
    head = (rank * (w + 1) + chunk + 0.46, y + RING_BOX[1])
    dx, dy = w + 1, (1 + RING_BOX[0]) - RING_BOX[1]
    if rank == 0:  # cut short of the left margin, which holds its "from rank W-1" label
        cut = min(1.0, (head[0] - RING_WRAP_X) / dx)
        return (head[0] - cut * dx, head[1] + cut * dy), head
    return (head[0] - dx, head[1] + dy), head


def _ring_arrow(ax: Any, w: int, rank: int, chunk: int, y: float) -> None:
    """Draw the arrow of a received chunk; for the wrap round the ring, the sender's end too ("to rank 0")."""
    tail, head = ring_arrow_ends(w, rank, chunk, y)
    style = dict(arrowstyle="-|>", mutation_scale=8, lw=0.9, color="#d62728", shrinkA=0, shrinkB=0)
    ax.add_patch(FancyArrowPatch(tail, head, **style))
    if rank == 0:  # the labels sit beyond the arrow's ends, in the margins, where no arrow or box runs
        ax.text(tail[0] - 0.1, tail[1], f"from rank {w - 1}", ha="right", va="center", fontsize=6,
                color="#d62728")
        sender = ((w - 1) * (w + 1) + chunk + 0.46, head[1] + (1 + RING_BOX[0]) - RING_BOX[1])
        end = (w * (w + 1) + 0.5, sender[1] - (w * (w + 1) + 0.5 - sender[0]) / (w + 1) * (sender[1] - head[1]))
        ax.add_patch(FancyArrowPatch(sender, end, **dict(style, arrowstyle="-")))
        ax.text(end[0] + 0.1, end[1], "to rank 0", ha="left", va="center", fontsize=6, color="#d62728")


def draw_ring(history: Sequence[Sequence[Sequence[float]]]) -> Diagram:
    """The ring all-reduce as real ranks held it: history[rank][step][chunk], step 0 the start, then the W-1
    reduce-scatter steps and the W-1 all-gather steps. Each box is one chunk's value; its colour counts the
    ranks whose values it sums; the chunk a rank received in that step has a thick edge and an arrow from
    its left neighbour."""
    h = np.asarray(history, dtype=float)
    if h.ndim != 3 or h.shape[1] != 2 * h.shape[0] - 1 or h.shape[2] != h.shape[0]:
        raise ValueError("draw_ring needs history[rank][step][chunk] with W ranks, 2W-1 steps (the start, W-1 "
                         f"reduce-scatter, W-1 all-gather) and W chunks; got shape {h.shape}")
    w, steps = h.shape[0], h.shape[1]
    start = h[:, 0, :]
    shades = ["#f7fbff", "#c6dbef", "#6baed6", "#2171b5", "#08306b", "#08306b", "#08306b", "#08306b"]
    fig = Figure(figsize=(0.36 * (w * (w + 1) + 2 * RING_MARGIN + 0.5), 0.55 * steps + 1.5), layout="constrained", dpi=DPI)
    ax = fig.add_subplot()
    for s in range(steps):
        y = steps - 1 - s
        for r in range(w):
            got = ring_received(s, r, w)
            for c in range(w):
                who = _contributors(h[r, s, c], start, c)
                n = len(who) if who else 0
                ax.add_patch(Rectangle((r * (w + 1) + c, y + RING_BOX[0]), 0.92, RING_BOX[1] - RING_BOX[0],
                                       facecolor=shades[min(n, len(shades) - 1)], edgecolor="black",
                                       lw=2.2 if c == got else 0.5))
                ax.text(r * (w + 1) + c + 0.46, y + 0.5, _fmt(h[r, s, c]), ha="center", va="center", fontsize=8,
                        color="white" if n * 2 > w else "black")
            if got is not None:
                _ring_arrow(ax, w, r, got, y)
    labels = ["start"] + [f"reduce-scatter {s}" for s in range(1, w)] + [f"all-gather {s}" for s in range(1, w)]
    ax.set_yticks([steps - 1 - s + 0.5 for s in range(steps)], labels, fontsize=8)
    ax.set_xticks([r * (w + 1) + w / 2 for r in range(w)], [f"rank {r}\n(chunks 0-{w - 1})" for r in range(w)],
                  fontsize=8)
    ax.xaxis.tick_top()
    ax.set_xlim(-RING_MARGIN, w * (w + 1) - 0.5 + RING_MARGIN)
    ax.set_ylim(-0.1, steps + 0.1)
    for side in ("right", "bottom", "left", "top"):
        ax.spines[side].set_visible(False)
    ax.tick_params(length=0)
    handles = [Patch(facecolor=shades[k], edgecolor="black", lw=0.5,
                     label=("one rank's value" if k == 1 else f"sum of {k} ranks' values")
                     + (" (complete)" if k == w else "")) for k in range(1, w + 1)]
    handles.append(Line2D([], [], color="#d62728", lw=0.8, label="received from the left neighbour (thick box)"))
    fig.legend(handles=handles, loc="outside lower center", ncols=3, fontsize=7, frameon=False)
    return Diagram(fig, _ring_alt(h))


def _ring_alt(h: np.ndarray) -> str:
    w = h.shape[0]
    owned = [next((c for c in range(w) if _contributors(h[r, w - 1, c], h[:, 0, :], c) == tuple(range(w))), None)
             for r in range(w)]
    final = ", ".join(_fmt(v) for v in h[0, -1, :])
    return (f"Ring all-reduce of a {w}-chunk tensor on {w} ranks, drawn from the values the ranks held after each "
            f"step: rows are the start, {w - 1} reduce-scatter steps and {w - 1} all-gather steps, one group of "
            f"{w} boxes per rank. In each reduce-scatter step every rank sends one chunk to its right neighbour and "
            f"adds the chunk it receives from its left, so the sums grow by one rank per step; after them "
            + ", ".join(f"rank {r} holds the complete sum of chunk {c}" for r, c in enumerate(owned)) + ". In the "
            f"all-gather steps the complete chunks travel on round the ring and overwrite the partial ones, until "
            f"every rank holds [{final}].")


COLLECTIVE_TITLES = {"all_reduce": "dist.all_reduce(t): every rank ends with the sum of all ranks' t\n"
                                    "(the logical view: no rank or server collects the tensors;\n"
                                    "the ring, drawn below, is how they travel)",
                     "broadcast": "dist.broadcast(t, src={src}): every rank ends with rank {src}'s t"}


def _tensor_row(ax: Any, x0: float, y: float, values: Sequence[float], color: str) -> None:
    """One rank's tensor: a row of boxes with each entry's value printed inside."""
    for i, v in enumerate(values):
        ax.add_patch(Rectangle((x0 + i, y - 0.35), 0.94, 0.7, facecolor=color, edgecolor="black", lw=0.6))
        ax.text(x0 + i + 0.47, y, _fmt(v), ha="center", va="center", fontsize=9)


def draw_collective(op: str, before: Sequence[Sequence[float]], after: Sequence[Sequence[float]],
                    src: int = 0) -> Diagram:
    """Who sends what to whom in one collective, from real ranks' tensors: before[rank] and after[rank] (op
    "all_reduce": every rank's tensor into one sum, the sum to every rank; "broadcast": rank src's to all)."""
    b, a = np.asarray(before, dtype=float), np.asarray(after, dtype=float)
    if op not in COLLECTIVE_TITLES:
        raise ValueError(f"draw_collective: op must be one of {sorted(COLLECTIVE_TITLES)}; got {op!r}")
    if b.ndim != 2 or b.shape != a.shape or b.shape[0] < 2:
        raise ValueError("draw_collective needs before[rank] and after[rank], lists of equal-length tensors for "
                         f"2 or more ranks; got shapes {b.shape} and {a.shape}")
    w, n = b.shape
    if not 0 <= src < w:
        raise ValueError(f"draw_collective: src={src} is not a rank of the {w} drawn")
    gap = 2.6  # room between the columns for the arrows
    lines = COLLECTIVE_TITLES[op].count("\n")
    fig = Figure(figsize=(1.2 + 0.62 * (2 * n + gap), 0.95 + 0.5 * w + 0.2 * lines), layout="constrained",
                 dpi=DPI)
    ax = fig.add_subplot()
    hub = (n + gap / 2, (w - 1) / 2)  # all_reduce: every rank's tensor meets in one sum
    for r in range(w):
        y = w - 1 - r
        _tensor_row(ax, 0, y, b[r], rank_color(r) + "55")
        _tensor_row(ax, n + gap, y, a[r], (rank_color(src) if op == "broadcast" else "#bbbbbb") + "55")
        arrow = dict(arrowstyle="-|>", mutation_scale=9, lw=0.9, shrinkA=0, shrinkB=2)
        if op == "all_reduce":
            ax.add_patch(FancyArrowPatch((n + 0.05, y), hub, color=rank_color(r), **{**arrow, "shrinkB": 12}))
            ax.add_patch(FancyArrowPatch(hub, (n + gap - 0.05, y), color="#555555", **{**arrow, "shrinkA": 12}))
        else:
            ax.add_patch(FancyArrowPatch((n + 0.05, w - 1 - src), (n + gap - 0.05, y), color=rank_color(src), **arrow))
    if op == "all_reduce":
        ax.text(*hub, "sum", ha="center", va="center", fontsize=8, style="italic")  # a result, not a node
    ax.set_yticks(range(w), [f"rank {r}" for r in reversed(range(w))], fontsize=9)
    ax.set_xticks([n / 2, n + gap + n / 2], ["before", "after"], fontsize=9)
    ax.xaxis.tick_top()
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_xlim(-0.1, 2 * n + gap + 0.1)
    ax.set_ylim(-0.6, w - 0.4)
    ax.set_title(COLLECTIVE_TITLES[op].format(src=src), fontsize=9)
    return Diagram(fig, _collective_alt(op, b, a, src))


def _collective_alt(op: str, b: np.ndarray, a: np.ndarray, src: int) -> str:
    vals = lambda row: "[" + ", ".join(_fmt(v) for v in row) + "]"  # noqa: E731
    start = "; ".join(f"rank {r} {vals(row)}" for r, row in enumerate(b))
    same = all(np.array_equal(row, a[0]) for row in a)
    end = (f"every rank holds {vals(a[0])}" if same else
           "; ".join(f"rank {r} {vals(row)}" for r, row in enumerate(a)))
    how = ("each rank's tensor goes into one sum, which every rank receives (the logical view: no rank or "
           "server collects the tensors; a ring of sends between neighbours is how they travel)"
           if op == "all_reduce" else
           f"rank {src}'s tensor goes to every rank and overwrites theirs")
    return (f"{op} on {b.shape[0]} real ranks, one row per rank, each tensor's values in its boxes: before, "
            f"{start}; {how}; after, {end}.")
