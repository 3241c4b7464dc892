"""Each rank's random number generators: seeded per rank, captured as plain tensors, restored on resume.

An exact resume must continue every random stream where it stopped, not only the model and the optimizer:
dropout, data augmentation or random crops draw from torch's (and sometimes NumPy's or Python's) global
generators, and a resumed rank that restarted them from its seed would draw other masks than the run that
never stopped. The states are stored as tensors and plain containers, so a checkpoint holding them still
loads with torch.load(weights_only=True).
"""
from __future__ import annotations

import random
from typing import Any, Dict, Optional

import numpy as np
import torch

RNG_KEYS = ("torch", "cuda", "numpy", "python")


def rank_seed(seed: int, rank: int) -> int:
    """A 32-bit seed for (seed, rank): different ranks get independent streams, the same run the same ones."""
    # SeedSequence mixes both numbers, so (seed=0, rank=1) and (seed=1, rank=0) don't share a stream.
    return int(np.random.SeedSequence([seed, rank]).generate_state(1)[0])


def seed_rank(seed: int, rank: int) -> None:
    """Seed this rank's torch (CPU and its CUDA device), NumPy and Python generators from (seed, rank)."""
    s = rank_seed(seed, rank)
    torch.manual_seed(s)  # also seeds every CUDA device, lazily
    np.random.seed(s)
    random.seed(s)


def rng_state(device: Optional[torch.device] = None) -> Dict[str, Any]:
    """This process's generator states as tensors and plain values (loadable with weights_only=True)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, mt, gauss_next = random.getstate()
    cuda = torch.cuda.get_rng_state(device) if device is not None and device.type == "cuda" else None
    return {
        "torch": torch.get_rng_state(),
        "cuda": cuda,  # None on CPU ranks
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss_next": gauss_next},
    }


def set_rng_state(state: Dict[str, Any], device: Optional[torch.device] = None) -> None:
    """Restore what rng_state() captured (the CUDA state only on a CUDA device, and only if one was saved)."""
    torch.set_rng_state(state["torch"].cpu())
    if device is not None and device.type == "cuda" and state.get("cuda") is not None:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(int(x) for x in p["state"].tolist()), p["gauss_next"]))


def check_rng_entry(state: Any) -> Optional[str]:
    """None if `state` looks like one rank's rng_state(); otherwise what is wrong with it, in words."""
    if not isinstance(state, dict) or set(state) != set(RNG_KEYS):
        keys = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
        return f"holds {keys}, not the states {list(RNG_KEYS)}"
    if not isinstance(state["torch"], torch.Tensor) or state["torch"].dtype != torch.uint8:
        return "has no torch generator state (a uint8 tensor)"
    n, p = state["numpy"], state["python"]
    if not isinstance(n, dict) or not isinstance(n.get("keys"), torch.Tensor) or n["keys"].numel() != 624:
        return "has no NumPy MT19937 state (624 keys)"
    if not isinstance(p, dict) or not isinstance(p.get("state"), torch.Tensor) or p["state"].numel() != 625:
        return "has no Python random state (625 words)"
    return None
