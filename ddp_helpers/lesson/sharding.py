"""What one rank holds under DDP, ZeroRedundancyOptimizer and FSDP2: the bytes of its parameters, gradients
and optimizer state (sharded DTensors counted by their local shard), and a figure of them against total / W.
"""
from __future__ import annotations

from typing import Dict, Iterable, Mapping, Sequence

import numpy as np
import torch
from matplotlib.figure import Figure

from .plots import _color

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
                    total: Mapping[str, int]) -> Figure:
    """One panel per part: the largest and smallest rank's bytes against W for each method, and total / W.

    per_rank: method -> {W: [rank_bytes() of rank 0, rank 1, ...]}; total: one full copy's bytes of each part.
    """
    if not per_rank:
        raise ValueError("plot_rank_bytes needs {method: {world_size: [rank_bytes(...) per rank]}}")
    fig = Figure(figsize=(9, 3.4), layout="constrained", dpi=150)
    axes = fig.subplots(1, len(PARTS), sharey=True)
    for ax, part in zip(axes, PARTS):
        sizes = sorted({w for runs in per_rank.values() for w in runs})
        for i, (method, runs) in enumerate(per_rank.items()):
            ws = sorted(runs)
            hi = np.array([max(r[part] for r in runs[w]) for w in ws]) / 1e6
            lo = np.array([min(r[part] for r in runs[w]) for w in ws]) / 1e6
            # markers and dashes differ too: the methods that hold a full copy draw on top of each other
            ax.plot(ws, hi, marker="osv^D"[i % 5], ls=("-", "--", "-.", ":")[i % 4], color=_color(i), lw=1.2,
                    markersize=7 - i, label=f"{method} (largest rank)")
            ax.fill_between(ws, lo, hi, color=_color(i), alpha=0.15)
        ax.plot(sizes, [total[part] / w / 1e6 for w in sizes], color="black", ls=":", lw=1.6, zorder=5,
                label="total / W")
        ax.set_xticks(sizes)
        ax.set(title=part, xlabel="world size W")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("MB on one rank")
    axes[-1].legend(fontsize=7)
    fig.suptitle("what one rank holds: the largest rank (line), down to the smallest (band)", fontsize=9)
    return fig
