"""Which optimizer steps a run makes: epochs, the steps a resume skips, and micro-batches per step.

The DDP worker and the one-process reference both walk this plan, so they can't disagree about it.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from typing import Callable, Iterable, Iterator, List, Tuple, TypeVar

from ..data.catalog import ceil_div, steps_per_epoch
from .config import TrainConfig

T = TypeVar("T")


@dataclass(frozen=True)
class StepPlan:
    """Global steps first..end-1 of a run; each step is `accumulation` micro-batches (fewer at an epoch's end)."""

    per_epoch: int  # optimizer steps per epoch
    first: int  # the first global step this run makes (past 0 after a resume)
    end: int  # the step it stops before
    accumulation: int  # micro-batches per optimizer step
    epochs: int

    @classmethod
    def for_run(cls, cfg: TrainConfig, n_train: int, world_size: int, start_step: int = 0) -> "StepPlan":
        """The plan for cfg on n_train samples, resuming after start_step steps."""
        batches = steps_per_epoch(n_train, world_size, cfg.batch_size, cfg.pipeline)
        per_epoch = ceil_div(batches, cfg.accumulation_steps)
        end = cfg.epochs * per_epoch
        if cfg.max_steps is not None:
            end = min(end, cfg.max_steps)
        return cls(per_epoch, start_step, max(end, start_step), cfg.accumulation_steps, cfg.epochs)

    @property
    def n_steps(self) -> int:
        """Optimizer steps this run makes."""
        return self.end - self.first

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
