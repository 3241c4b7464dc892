"""ddp_helpers: run real DistributedDataParallel training from a notebook and see the gradients synchronize.

Names are imported lazily, so a rank started by spawn loads only what it uses (not matplotlib or tqdm).
"""
from __future__ import annotations

from .common.lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS = {
    "TrainConfig": "engine.config", "ConfigError": "engine.config", "validate": "engine.config",
    "DataSplits": "data", "DataError": "data", "load_data": "data", "shard_indices": "data", "normalize": "data",
    "build_model": "engine.model", "fingerprint": "engine.model", "flat_params": "engine.model",
    "TrainResult": "engine.result", "RankRecords": "engine.result",
    "launch": "ranks.launcher", "LaunchError": "ranks.launcher", "RankFailedError": "ranks.launcher", "warm_up": "ranks.startmethod",
    "run_training": "engine.runner", "run_from_env": "cli.from_env", "TrainTask": "cli.from_env",
    "train_single_process": "lesson.reference",
    "save_checkpoint": "engine.checkpoint", "load_checkpoint": "engine.checkpoint", "latest_checkpoint": "engine.checkpoint",
    "plot_losses": "lesson.figures.training", "plot_grad_norms": "lesson.figures.training",
    "plot_fingerprints": "lesson.figures.training", "plot_shard_strip": "lesson.figures.data_shards",
    "plot_captured_grads": "lesson.figures.training", "ReferenceResult": "lesson.reference",
    "control_panel": "lesson.panel", "ControlPanel": "lesson.panel",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
