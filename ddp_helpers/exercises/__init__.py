"""Exercise checks: run a learner's function on real ranks, compare with a reference, and name the mistake.

Each ``check_*`` function takes the learner's function, runs it on 2 (sometimes 3) real processes, prints one
line (PASS, NOT DONE YET, or TRY AGAIN with a hint) and returns a :class:`CheckResult`. Hints come in two tiers:
an exercise's first failed check prints a nudge, the next ones the specific mistake (``reset_hints`` starts
over). ``world_size=`` runs a check on another number of ranks (the graded hidden tests do). One module per
exercise holds its check; ``_harness`` holds what they share (running the ranks, judging their reports),
``_watch`` the recorders of what the learner's code did inside a rank, ``_compare`` the comparisons.

EXERCISES are the exercise notebook's (and the nbgrader assignment's); PRACTICE_EXERCISES the checked exercises
of lesson notebook 0 (``after_backward``, ``as_gradients_arrive``: classes) and
at the end of lesson notebooks 3b (``bucketed_sync``), 11 (``global_loss``, ``load_checkpoint``) and 12
(``replicas_agree``).
"""
from __future__ import annotations

from typing import Callable, Dict

from ._harness import NOT_DONE, CheckResult, reset_hints, summarize
from .accumulation import check_accumulation_step
from .average_gradients import check_average_gradients
from .bucketed_sync import check_bucketed_sync
from .core_sync import check_after_backward, check_as_gradients_arrive
from .global_loss import check_global_loss
from .global_mean import check_global_mean
from .init_group import check_init_group
from .load_checkpoint import check_load_checkpoint
from .make_loader import check_make_loader
from .replicas_agree import check_replicas_agree
from .save_checkpoint import check_save_checkpoint
from .shard_indices import check_shard_indices

# In the notebook's order; the keys are the names of the functions the learner writes.
EXERCISES: Dict[str, Callable[..., CheckResult]] = {
    "init_group": check_init_group,
    "global_mean": check_global_mean,
    "shard_indices": check_shard_indices,
    "make_loader": check_make_loader,
    "average_gradients": check_average_gradients,
    "accumulation_step": check_accumulation_step,
    "save_checkpoint": check_save_checkpoint,
}

# The lesson notebooks' checked exercises, by notebook; the keys are the names of the functions the learner writes.
PRACTICE_EXERCISES: Dict[str, Callable[..., CheckResult]] = {
    "global_loss": check_global_loss,  # notebook 11
    "load_checkpoint": check_load_checkpoint,  # notebook 11
    "replicas_agree": check_replicas_agree,  # notebook 12
    "bucketed_sync": check_bucketed_sync,  # notebook 3b
    "after_backward": check_after_backward,  # notebook 0, step 1 (the learner writes a class)
    "as_gradients_arrive": check_as_gradients_arrive,  # notebook 0, step 2
}

__all__ = [
    "EXERCISES", "NOT_DONE", "PRACTICE_EXERCISES", "CheckResult", "check_accumulation_step", "check_after_backward",
    "check_as_gradients_arrive",
    "check_average_gradients", "check_bucketed_sync", "check_global_loss", "check_global_mean", "check_init_group",
    "check_load_checkpoint", "check_make_loader", "check_replicas_agree", "check_save_checkpoint",
    "check_shard_indices", "reset_hints", "summarize",
]
