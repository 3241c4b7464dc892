"""ddp_helpers: run real DistributedDataParallel training from a notebook and see the gradients synchronize.

Names are imported lazily, so a rank started by spawn loads only what it uses (not matplotlib or tqdm).
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "TrainConfig": "config", "ConfigError": "config", "validate": "config",
    "DataSplits": "data", "DataError": "data", "load_data": "data", "shard_indices": "data", "normalize": "data",
    "build_model": "model", "fingerprint": "model", "flat_params": "model",
    "TrainResult": "result", "RankRecords": "result",
    "launch": "launcher", "LaunchError": "launcher", "RankFailedError": "launcher", "warm_up": "startmethod",
    "run_training": "runner",
    "train_single_process": "reference",
    "save_checkpoint": "checkpoint", "load_checkpoint": "checkpoint", "latest_checkpoint": "checkpoint",
    "plot_losses": "plots", "plot_grad_norms": "plots", "plot_fingerprints": "plots", "plot_shard_strip": "plots",
    "plot_captured_grads": "plots", "ReferenceResult": "reference",
    "control_panel": "panel", "ControlPanel": "panel",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ddp_helpers' has no attribute {name!r}")


def __dir__() -> list:
    return sorted(list(globals()) + __all__)
