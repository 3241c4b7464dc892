"""The per-rank training loop: Listing 7.2's loop, fixed, run by every rank with its process group initialized.

`train` is the whole DDP story in order: a device per rank, the model wrapped in DDP, this rank's shard,
then zero_grad -> forward -> loss -> backward (where DDP all-reduces the gradients) -> step.
Telemetry, fault injection and checkpoints are one call each; their details live in their own modules.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ..ranks.env import rank_gpu
from ..ranks.starting import freeze_heap
from .batches import Batch, RankBatches
from .checkpoint import CheckpointError, resume, save_if_due
from .config import TrainConfig
from ..data import DataSplits, load_data, normalize
from .faults import inject_fault
from .hooks import attach_recorder
from .model import build_model, build_optimizer, flat_params, n_params
from .plan import StepPlan
from .rng import seed_rank
from .telemetry import RankTelemetry, TableShape


def device_for(rank: int, backend: str) -> torch.device:
    """nccl: one GPU per rank (cuda:<local rank>, or cuda:0 where SLURM showed each task its own: ranks/env.py);
    gloo: the CPU."""
    if backend == "nccl":
        index = rank_gpu(rank)  # LOCAL_RANK: under torchrun several nodes each count from 0
        torch.cuda.set_device(index)  # without this every rank would allocate on cuda:0
        return torch.device("cuda", index)
    return torch.device("cpu")


def train(rank: int, world_size: int, cfg: TrainConfig, backend: str, data: Optional[DataSplits],
          run_dir: str) -> dict:
    """Train this rank's replica; its per-step records go to its rows file in run_dir; returns rank 0's final
    parameters."""
    device = device_for(rank, backend)
    seed_rank(cfg.seed, rank)  # each rank its own dropout masks etc., the same ones in every run of this seed
    data = data or load_data(cfg, quiet=True)  # None: every rank loads its own copy, as the listing's do
    model = build_model(cfg.seed).to(device)  # the same seed on every rank: the same starting weights
    optimizer = build_optimizer(model, cfg)
    start_step = resume(cfg.resume_from, model, optimizer, device, rank)  # with this rank's generator states
    # DDP broadcasts rank 0's parameters now and registers autograd hooks that all-reduce gradients in buckets.
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    plan = StepPlan.for_run(cfg, len(data.train_labels), world_size, start_step)
    telemetry = RankTelemetry(run_dir, rank, TableShape.for_run(cfg, plan.n_steps, n_params(model)), cfg, model,
                              attach_recorder(ddp, cfg.comm_hook, cfg.telemetry))
    batches = RankBatches(cfg, data, rank, world_size, device)  # this rank's shard, reshuffled every epoch
    freeze_heap()
    missed = None  # why the final checkpoint could not be written, if it couldn't
    for step, micro in plan.steps(batches):
        inject_fault(cfg, rank, step)
        telemetry.begin(step)
        optimizer.zero_grad(set_to_none=True)
        loss = forward_backward(ddp, micro)  # the last backward all-reduces the gradients, bucket by bucket
        optimizer.step()  # same averaged gradient + same start = same update on every replica
        telemetry.end(step, loss, sample_ids(micro))
        try:
            save_if_due(cfg, rank, step + 1, plan.end, model, optimizer, device)  # all ranks: they send RNG states
        except CheckpointError as e:  # the last one: the training is done, and its result is kept
            missed = str(e)
    telemetry.training_done(device)
    batches.close()
    telemetry.finish(*evaluate(model, data, rank, world_size, device), device)
    return {"final_params": flat_params(model).numpy() if rank == 0 else None, "checkpoint_error": missed}


def forward_backward(ddp: DDP, micro: List[Batch]) -> torch.Tensor:
    """Forward and backward over the step's micro-batches; return the mean loss (detached).

    With one micro-batch this is the listing's `loss = F.cross_entropy(ddp(x), y); loss.backward()`.
    With several, all but the last skip the all-reduce (no_sync): gradients add up locally, and the last
    backward averages the sum across ranks once.
    """
    loss_sum = None
    for j, (x, y, _) in enumerate(micro):
        with ddp.no_sync() if j < len(micro) - 1 else nullcontext():
            loss = F.cross_entropy(ddp(x), y)
            (loss / len(micro) if len(micro) > 1 else loss).backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    return loss_sum / len(micro) if len(micro) > 1 else loss_sum


def sample_ids(micro: List[Batch]) -> torch.Tensor:
    """The indices of every sample the step used, in order."""
    return micro[0][2] if len(micro) == 1 else torch.cat([m[2] for m in micro])


@torch.no_grad()
def evaluate(model: torch.nn.Module, data: DataSplits, rank: int, world_size: int, device: torch.device,
             chunk: int = 2048) -> Tuple[int, int]:
    """Test accuracy: each rank scores a disjoint slice, then one all_reduce sums the counts."""
    model.eval()
    idx = torch.arange(rank, len(data.test_labels), world_size)  # no padding: every test image counted once
    correct = torch.zeros(2, dtype=torch.float64, device=device)
    for s in range(0, len(idx), chunk):
        part = idx[s:s + chunk]
        x = normalize(data.test_images[part]).to(device)
        y = data.test_labels[part].to(device)
        correct[0] += (model(x).argmax(1) == y).sum()
        correct[1] += len(part)
    dist.all_reduce(correct)  # sum over ranks; gloo and nccl both support float64 sums
    model.train()
    return int(correct[0].item()), int(correct[1].item())
