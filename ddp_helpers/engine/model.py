"""The listing's model and optimizer, built the same way on every rank."""
from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
import xxhash
from torch import nn

if TYPE_CHECKING:
    from .config import TrainConfig


def build_model(seed: int) -> nn.Module:
    """Flatten -> Linear(784, 10), initialized from `seed` so every rank starts from the same weights.

    The caller's random state is left as it was (the seed is used inside a forked RNG).
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # DDP would broadcast rank 0's weights anyway; a shared seed makes that a no-op
        return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))


def build_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.SGD:
    """The run's optimizer: SGD with cfg.lr and cfg.momentum (no dampening, weight decay or Nesterov).

    Every rank, the resume check and the one-process reference build it here, so that they cannot differ.
    """
    return torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)


def flat_params(model: nn.Module) -> torch.Tensor:
    """All parameters as one float32 CPU vector, in model.parameters() order."""
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in model.parameters()])


def fingerprint(tensors) -> int:
    """A 64-bit hash (XXH3) of the tensors' bytes: equal when the values are bitwise equal (a collision: 1 in 2**64).

    Accepts one tensor or an iterable of them (e.g. model.parameters()), hashed in order without copying.
    NumPy arrays are accepted too: CPU views made once (`p.detach().numpy()`) skip the per-call conversions.
    """
    if isinstance(tensors, (torch.Tensor, np.ndarray)):
        tensors = [tensors]
    # XXH3, not SHA-256: it runs every step on every rank, and XXH3 is much faster (docs/benchmarks.md). Two different
    # parameter sets share a hash with odds of 1 in 2**64; nobody is forging parameters, so no need for crypto.
    h = xxhash.xxh3_64()
    for t in tensors:
        if isinstance(t, torch.Tensor):
            t = t.detach().contiguous().cpu().numpy()
        h.update(np.ascontiguousarray(t))
    return int.from_bytes(h.digest(), "little", signed=True)  # signed: it is stored in int64 telemetry


def n_params(model: nn.Module) -> int:
    """Number of scalar parameters."""
    return sum(p.numel() for p in model.parameters())
