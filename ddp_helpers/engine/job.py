"""What every training run shares, whether run_training spawns the ranks or torchrun started them:
the checks, the resume check, the step plan, the telemetry buffers, and the TrainResult at the end."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import numpy as np

from ..ranks.procs import peak_rss_bytes
from .checkpoint import check_resume
from .config import ConfigError, TrainConfig, validate
from ..data import DataSplits
from .model import build_model, n_params
from .plan import StepPlan
from .result import TrainResult, collect_result
from .telemetry import TelemetryBuffers


def check_job(cfg: TrainConfig, local_world_size: Optional[int] = None,
              check_port: bool = True) -> Tuple[str, int]:
    """Every check that can be made before training (settings, machine, resume file); (backend, resume step)."""
    backend = validate(cfg, local_world_size=local_world_size, check_port=check_port)
    start_step = check_resume(cfg)  # a checkpoint made with other settings is refused now, not after ranks start
    return backend, start_step


def check_not_past_end(cfg: TrainConfig, plan: StepPlan) -> None:
    """Refuse a resume whose run already ended at the checkpoint's step: it would train 0 steps, silently."""
    if cfg.resume_from is None or plan.n_steps > 0:
        return
    end = min(cfg.epochs * plan.per_epoch, cfg.max_steps or cfg.epochs * plan.per_epoch)  # before for_run's clamp
    raise ConfigError(
        f"TrainConfig.resume_from={cfg.resume_from!r} is not accepted with max_steps={cfg.max_steps!r}, "
        f"epochs={cfg.epochs}: the checkpoint is at step {plan.first} and this run ends at step {end} "
        f"({plan.per_epoch} steps per epoch), so nothing is left to train; set max_steps above {plan.first} "
        f"(or more epochs), or resume_from=None to start over")


@dataclass
class Job:
    """One run's plan and its shared buffers, made once the data is loaded."""

    cfg: TrainConfig
    backend: str
    data: DataSplits
    plan: StepPlan
    buffers: TelemetryBuffers
    t_launch: float = field(default_factory=time.monotonic)
    notes: List[str] = field(default_factory=list)

    @classmethod
    def create(cls, cfg: TrainConfig, backend: str, data: DataSplits, start_step: int = 0) -> "Job":
        """The plan (resuming after start_step, as check_job found it) and buffers sized for it."""
        plan = StepPlan.for_run(cfg, len(data.train_labels), cfg.world_size, start_step)
        check_not_past_end(cfg, plan)
        buffers = TelemetryBuffers(cfg.world_size, max(plan.n_steps, 1), cfg.batch_size * cfg.accumulation_steps,
                                   len(cfg.capture_grad_steps), n_params(build_model(cfg.seed)))
        return cls(cfg, backend, data, plan, buffers, notes=[data.notice] if data.notice else [])

    def result(self, final_params: Optional[np.ndarray] = None, complete: bool = True) -> TrainResult:
        """The TrainResult of everything the ranks published so far."""
        r = collect_result(self.buffers, self.cfg.to_dict(), self.backend, self.data.name, self.data.source,
                           self.t_launch, time.monotonic(), self.cfg.capture_grad_steps, final_params,
                           peak_rss_bytes(children=False) / 2**20, complete=complete)
        r.notes.extend(self.notes)
        return r
