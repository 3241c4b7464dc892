"""Typical wrong answers to the exercises, each labelled with the mistake code and the hint it must produce.

tests/exercises/test_exercises.py runs every check on each of them. Every function here is wrong on purpose. They live in
two modules, by exercise (1-4 and 5-7), and register themselves in WRONG, in the notebook's order. The wrong
answers to the checked exercises of notebooks 11 and 12 are in `practice`, those of notebook 3b's in
`build_sync`, those of notebook 0's two blanks in `core_sync`; all register in PRACTICE_WRONG
(tests/exercises/test_practice_exercises.py).
"""
from __future__ import annotations

from . import build_sync, build_sync_class, core_sync, core_sync_class, groups_and_data, practice, training_steps  # noqa: F401 - importing registers their wrong answers
from ._registry import PRACTICE_WRONG, SYNC_RIGHT, SYNC_WRONG, WRONG, WrongAnswer, wrong
from .groups_and_data import loader_no_set_epoch, mean_sum_only

__all__ = ["PRACTICE_WRONG", "SYNC_RIGHT", "SYNC_WRONG", "WRONG", "WrongAnswer", "loader_no_set_epoch", "mean_sum_only", "wrong"]
