"""The same training in one process on the global batch: what DDP must match."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import torch
import torch.nn.functional as F

from ..engine.config import TrainConfig
from ..data import DataSplits, load_data, shard_indices
from ..engine.model import build_model, build_optimizer, fingerprint, flat_params
from ..engine.plan import StepPlan
from ..engine.result import hex64


@dataclass
class ReferenceResult:
    """Per-step global-batch losses and the parameters of the single-process run."""

    loss: np.ndarray  # mean loss over the global batch (all ranks' samples of that step)
    param_fingerprint: List[str]  # after each step, same hashing as TrainResult
    final_params: np.ndarray  # flattened parameters at the end


def global_micro_batches(cfg: TrainConfig, n: int, epoch: int) -> List[List[torch.Tensor]]:
    """Per micro-batch, each rank's indices (DistributedSampler shards), as the ranks take them in `epoch`."""
    shards = [shard_indices(n, r, cfg.world_size, cfg.seed, epoch) for r in range(cfg.world_size)]
    return [[s[i:i + cfg.batch_size] for s in shards] for i in range(0, len(shards[0]), cfg.batch_size)]


def train_single_process(cfg: TrainConfig, data: Optional[DataSplits] = None,
                         max_steps: Optional[int] = None) -> ReferenceResult:
    """Train one model on the concatenation of every rank's samples per step (one process, no DDP).

    With equal per-rank batches, mean-loss gradients here equal the average of the ranks' gradients, so
    the parameters must match the DDP run up to floating-point rounding. The caller's torch thread count and
    random state are left as they were.
    """
    data = data or load_data(cfg)
    if max_steps is not None:
        cfg = cfg.replace(max_steps=min(max_steps, cfg.max_steps or max_steps))
    images, labels = data.train_normalized(), data.train_labels
    plan = StepPlan.for_run(cfg, len(labels), cfg.world_size)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads_per_rank or 1)
    try:
        model = build_model(cfg.seed)
        opt = build_optimizer(model, cfg)
        losses, prints = [], []
        for _, micro in plan.steps(lambda epoch: global_micro_batches(cfg, len(labels), epoch)):
            # rank 0's samples of the step (all its micro-batches), then rank 1's, ...
            idx = torch.cat([m[r] for r in range(cfg.world_size) for m in micro])
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(images[idx]), labels[idx])
            loss.backward()
            opt.step()
            losses.append(loss.item())
            prints.append(hex64(fingerprint(list(model.parameters()))))
    finally:
        torch.set_num_threads(threads)
    return ReferenceResult(np.array(losses), prints, flat_params(model).numpy())
