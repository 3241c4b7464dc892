"""Which optimizer steps a run makes: epochs, the steps a resume skips, and micro-batches per step.

The DDP worker and the one-process reference both walk this plan, so they can't disagree about it.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from typing import Callable, Iterable, Iterator, List, Tuple, TypeVar

from ..common.errors import setting
from ..data.catalog import ceil_div, steps_per_epoch
from .config import ConfigError, TrainConfig

T = TypeVar("T")


@dataclass(frozen=True)
class StepPlan:
    """Global steps first..end-1 of a run; each step is `accumulation` micro-batches (fewer at an epoch's end)."""

    per_epoch: int  # optimizer steps per epoch
    first: int  # the first global step this run makes (past 0 after a resume)
    end: int  # the step it stops before
    accumulation: int  # micro-batches per optimizer step
    epochs: int
    n_steps: int  # optimizer steps this run makes: end - first

    @classmethod
    def for_run(cls, cfg: TrainConfig, n_train: int, world_size: int, start_step: int = 0) -> "StepPlan":
        """The plan for cfg on n_train samples, resuming after start_step steps; a resume that leaves no step to
        make is refused (it would train 0 steps, silently)."""
        batches = steps_per_epoch(n_train, world_size, cfg.batch_size, cfg.pipeline)
        per_epoch = ceil_div(batches, cfg.accumulation_steps)
        end = cfg.epochs * per_epoch
        if cfg.max_steps is not None:
            end = min(end, cfg.max_steps)
        if cfg.resume_from is not None and end <= start_step:
            raise nothing_left(cfg, start_step, end, per_epoch)
        end = max(end, start_step)
        return cls(per_epoch, start_step, end, cfg.accumulation_steps, cfg.epochs, end - start_step)

    def steps(self, epoch_batches: Callable[[int], Iterable[T]]) -> Iterator[Tuple[int, List[T]]]:
        """(global step, its micro-batches) for every step of the plan; epoch_batches(epoch) gives an epoch's."""
        step = self.first
        for epoch in range(self.first // self.per_epoch, self.epochs):
            if step >= self.end:
                return
            batches = iter(epoch_batches(epoch))
            # After a resume: skip the batches of this epoch that the checkpointed run already trained on.
            skip = (step - epoch * self.per_epoch) * self.accumulation
            for _ in islice(batches, skip):
                pass
            while step < self.end:
                micro = list(islice(batches, self.accumulation))
                if not micro:
                    break
                yield step, micro
                step += 1


def nothing_left(cfg: TrainConfig, first: int, end: int, per_epoch: int) -> ConfigError:
    """The refusal of a resume whose run already ended at the checkpoint's step."""
    return ConfigError(
        f"{setting('resume_from', cfg.resume_from, owner='TrainConfig')} is not accepted with "
        f"{setting('max_steps', cfg.max_steps)}, {setting('epochs', cfg.epochs)}: the checkpoint is at step "
        f"{first} and this run ends at step {end} ({per_epoch} steps per epoch), so nothing is left to "
        f"train; set {setting('max_steps')} above {first} (or more epochs), "
        f"{setting('resume_from', None, lead='or ')} to start over")
