"""How many optimizer steps an epoch has on each rank; no torch, so the command line can size its output first."""
from __future__ import annotations

from .fileio import ceil_div


def steps_per_epoch(n: int, world_size: int, batch_size: int, pipeline: str = "default") -> int:
    """Optimizer steps per epoch on each rank (equal on all ranks, so no rank waits forever)."""
    per_rank = n if pipeline == "seed" else ceil_div(n, world_size)  # the seed listing has no sampler: all n
    return ceil_div(per_rank, batch_size)
