"""What every training run shares, whether run_training starts the ranks or torchrun did: the step plan, the size
of each rank's tables (checked), and the TrainResult read from the run folder at the end."""
from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np

from ..common.errors import setting
from ..common.files import free_text
from ..ranks.starting import peak_rss_bytes
from .checkpoint import check_checkpoint_room
from .config import MAX_TABLE_BYTES, ConfigError, TrainConfig
from ..data import DataSplits
from .model import build_model, n_params
from .plan import StepPlan
from .result import TrainResult, collect_result
from .telemetry import RunRows, TableShape


def check_not_past_end(cfg: TrainConfig, plan: StepPlan) -> None:
    """Refuse a resume whose run already ended at the checkpoint's step: it would train 0 steps, silently."""
    if cfg.resume_from is None or plan.n_steps > 0:
        return
    end = min(cfg.epochs * plan.per_epoch, cfg.max_steps or cfg.epochs * plan.per_epoch)  # before for_run's clamp
    raise ConfigError(
        f"{setting('resume_from', cfg.resume_from, owner='TrainConfig')} is not accepted with "
        f"{setting('max_steps', cfg.max_steps)}, {setting('epochs', cfg.epochs)}: the checkpoint is at step "
        f"{plan.first} and this run ends at step {end} ({plan.per_epoch} steps per epoch), so nothing is left to "
        f"train; set {setting('max_steps')} above {plan.first} (or more epochs), "
        f"{setting('resume_from', None, lead='or ')} to start over")


def table_shape(cfg: TrainConfig, plan: StepPlan, params: int) -> TableShape:
    """How large each rank's tables are for this run of a model with `params` parameters (the same on every rank)."""
    return TableShape(max(plan.n_steps, 1), cfg.batch_size * cfg.accumulation_steps, len(cfg.capture_grad_steps),
                      params)


def check_table_size(cfg: TrainConfig, shape: TableShape, folder: str) -> None:
    """Refuse a run whose telemetry tables would not fit: over MAX_TABLE_BYTES a rank, or the temp dir's room."""
    per_rank = shape.nbytes()
    samples = (f"{shape.max_steps} steps x {shape.samples_per_step} sample indices ({setting('batch_size')} x "
               f"{setting('accumulation_steps')})")
    if per_rank > MAX_TABLE_BYTES:
        raise ConfigError(
            f"{setting('batch_size', cfg.batch_size, owner='TrainConfig')} is not accepted with "
            f"{setting('accumulation_steps', cfg.accumulation_steps)}, {setting('epochs', cfg.epochs)}, "
            f"{setting('max_steps', cfg.max_steps)}: each rank would record {per_rank:,} bytes of telemetry "
            f"({samples}), over the {MAX_TABLE_BYTES:,} allowed; set {setting('max_steps')}, fewer epochs or a "
            f"smaller batch, or {setting('telemetry', False)}")
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return
    if per_rank * cfg.world_size > free:
        raise ConfigError(
            f"{setting('world_size', cfg.world_size, owner='TrainConfig')} is not accepted here: the ranks' "
            "telemetry needs "
            f"{per_rank * cfg.world_size:,} bytes in {folder} ({free_text(folder)}; {samples} per rank); free some "
            f"space there or point TMPDIR elsewhere, or set {setting('max_steps')}, fewer epochs or a smaller batch")


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
        """The plan (resuming after start_step, as checkpoint.check_resume found it), its tables' size checked."""
        plan = StepPlan.for_run(cfg, len(data.train_labels), cfg.world_size, start_step)
        check_not_past_end(cfg, plan)
        params = n_params(build_model(cfg.seed))
        shape = table_shape(cfg, plan, params)
        check_table_size(cfg, shape, run_dir)
        check_checkpoint_room(cfg, plan.first, plan.end, params)
        return cls(cfg, backend, data, plan, shape, RunRows(run_dir, cfg.world_size),
                   notes=[data.notice] if data.notice else [])

    def result(self, final_params: Optional[np.ndarray] = None, complete: bool = True) -> TrainResult:
        """The TrainResult of everything the ranks recorded so far."""
        r = collect_result(self.rows.all_tables(), self.cfg.to_dict(), self.backend, self.data.name, self.data.source,
                           self.t_launch, time.monotonic(), self.cfg.capture_grad_steps, final_params,
                           peak_rss_bytes(children=False) / 2**20, complete=complete)
        r.notes.extend(self.notes)
        return r
