"""This process's rank of a job whose ranks something else started: torchrun, srun, or submitit (which runs a
function from a notebook as the tasks of an srun step). The same path as `python -m ddp_helpers.train` under
torchrun (cli/torchrun.py): the rank's rows in its node's run folder, result.json (and a partial result on a
failure) in `out`, which every node must see."""
from __future__ import annotations

import os
from typing import Any, Optional

from ..engine.config import ConfigError, TrainConfig


def default_out() -> str:
    """runs/<SLURM job id> (runs/local outside SLURM), in the working folder."""
    return os.path.join("runs", os.environ.get("SLURM_JOB_ID") or "local")


def run_from_env(cfg: TrainConfig, out: Optional[str] = None, plots: bool = False) -> Optional[Any]:
    """Train as this process's rank, read from its environment (torchrun's variables, else an srun task's, as
    submitit starts them); rank 0 returns the TrainResult (every rank's rows), the others None.

    cfg.world_size is the job's (the number of tasks); result.json, and on a failure the partial result, go to
    `out` (default runs/<job id>), a folder every node sees. A SIGTERM handler already installed (submitit's) is
    called after the partial result is written, instead of keeping ours out.
    """
    from ..ranks.env import adopt_scheduler_env, under_torchrun
    from .torchrun import run_torchrun

    adopt_scheduler_env()
    if not under_torchrun():
        raise ConfigError("run_from_env found no rank in this process's environment: run it in a process that "
                          "torchrun started, or in each task of an srun step of several tasks (submitit's "
                          "executor with tasks_per_node or nodes above 1); in a notebook, run_training starts the "
                          "ranks itself")
    return run_torchrun(cfg, out or default_out(), plots)


class TrainTask:
    """run_from_env(cfg, out) as a function submitit can submit and requeue: on submitit's requeue signal (a
    time limit or a preemption, SIGUSR2 by default) its handler calls checkpoint(), which resubmits the task
    with resume_from="latest", so the requeued job continues from the newest checkpoint in cfg.checkpoint_dir
    (written every cfg.checkpoint_every steps) instead of starting over."""

    def __init__(self, cfg: TrainConfig, out: Optional[str] = None, plots: bool = False):
        self.cfg, self.out, self.plots = cfg, out, plots

    def __call__(self) -> Optional[Any]:
        """This task's rank: the TrainResult on rank 0, None on the others."""
        return run_from_env(self.cfg, self.out, self.plots)

    def checkpoint(self) -> Any:
        """What submitit requeues: this task resuming from the newest checkpoint (none without checkpoint_dir:
        then submitit does not requeue, and says so)."""
        from submitit.helpers import DelayedSubmission

        if self.cfg.checkpoint_dir is None:
            return None
        return DelayedSubmission(TrainTask(self.cfg.replace(resume_from="latest"), self.out, self.plots))
