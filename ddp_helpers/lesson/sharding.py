"""What one rank holds under DDP, ZeroRedundancyOptimizer and FSDP2: the bytes of its parameters, gradients
and optimizer state (sharded DTensors counted by their local shard), and a figure of them against total / W.
"""
from __future__ import annotations

from typing import Dict, Iterable, Mapping, Sequence

import numpy as np
import torch

from .figures.style import Plot, listed, rank_color

PARTS = ("parameters", "gradients", "optimizer state")


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard on this rank (FSDP2's parameters, gradients and Adam moments); a plain tensor as is."""
    return t.to_local() if hasattr(t, "to_local") else t


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes this rank stores for the tensors (the local shard of each DTensor)."""
    return sum(_local(t).numel() * _local(t).element_size() for t in tensors)


def rank_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Dict[str, int]:
    """{"parameters", "gradients", "optimizer state"}: bytes this rank holds for each.

    The optimizer state counts the per-element tensors (Adam's exp_avg and exp_avg_sq), not the 0-dim step
    counters; a ZeroRedundancyOptimizer's state is its local optimizer's (`.optim`): the shard this rank updates.
    """
    params = list(model.parameters())
    local_optim = getattr(optimizer, "optim", optimizer)
    state = [v for s in local_optim.state.values() for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0]
    return {"parameters": tensor_bytes(params),
            "gradients": tensor_bytes(p.grad for p in params if p.grad is not None),
            "optimizer state": tensor_bytes(state)}


def plot_rank_bytes(per_rank: Mapping[str, Mapping[int, Sequence[Mapping[str, int]]]],
                    total: Mapping[str, int]) -> Plot:
    """One panel per part: for each world size W, one bar per method side by side (its largest rank's bytes, the
    fraction of one full copy written on it), a tick at its smallest rank's, and total / W as a dotted line.

    Bars side by side, not lines: methods that hold the same bytes (DDP and ZeRO's parameters) would draw one
    line on top of the other. per_rank: method -> {W: [rank_bytes() of rank 0, rank 1, ...]}; total: one full
    copy's bytes of each part.
    """
    if not per_rank:
        raise ValueError("plot_rank_bytes needs {method: {world_size: [rank_bytes(...) per rank]}}")
    sizes = sorted({w for runs in per_rank.values() for w in runs})
    width = 0.8 / len(per_rank)
    fig = Plot(figsize=(6.4, 2.3 * len(PARTS) + 1.0), layout="constrained", dpi=150)
    axes = fig.subplots(len(PARTS), 1, sharey=True)  # stacked: each panel reads at a phone's width
    for ax, part in zip(axes, PARTS):
        for i, (method, runs) in enumerate(per_rank.items()):
            at = [sizes.index(w) + (i - (len(per_rank) - 1) / 2) * width for w in sorted(runs)]
            hi = np.array([max(r[part] for r in runs[w]) for w in sorted(runs)]) / 1e6
            lo = np.array([min(r[part] for r in runs[w]) for w in sorted(runs)]) / 1e6
            ax.bar(at, hi, width * 0.92, color=rank_color(i), label=f"{method} (largest rank)")
            ax.scatter(at, lo, marker="_", s=120, color="black", zorder=4,
                       label="smallest rank" if i == 0 else None)
            for x, h in zip(at, hi):
                ax.text(x, h, f"{h * 1e6 / total[part]:.2g}", ha="center", va="bottom", fontsize=8)
        for j, w in enumerate(sizes):
            ax.hlines(total[part] / w / 1e6, j - 0.45, j + 0.45, color="black", ls=":", lw=1.4, zorder=5,
                      label="total / W" if j == 0 else None)
        ax.set_xticks(range(len(sizes)), [f"W = {w}" for w in sizes], fontsize=10)
        ax.tick_params(axis="both", labelsize=10, width=1.0, length=4, color="black")
        ax.set_title(part, fontsize=11)
        ax.set_ylabel("MB on one rank", fontsize=10)
        ax.grid(axis="y", alpha=0.6, color="#888888")
    handles, labels = axes[-1].get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda k: (labels[k] in ("smallest rank", "total / W"), k))  # bars first
    fig.legend([handles[k] for k in order], [labels[k] for k in order], loc="outside lower center",
               ncols=3, fontsize=9, frameon=False)
    fig.suptitle("what one rank holds: the largest rank (bar, with its fraction\nof one full copy), the smallest "
                 "(tick)", fontsize=10)
    return fig.describe(_rank_bytes_alt(per_rank, total, sizes))


def _rank_bytes_alt(per_rank: Mapping[str, Mapping[int, Sequence[Mapping[str, int]]]], total: Mapping[str, int],
                    sizes: Sequence[int]) -> str:
    """The bars in words: at the largest world size, each method's largest rank's fraction of one full copy."""
    w = sizes[-1]
    said = "; ".join(f"{part}: " + ", ".join(f"{method} {max(r[part] for r in runs[w]) / total[part]:.2g}"
                                             for method, runs in per_rank.items() if w in runs) for part in PARTS)
    return (f"Three stacked bar charts ({listed(list(PARTS))}) of the megabytes one rank holds at "
            f"{listed([f'W = {s}' for s in sizes])}: one bar per method ({listed(list(per_rank))}) for its largest "
            f"rank, labelled with its fraction of one full copy, a tick for its smallest rank, and total / W "
            f"dotted. At W = {w}, the largest rank's fraction of one full copy is {said}.")
