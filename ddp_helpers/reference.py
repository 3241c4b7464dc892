"""The same training in one process on the global batch: what DDP must match."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import torch
import torch.nn.functional as F

from .config import TrainConfig
from .data import DataSplits, load_data, shard_indices, steps_per_epoch
from .model import build_model, fingerprint, flat_params


@dataclass
class ReferenceResult:
    """Per-step global-batch losses and the parameters of the single-process run."""

    loss: np.ndarray  # mean loss over the global batch (all ranks' samples of that step)
    param_fingerprint: List[str]  # after each step, same hashing as TrainResult
    final_params: np.ndarray  # flattened parameters at the end


def global_batches(cfg: TrainConfig, n: int, epoch: int) -> List[torch.Tensor]:
    """Per step, the indices all ranks use together: rank 0's batch, then rank 1's, ... (DistributedSampler shards)."""
    shards = [shard_indices(n, r, cfg.world_size, cfg.seed, epoch) for r in range(cfg.world_size)]
    per_rank = cfg.batch_size * cfg.accumulation_steps
    return [torch.cat([s[i:i + per_rank] for s in shards]) for i in range(0, len(shards[0]), per_rank)]


def train_single_process(cfg: TrainConfig, data: Optional[DataSplits] = None,
                         max_steps: Optional[int] = None) -> ReferenceResult:
    """Train one model on the concatenation of every rank's batch per step (one process, no DDP).

    With equal per-rank batches, mean-loss gradients here equal the average of the ranks' gradients, so
    the parameters must match the DDP run up to floating-point rounding.
    """
    data = data or load_data(cfg)
    torch.set_num_threads(cfg.threads_per_rank or 1)
    model = build_model(cfg.seed)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    images = data.train_normalized()
    n = len(data.train_labels)
    batches_per_epoch = steps_per_epoch(n, cfg.world_size, cfg.batch_size)
    per_epoch = -(-batches_per_epoch // cfg.accumulation_steps)
    end = cfg.epochs * per_epoch
    for limit in (cfg.max_steps, max_steps):
        if limit is not None:
            end = min(end, limit)
    losses, prints = [], []
    step = 0
    for epoch in range(cfg.epochs):
        for idx in global_batches(cfg, n, epoch):
            if step >= end:
                break
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(images[idx]), data.train_labels[idx])
            loss.backward()
            opt.step()
            losses.append(loss.item())
            prints.append(f"{fingerprint(list(model.parameters())) & 0xFFFFFFFFFFFFFFFF:016x}")
            step += 1
    return ReferenceResult(np.array(losses), prints, flat_params(model).numpy())
