"""Who holds what under DDP, ZeRO and FSDP2, in bytes per rank (notebook 12).

Built without pyplot, so a notebook shows each figure once (as the cell's value).
"""
from __future__ import annotations

from typing import Mapping, Sequence

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from .style import DPI, Diagram


PART_COLORS = {"parameters": "#1f77b4", "gradients": "#ff7f0e", "optimizer state": "#2ca02c"}


def draw_holdings(per_rank: Mapping[str, Sequence[Mapping[str, int]]], total: Mapping[str, int]) -> Diagram:
    """One panel per method (name -> one rank_bytes() per rank, lesson.sharding): what each rank holds of the
    parameters, gradients and optimizer state, stacked, against one full copy of all three (dashed)."""
    if not per_rank or any(not ranks for ranks in per_rank.values()):
        raise ValueError("draw_holdings needs {method: [rank_bytes() of rank 0, rank 1, ...]}, none empty")
    missing = [p for p in PART_COLORS if p not in total]
    if missing:
        raise ValueError(f"draw_holdings: total lacks {missing}: give one full copy's bytes of each part")
    full = sum(total[p] for p in PART_COLORS) / 1e6
    fig = Figure(figsize=(6.4, 2.0 * len(per_rank) + 0.9), layout="constrained", dpi=DPI)
    axes = fig.subplots(len(per_rank), 1, sharey=True, squeeze=False)[:, 0]  # stacked: every panel on a phone
    for ax, (method, ranks) in zip(axes, per_rank.items()):
        for r, held in enumerate(ranks):
            bottom = 0.0
            for part, color in PART_COLORS.items():
                mb = held.get(part, 0) / 1e6
                ax.bar(r, mb, bottom=bottom, color=color, width=0.7)
                bottom += mb
        ax.axhline(full, color="black", ls="--", lw=0.8)
        ax.set_xticks(range(len(ranks)), [f"rank {r}" for r in range(len(ranks))], fontsize=9)
        ax.set_title(method, fontsize=10)
        ax.set_ylabel("MB held", fontsize=9)
    handles = [Patch(color=c, label=p) for p, c in PART_COLORS.items()]
    handles.append(Line2D([], [], color="black", ls="--", lw=0.8, label="one full copy of all three"))
    fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=8, frameon=False)
    alt = "What each rank holds, stacked (parameters, gradients, optimizer state), against one full copy of " \
          f"{full:.2f} MB. " + " ".join(
              f"{method}: " + ", ".join(f"rank {r} {sum(h.get(p, 0) for p in PART_COLORS) / 1e6:.2f} MB"
                                        for r, h in enumerate(ranks)) + "."
              for method, ranks in per_rank.items())
    return Diagram(fig, alt)
