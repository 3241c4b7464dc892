"""run_training: check the settings, load the data once, launch the ranks, show progress, return a TrainResult."""
from __future__ import annotations

import os
import resource
import sys
import time
from typing import Callable, List, Optional

from . import worker
from .checkpoint import load_checkpoint
from .config import ConfigError, TrainConfig, default_threads, validate
from .data import load_data
from .launcher import RankFailedError, check_start_method, launch
from .model import build_model, n_params
from .telemetry import TelemetryBuffers, TrainResult, collect_result


def _want_progress(progress: Optional[bool]) -> bool:
    if progress is not None:
        return progress
    env = os.environ.get("DDP_HELPERS_PROGRESS")
    if env is not None:
        return env not in ("0", "false", "no", "")
    return True


class _Progress:
    """A tqdm bar (and an optional callback) fed from the ranks' shared step counters (the children never print)."""

    def __init__(self, buffers: TelemetryBuffers, total: int, enabled: bool, desc: str,
                 callback: Optional[Callable[[List[int], int], None]] = None):
        self.buffers, self.bar, self.total, self.callback = buffers, None, total, callback
        self.last: List[int] = []
        if enabled:
            from tqdm.auto import tqdm  # a widget in notebooks, a text bar in terminals

            self.bar = tqdm(total=total, desc=desc, unit="step", leave=False, file=sys.stderr)

    def __call__(self) -> None:
        if self.bar is not None:
            n = self.buffers.progress()
            if n > self.bar.n:
                self.bar.update(n - self.bar.n)
        if self.callback is not None:
            counts = self.buffers.count.tolist()
            if counts != self.last:
                self.last = counts
                self.callback(counts, self.total)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _resume_step(cfg: TrainConfig) -> int:
    if cfg.resume_from is None:
        return 0
    ckpt = load_checkpoint(cfg.resume_from)
    saved = ckpt.get("config", {})
    # Anything that changes the sampler order or the update rule would make the "resumed" run a different one.
    for key in ("world_size", "batch_size", "dataset", "seed", "pipeline", "accumulation_steps", "lr", "momentum"):
        if key in saved and saved[key] != getattr(cfg, key):
            raise ConfigError(f"TrainConfig.{key}={getattr(cfg, key)!r} differs from the checkpoint's {saved[key]!r} "
                              f"({cfg.resume_from}); an exact resume needs the same {key}")
    return int(ckpt["step"])


def run_training(cfg: Optional[TrainConfig] = None, progress: Optional[bool] = None, start_method: str = "spawn",
                 on_progress: Optional[Callable[[List[int], int], None]] = None, **overrides) -> TrainResult:
    """Train cfg.world_size DDP replicas (torch.multiprocessing spawn) and return their per-step records.

    Settings are checked before anything starts; a failing rank raises RankFailedError whose
    .partial_result holds every step recorded before the failure. start_method="fork" skips the
    ~4 s it takes each spawned rank to import torch (refused once CUDA is initialized here).
    on_progress(steps_done_per_rank, total_steps) is called from this process whenever a rank advances
    (e.g. to drive widgets); it runs between polls, so keep it quick.
    """
    cfg = (cfg or TrainConfig()).replace(**overrides) if overrides else (cfg or TrainConfig())
    backend = validate(cfg)
    check_start_method(start_method)  # before the data loads (validate has checked the rest)
    data = load_data(cfg)  # decoded once here, shared with every rank: no rank downloads or decodes again
    start_step = _resume_step(cfg)
    per_epoch, first, end = worker.plan_steps(cfg, len(data.train_labels), cfg.world_size, start_step)
    model = build_model(cfg.seed)
    buffers = TelemetryBuffers(cfg.world_size, max(end - first, 1), cfg.batch_size * cfg.accumulation_steps,
                               len(cfg.capture_grad_steps), n_params(model))
    bar = _Progress(buffers, end - first, _want_progress(progress), f"{cfg.world_size} ranks", on_progress)
    threads = cfg.threads_per_rank or default_threads(cfg.world_size)
    t_launch = time.monotonic()

    def result(complete: bool, final_params=None) -> TrainResult:
        r = collect_result(buffers, cfg.to_dict(), backend, data.name, data.source, t_launch, time.monotonic(),
                           cfg.capture_grad_steps, final_params,
                           resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, complete=complete)
        if data.notice:
            r.notes.append(data.notice)
        return r

    try:
        # The seed pipeline passes no data: its ranks load their own copies, as the listing's do.
        shared = None if cfg.pipeline == "seed" else data
        if shared is not None:
            # Normalize once here (cached with the data); the ranks map these pages instead of each making a copy.
            shared.train_normalized()
        outputs = launch(worker.train, cfg.world_size, args=(cfg, backend, shared, buffers), backend=backend,
                         host=cfg.master_addr, port=cfg.master_port, timeout_s=cfg.timeout_s, threads_per_rank=threads,
                         on_poll=bar, start_method=start_method, bind_cores=cfg.bind_cores)
    except RankFailedError as e:
        e.partial_result = result(complete=False)  # every step the ranks published before the failure
        raise
    finally:
        bar.close()
    return result(complete=True, final_params=outputs[0]["final_params"])
