"""Rank-0 checkpoints written atomically and loadable with torch.load(weights_only=True)."""
from __future__ import annotations

import glob
import os
import re
from typing import Any, Dict, Optional

import torch


def checkpoint_path(directory: str, step: int) -> str:
    """File name for the checkpoint taken after `step` optimizer steps."""
    return os.path.join(os.path.expanduser(directory), f"ckpt-{step:07d}.pt")


def save_checkpoint(directory: str, step: int, model_state: Dict[str, torch.Tensor], optim_state: Dict[str, Any],
                    config: Dict[str, Any]) -> str:
    """Write a checkpoint via a temporary file and a rename, so a crash never leaves a half-written one."""
    path = checkpoint_path(directory, step)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    payload = {"step": step, "model": {k: v.detach().cpu() for k, v in model_state.items()},
               "optimizer": _to_cpu(optim_state), "config": config, "format": "ddp_helpers.checkpoint/1"}
    torch.save(payload, tmp)
    os.replace(tmp, path)  # atomic on POSIX: readers see the old file set or the complete new one
    return path


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


def latest_checkpoint(directory: str) -> Optional[str]:
    """The checkpoint with the highest step in `directory`, or None."""
    files = glob.glob(os.path.join(os.path.expanduser(directory), "ckpt-*.pt"))
    steps = [(int(m.group(1)), f) for f in files if (m := re.search(r"ckpt-(\d+)\.pt$", f))]
    return max(steps)[1] if steps else None
