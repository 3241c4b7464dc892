"""What several checks share to compare against: the model and the checkpoints' optimizer, per-rank batches and
one-process gradients."""
from __future__ import annotations

from typing import List, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from ..engine.model import build_model

GRAD_BATCH = 16  # samples per rank in the gradient and checkpoint exercises


def reference_model(seed: int) -> torch.nn.Module:
    """build_model for the parent's references, without moving the notebook's global random state."""
    with torch.random.fork_rng(devices=[]):
        return build_model(seed)


def checkpoint_optimizer(model: torch.nn.Module) -> torch.optim.SGD:
    """The checkpoint exercises' optimizer: SGD with momentum, so that a checkpoint holds optimizer state."""
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def rank_batch(rank: int, k: int, n: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """A batch that differs by rank (and by k), the same every time it is asked for."""
    g = torch.Generator().manual_seed(1000 + 97 * rank + k)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def reference_grads(world_size: int, micro_ids: Sequence[int], batch: int) -> List[np.ndarray]:
    """One process, per parameter: the gradient of the mean loss over the given batches of every rank."""
    model = reference_model(0)
    xs, ys = zip(*[rank_batch(r, k, batch) for r in range(world_size) for k in micro_ids])
    F.cross_entropy(model(torch.cat(xs)), torch.cat(ys)).backward()
    return [p.grad.reshape(-1).double().numpy() for p in model.parameters()]
