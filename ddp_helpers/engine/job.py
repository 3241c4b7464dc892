"""What every training run shares, whether run_training starts the ranks or torchrun did: the step plan, the size
of each rank's tables (checked), and the TrainResult read from the run folder at the end."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np

from ..ranks.starting import peak_rss_bytes
from .checkpoint import check_checkpoint_room
from .config import TrainConfig
from ..data import DataSplits
from .model import build_model, n_params
from .plan import StepPlan
from .result import TrainResult, collect_result
from .telemetry import RunRows, TableShape


@dataclass
class Job:
    """One run's plan and where its ranks leave their rows, made once the data is loaded."""

    cfg: TrainConfig
    backend: str
    data: DataSplits
    plan: StepPlan
    shape: TableShape
    rows: RunRows
    t_launch: float = field(default_factory=time.monotonic)
    notes: List[str] = field(default_factory=list)

    @classmethod
    def create(cls, cfg: TrainConfig, backend: str, data: DataSplits, run_dir: str, start_step: int = 0) -> "Job":
        """The plan (resuming after start_step, as checkpoint.check_resume found it; refused if it leaves no step),
        the room its checkpoints and its tables need checked: each check once, with the numbers it needs."""
        plan = StepPlan.for_run(cfg, len(data.train_labels), cfg.world_size, start_step)
        params = n_params(build_model(cfg.seed))
        check_checkpoint_room(cfg, plan.first, plan.end, params)
        shape = TableShape.for_run(cfg, plan.n_steps, params)
        shape.check_fits(cfg, run_dir)
        return cls(cfg, backend, data, plan, shape, RunRows(run_dir, cfg.world_size),
                   notes=[data.notice] if data.notice else [])

    def result(self, final_params: Optional[np.ndarray] = None, complete: bool = True) -> TrainResult:
        """The TrainResult of everything the ranks recorded so far."""
        r = collect_result(self.rows.all_tables(), self.cfg.to_dict(), self.backend, self.data.name, self.data.source,
                           self.t_launch, time.monotonic(), self.cfg.capture_grad_steps, final_params,
                           peak_rss_bytes(children=False) / 2**20, complete=complete)
        r.notes.extend(self.notes)
        return r
