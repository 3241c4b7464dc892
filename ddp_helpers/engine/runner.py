"""run_training: check the settings, load the data once, launch the ranks, show progress, return a TrainResult."""
from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Callable, List, Optional

from . import worker
from .checkpoint import CheckpointError, check_resume, resolve_resume
from .config import ConfigError, TrainConfig, plan_launch
from ..data import load_data
from .job import Job
from ..ranks.checks import LaunchPlan, RankSizes
from ..ranks.ending import EndOnSignals, interrupts_deferred
from ..ranks.folders import run_folder
from ..ranks.launcher import LaunchInterrupted, RankFailedError, run_plan
from .result import TrainResult
from .telemetry import RunRows


def _want_progress(progress: Optional[bool]) -> bool:
    if progress is not None:
        return progress
    env = os.environ.get("DDP_HELPERS_PROGRESS")
    if env is not None:
        return env not in ("0", "false", "no", "")
    return True


class ProgressBar:
    """A tqdm bar (and an optional callback) fed from the ranks' step counters (the ranks print nothing of it).

    Start-up is a phase of its own ("starting 2 ranks"): the bar's clock restarts at the first step, so its
    rate is the training loop's, not skewed by the seconds the ranks took to start.
    """

    def __init__(self, rows: RunRows, total: int, enabled: bool, desc: str,
                 callback: Optional[Callable[[List[int], int], None]] = None):
        self.rows, self.bar, self.total, self.callback, self.desc = rows, None, total, callback, desc
        self.last: List[int] = []
        self.training = False
        if enabled:
            from tqdm.auto import tqdm  # a widget in notebooks, a text bar in terminals

            self.bar = tqdm(total=total, desc=f"starting {desc}", unit="step", leave=False, file=sys.stderr)

    def __call__(self) -> None:
        counts = self.rows.counts()
        if self.bar is not None:
            self._update_bar(counts)
        if self.callback is not None:
            if counts != self.last:
                self.last = counts
                self.callback(counts, self.total)

    def _update_bar(self, counts: List[int]) -> None:
        if not self.training and max(counts) > 0:
            self.training = True
            self.bar.set_description(f"training {self.desc}", refresh=False)
            self.bar.reset(total=self.total)  # restarts the bar's clock: steps/s from the first step on
        n = min(counts)
        if n > self.bar.n:
            self.bar.update(n - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_training(cfg: Optional[TrainConfig] = None, progress: Optional[bool] = None, start_method: str = "auto",
                 on_progress: Optional[Callable[[List[int], int], None]] = None, rank_output: bool = False,
                 **overrides) -> TrainResult:
    """Train cfg.world_size DDP replicas in real processes and return their per-step records.

    Settings are checked before anything starts; a failing rank raises RankFailedError, and Ctrl-C
    LaunchInterrupted (a KeyboardInterrupt), whose .partial_result holds every step recorded before (and rank 0's
    parameters after the last); a final checkpoint that can't be written raises CheckpointError, whose .result
    is the finished run's. start_method="auto" forks the ranks from a
    server with torch already imported (after the first call a launch takes a fraction of a second);
    "spawn" starts fresh interpreters as the listing's mp.spawn does (each imports torch: seconds).
    on_progress(steps_done_per_rank, total_steps) is called from this process whenever a rank advances
    (e.g. to drive widgets); it runs between polls, so keep it quick. rank_output=True shows what the ranks
    print (torch's warnings), prefixed "[rank r] " as launch() shows a function's; by default the engine's ranks,
    which run only the package's code, stay silent, and a failure shows the failed rank's last lines.
    """
    try:  # here too: a Ctrl-C on run_checked's own first line is not bare
        return run_checked(cfg, None, progress, start_method, on_progress, rank_output, overrides)
    except KeyboardInterrupt as e:
        if isinstance(e, LaunchInterrupted):
            raise
        raise _not_begun() from None


def run_checked(cfg: Optional[TrainConfig], sizes: Optional[RankSizes], progress: Optional[bool] = None,
                start_method: str = "auto", on_progress: Optional[Callable[[List[int], int], None]] = None,
                rank_output: bool = False, overrides: Optional[dict] = None) -> TrainResult:
    """run_training(cfg) whose checks that need no torch were made already (sizes: config.check_before_torch's,
    which the command line makes before torch loads); None: made here."""
    try:
        cfg = _settings(cfg, progress, on_progress, overrides or {})
        return _run_training(cfg, sizes, progress, start_method, on_progress, rank_output)
    except KeyboardInterrupt as e:
        if isinstance(e, LaunchInterrupted):
            raise
        raise _not_begun() from None


def _not_begun() -> LaunchInterrupted:
    """Ctrl-C before the run folder existed (the settings' checks, the data's loading): no rank started."""
    return LaunchInterrupted("training stopped before it began: no rank had started and no step was recorded "
                             "(.partial_result is None)")


def _run_training(cfg: TrainConfig, sizes: Optional[RankSizes], progress: Optional[bool], start_method: str,
                  on_progress: Optional[Callable[[List[int], int], None]], rank_output: bool) -> TrainResult:
    """run_training, a Ctrl-C before the launch's watch left raw (run_training turns it into LaunchInterrupted).
    Every check is made once, before the data loads: the settings' own when cfg was made, then these."""
    if not isinstance(rank_output, bool):
        raise ConfigError(f"run_training(rank_output={rank_output!r}) is not accepted: True or False")
    # the paths, the ranks and threads on this machine (unless sizes says they were checked), then the plan;
    # watch_shared=False: the engine's ranks only read the data
    plan = plan_launch(cfg, sizes, start_method, watch_shared=False, quiet=not rank_output)
    cfg = resolve_resume(cfg)  # resume_from="latest": the newest checkpoint in checkpoint_dir, or a fresh start
    start_step = check_resume(cfg)  # a checkpoint made with other settings is refused now, not after ranks start
    data = load_data(cfg)  # decoded once here, shared with every rank: no rank downloads or decodes again
    # SIGTERM/SIGHUP end the run as Ctrl-C does; the folder where every rank leaves its rows and report, removed after
    with EndOnSignals(), run_folder() as run_dir:
        return _train_in(dataclasses.replace(plan, run_dir=run_dir), cfg, start_step, data, progress, on_progress)


def _settings(cfg: Optional[TrainConfig], progress: object, on_progress: object, overrides: dict) -> TrainConfig:
    """run_training's own arguments checked by name; cfg with the overrides applied."""
    if progress is not None and not isinstance(progress, bool):
        raise ConfigError(f"run_training(progress={progress!r}) is not accepted: None (a bar unless "
                          "DDP_HELPERS_PROGRESS=0), True or False")
    if on_progress is not None and not callable(on_progress):
        raise ConfigError(f"run_training(on_progress={on_progress!r}) is not accepted: None, or a function "
                          "called as on_progress(steps_done_per_rank, total_steps)")
    if cfg is not None and not isinstance(cfg, TrainConfig):
        raise ConfigError(f"run_training(cfg={cfg!r}) is not accepted: None (the defaults) or a TrainConfig; "
                          "build one with TrainConfig(...)")
    cfg = cfg or TrainConfig()
    return cfg.replace(**overrides) if overrides else cfg


def _train_in(plan: LaunchPlan, cfg: TrainConfig, start_step: int, data, progress: Optional[bool],
              on_progress: Optional[Callable[[List[int], int], None]]) -> TrainResult:
    """run_training's launch and result, with every rank's rows in the plan's run folder."""
    run_dir, backend = str(plan.run_dir), plan.backend
    job = Job.create(cfg, backend, data, run_dir, start_step)
    bar = None
    try:
        bar = ProgressBar(job.rows, job.plan.n_steps, _want_progress(progress), f"{cfg.world_size} ranks",
                          on_progress)
        # The seed pipeline passes no data: its ranks load their own copies, as the listing's do. Otherwise the
        # images are normalized once here (cached with the data), and the ranks map these pages instead of copying.
        shared = None if cfg.pipeline == "seed" else data
        if shared is not None:
            shared.train_normalized()
        job.t_launch = time.monotonic()
        # the plan as checked before the data loaded, with the progress bar between polls
        outputs = run_plan(dataclasses.replace(plan, on_poll=bar), worker.train, (cfg, backend, shared, run_dir))
        result = job.result(final_params=outputs[0]["final_params"])
    except RankFailedError as e:
        e.partial_result = job.result(complete=False)  # every step the ranks recorded before the failure
        raise
    except KeyboardInterrupt as e:  # LaunchInterrupted, or Ctrl-C outside the launch's watch (before, after it)
        with interrupts_deferred():  # a second Ctrl-C can't lose the steps recorded
            partial = job.result(complete=False)
        what = (f"training stopped after {partial.n_steps} of {job.plan.n_steps} steps; all {cfg.world_size} ranks "
                f"have ended. The steps recorded are in this exception's .partial_result (in a notebook: "
                "sys.last_value.partial_result)")
        if isinstance(e, LaunchInterrupted):
            e.partial_result, e.what = partial, what
            raise
        stop = LaunchInterrupted(what)
        stop.partial_result = partial
        raise stop from None
    finally:
        with interrupts_deferred():
            if bar is not None:
                bar.close()
            job.rows.close()  # unmapped before the folder goes (Windows can't remove a mapped file)
    missed = outputs[0].get("checkpoint_error")
    if missed:  # the training finished, its last checkpoint didn't: the result is kept on the error
        raise CheckpointError(missed, result)
    return result
