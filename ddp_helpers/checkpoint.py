"""Rank-0 checkpoints written atomically and loadable with torch.load(weights_only=True); exact resumes."""
from __future__ import annotations

import glob
import io
import os
import re
from typing import Any, Dict, Optional

import torch

from .config import ConfigError, TrainConfig
from .fileio import atomic_write

# Anything that changes the sampler order or the update rule would make a "resumed" run a different one.
RESUME_MUST_MATCH = ("world_size", "batch_size", "dataset", "seed", "pipeline", "accumulation_steps", "lr",
                     "momentum")


def checkpoint_path(directory: str, step: int) -> str:
    """File name for the checkpoint taken after `step` optimizer steps."""
    return os.path.join(os.path.expanduser(directory), f"ckpt-{step:07d}.pt")


def save_checkpoint(directory: str, step: int, model_state: Dict[str, torch.Tensor], optim_state: Dict[str, Any],
                    config: Dict[str, Any]) -> str:
    """Write a checkpoint via a temporary file and a rename, so a crash never leaves a half-written one."""
    path = checkpoint_path(directory, step)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    payload = {"step": step, "model": {k: v.detach().cpu() for k, v in model_state.items()},
               "optimizer": _to_cpu(optim_state), "config": config, "format": "ddp_helpers.checkpoint/1"}

    def write(tmp: str) -> None:
        # Serialized in memory first, then written as plain bytes: a full disk then fails as OSError(ENOSPC),
        # which atomic_write turns into a clear message (torch's zip writer reports it as "unexpected pos ...").
        buf = io.BytesIO()
        torch.save(payload, buf)
        with open(tmp, "wb") as fh:
            fh.write(buf.getbuffer())

    return atomic_write(path, write)


def save_if_due(cfg: TrainConfig, rank: int, step: int, end: int, model: torch.nn.Module,
                optimizer: torch.optim.Optimizer) -> Optional[str]:
    """After `step` steps: rank 0 saves when checkpoints are on and it is the run's end or a checkpoint_every."""
    if rank != 0 or cfg.checkpoint_dir is None:
        return None  # rank 0 alone writes: all replicas are identical, so one copy is enough (and no write races)
    if step != end and not (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
        return None
    return save_checkpoint(cfg.checkpoint_dir, step, model.state_dict(), optimizer.state_dict(), cfg.to_dict())


def _to_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x


def load_checkpoint(path: str, map_location: Optional[torch.device] = None) -> Dict[str, Any]:
    """Load a checkpoint safely (weights_only=True: tensors and plain containers, no arbitrary code)."""
    return torch.load(os.path.expanduser(path), map_location=map_location or "cpu", weights_only=True)


def check_resume(cfg: TrainConfig) -> int:
    """The step cfg.resume_from continues after (0 without one); refuses settings that differ from the checkpoint's."""
    if cfg.resume_from is None:
        return 0
    ckpt = load_checkpoint(cfg.resume_from)
    saved = ckpt.get("config", {})
    for key in RESUME_MUST_MATCH:
        if key in saved and saved[key] != getattr(cfg, key):
            raise ConfigError(f"TrainConfig.{key}={getattr(cfg, key)!r} differs from the checkpoint's {saved[key]!r} "
                              f"({cfg.resume_from}); an exact resume needs the same {key}")
    return int(ckpt["step"])


def resume(path: Optional[str], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
           device: torch.device) -> int:
    """Load the model and optimizer state saved at `path` (None: nothing to load); return its step."""
    if path is None:
        return 0
    ckpt = load_checkpoint(path, device)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    return int(ckpt["step"])


def latest_checkpoint(directory: str) -> Optional[str]:
    """The checkpoint with the highest step in `directory`, or None."""
    files = glob.glob(os.path.join(os.path.expanduser(directory), "ckpt-*.pt"))
    steps = [(int(m.group(1)), f) for f in files if (m := re.search(r"ckpt-(\d+)\.pt$", f))]
    return max(steps)[1] if steps else None
