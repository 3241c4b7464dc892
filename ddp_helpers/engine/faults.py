"""Fault injection for lessons and tests: make one rank fail on purpose, to show what the launcher does then."""
from __future__ import annotations

import os
import signal
import time

from .config import TrainConfig


class InjectedFault(RuntimeError):
    """Raised on purpose by fault injection (cfg.fault_rank/fault_step), to show what a failing rank does."""


def inject_fault(cfg: TrainConfig, rank: int, step: int) -> None:
    """Fail as cfg.fault_kind says when this is the configured rank and step; otherwise do nothing.

    The fault stands for a one-off failure (a lost node, a killed process): under torchrun it fires in the first
    attempt only (TORCHELASTIC_RESTART_COUNT 0), and not after a SLURM requeue (SLURM_RESTART_COUNT), so that a
    restarted or requeued job can show the recovery.
    """
    if cfg.fault_rank != rank or cfg.fault_step != step:
        return
    if any((os.environ.get(k) or "0") != "0" for k in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT")):
        return
    if cfg.fault_kind == "kill":
        os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))  # Windows has no SIGKILL
    if cfg.fault_kind == "hang":
        time.sleep(10**6)
    raise InjectedFault(f"injected fault on rank {rank} at step {step}")
