"""Which GPU a rank drives: the one rule for every way into a rank (launch(), run_training, torchrun, srun's
tasks, submitit's), and the words for a layout that gives some rank none of its own.

A rank finds its GPU among those it sees: CUDA_VISIBLE_DEVICES (a scheduler's, or a user's) decides which and how
many (torch.cuda.device_count), numbered from 0. Two layouts give every rank a GPU of its own:
- every rank of a node sees the node's GPUs (launch() and run_training on one machine, torchrun's workers, srun
  with --gpus-per-node=N or --gres=gpu:N): local rank i takes cuda:i, as torch's launch utility documents
  ("each process will be operating on a single GPU from GPU 0 to GPU (nproc_per_node - 1)");
- each rank sees one GPU, its own (srun --gpus-per-task=1, --gpu-bind=single:1): cuda:0 in every rank, while
  LOCAL_RANK still counts 0..n-1 (cuda:<LOCAL_RANK> would be "invalid device ordinal" on all but local rank 0).
Only ranks that SLURM started as tasks of their own can see GPUs of their own: the ranks one process starts
(launch()'s, torchrun's agent's) inherit its view, so there one GPU for several ranks is one GPU shared, which
nccl refuses. Any other count (some GPUs, fewer than the node's ranks) is refused with the settings that fix it.
Standard library only at import (torch when GPUs are counted).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from ..common.errors import ConfigError, refused, setting
from .env import SlurmTask, under_torchrun


def visible_gpus() -> int:
    """The GPUs this process sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def own_views(environ: Mapping[str, str] = os.environ) -> bool:
    """True in a task SLURM started as a rank of its own (srun's, submitit's), whose GPUs may be its own; False
    under torchrun's agent or launch(), whose ranks share their starter's view (both set TORCHELASTIC_RUN_ID)."""
    return "TORCHELASTIC_RUN_ID" not in environ and SlurmTask.from_environ(environ) is not None


@dataclass(frozen=True)
class GpuLayout:
    """What a node's ranks see of its GPUs: how many each sees, how many ranks, and whether each has its own view."""

    visible: int  # GPUs this process sees
    local_world_size: int  # ranks on this node
    own_views: bool = False  # each rank sees GPUs of its own (SLURM's tasks), not its starter's

    @classmethod
    def of_rank(cls, environ: Mapping[str, str] = os.environ, rank: int = 0) -> "GpuLayout":
        """This rank's layout, from torchrun's variables (an srun task's read as them: ranks/env.py)."""
        if under_torchrun(environ) and "LOCAL_WORLD_SIZE" in environ:
            ranks = int(environ["LOCAL_WORLD_SIZE"])
        else:
            task = SlurmTask.from_environ(environ)
            ranks = task.local_world_size if task is not None else int(environ.get("WORLD_SIZE", rank + 1))
        return cls(visible_gpus(), ranks, own_views(environ))

    @property
    def fits(self) -> bool:
        """Every rank of the node has a GPU of its own."""
        return self.visible >= self.local_world_size or (self.visible == 1 and self.own_views)

    def index(self, local_rank: int, owner: str = "TrainConfig") -> int:
        """The GPU (cuda:<index>) of the rank numbered local_rank on its node; ConfigError where it has none."""
        if self.visible >= self.local_world_size:
            return local_rank  # every rank sees the node's GPUs: the i-th rank takes the i-th
        if self.visible == 1 and self.own_views:
            return 0  # SLURM showed this task its own GPU, and it is always cuda:0 inside it
        raise self.refusal(owner)

    def refusal(self, owner: str = "TrainConfig") -> ConfigError:
        """backend='nccl' refused for this layout, with what to ask instead."""
        n, ranks = self.visible, self.local_world_size
        if n == 0:
            return refused("backend", "nccl", f"nccl needs CUDA GPUs and none is visible; use "
                                              f"{setting('backend', 'gloo')} (CPU) or 'auto'", owner)
        seen = os.environ.get("CUDA_VISIBLE_DEVICES")
        shown = f" (CUDA_VISIBLE_DEVICES={seen!r})" if seen is not None else ""
        if self.own_views:
            how = (f"each of this node's {ranks} ranks (SLURM's tasks, LOCAL_WORLD_SIZE={ranks}) sees {n} GPUs{shown}, "
                   "neither one of its own nor one for every rank of the node. Ask SLURM for "
                   f"--gpus-per-node={ranks} (every task sees the node's GPUs; a rank takes cuda:<local rank>) or "
                   "--gpus-per-task=1 (each task sees its own GPU as cuda:0)")
        else:
            how = (f"this node's {ranks} ranks (LOCAL_WORLD_SIZE={ranks}) share the {n} GPU(s) torchrun's agent "
                   f"sees{shown}, as its workers inherit its view: give the task that runs torchrun the node's GPUs "
                   f"(SLURM: --gpus-per-node={ranks}, not --gpus-per-task=1) or start {n} rank(s) per node "
                   f"(torchrun --nproc-per-node={n})")
        return ConfigError(f"{setting('backend', 'nccl', owner=owner)} is not accepted: nccl needs one GPU per rank, "
                           f"and {how}; or use {setting('backend', 'gloo')} (CPU)")


def rank_gpu(rank: int, environ: Mapping[str, str] = os.environ) -> int:
    """This rank's GPU index (cuda:<index>), by GpuLayout's rule, from its environment (LOCAL_RANK, else rank)."""
    return GpuLayout.of_rank(environ, rank).index(int(environ.get("LOCAL_RANK", rank)))
