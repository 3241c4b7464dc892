"""The per-rank training loop: one process runs this with the process group already initialized."""
from __future__ import annotations

import gc
import math
import os
import resource
import signal
import time
from contextlib import nullcontext
from typing import Iterator, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import xxhash
from torch.nn.parallel import DistributedDataParallel as DDP

from ._proc import die_with_parent, unbind_this_process
from .checkpoint import load_checkpoint, save_checkpoint
from .config import TrainConfig
from .data import (DataSplits, load_data, map_pages, normalize, SeedListingDataset, shard_indices,
                   steps_per_epoch)
from .hooks import GradRecorder, recording_allreduce_hook
from .model import build_model, fingerprint, flat_params
from .telemetry import (F_LOCAL, F_LOSS, F_START, F_SYNCED, F_TIME, I_FPRINT, I_SAMPLES, I_STEP, R_ALLREDUCES,
                        R_BYTES, R_CORRECT, R_CUDA, R_RSS, R_T_END, R_T_FIRST, R_T_INIT, R_THREADS, R_TOTAL,
                        TelemetryBuffers)

Batch = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # images, labels, sample indices


class InjectedFault(RuntimeError):
    """Raised on purpose by fault injection (cfg.fault_rank/fault_step), to show what a failing rank does."""


def device_for(rank: int, backend: str) -> torch.device:
    """nccl: one GPU per rank (cuda:<local rank>); gloo: the CPU."""
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", rank))  # under torchrun several nodes each count from 0
        torch.cuda.set_device(local)  # without this every rank would allocate on cuda:0
        return torch.device("cuda", local)
    return torch.device("cpu")


def plan_steps(cfg: TrainConfig, n_train: int, world_size: int, start_step: int = 0) -> Tuple[int, int, int]:
    """(optimizer steps per epoch, first global step, end global step) for this run."""
    batches = steps_per_epoch(n_train, world_size, cfg.batch_size, cfg.pipeline)
    per_epoch = -(-batches // cfg.accumulation_steps)
    end = cfg.epochs * per_epoch
    if cfg.max_steps is not None:
        end = min(end, cfg.max_steps)
    return per_epoch, start_step, max(end, start_step)


def _default_batches(cfg: TrainConfig, rank: int, world_size: int, epoch: int,
                     device: torch.device, images: torch.Tensor, labels: torch.Tensor) -> Iterator[Batch]:
    # Each rank gets its own disjoint shard: what the listing lacks (it has no DistributedSampler).
    idx_all = shard_indices(len(labels), rank, world_size, cfg.seed, epoch)
    for start in range(0, len(idx_all), cfg.batch_size):
        idx = idx_all[start:start + cfg.batch_size]
        dev_idx = idx if device.type == "cpu" else idx.to(device, non_blocking=True)
        # index_select, not images[idx]: the same rows, but ~4x faster on CPU than advanced indexing
        yield images.index_select(0, dev_idx), labels.index_select(0, dev_idx), idx


def _seed_batches(loader, device: torch.device) -> Iterator[Batch]:
    for batch_idx, (x, y, idx) in enumerate(loader):
        # The listing prints every batch. Here stdout is the rank's log file, so the notebook stays clean,
        # but the cost is kept: this path exists to measure the listing as written.
        print(f"Process {device}, Batch {batch_idx}")
        yield x.to(device), y.to(device), idx


def _loader_worker_init(_: int) -> None:
    die_with_parent()
    unbind_this_process()  # the rank's own core binding is not for its loader workers: they may use any core
    torch.set_num_threads(1)


def _samples_hash(idx) -> int:
    """A 64-bit hash (XXH3) of the int64 sample indices: equal on two ranks exactly when they used the same samples."""
    arr = np.ascontiguousarray(np.asarray(idx, dtype=np.int64))
    return int.from_bytes(xxhash.xxh3_64_digest(arr), "little", signed=True)


def _inject_fault(cfg: TrainConfig, rank: int, step: int) -> None:
    if cfg.fault_rank != rank or cfg.fault_step != step:
        return
    if cfg.fault_kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if cfg.fault_kind == "hang":
        time.sleep(10**6)
    raise InjectedFault(f"injected fault on rank {rank} at step {step}")


def train(rank: int, world_size: int, cfg: TrainConfig, backend: str, data: Optional[DataSplits],
          buf: TelemetryBuffers) -> dict:
    """Train this rank's replica; write per-step telemetry into buf[rank]; return a small summary.

    data=None makes the rank load the data set itself, as every rank of Listing 7.2 does.
    """
    info = buf.rank_info[rank]
    info[R_T_INIT] = time.monotonic()
    info[R_THREADS] = torch.get_num_threads()
    device = device_for(rank, backend)
    if data is None:
        data = load_data(cfg, quiet=True)  # the listing's way: every rank reads (or downloads) its own copy

    model = build_model(cfg.seed).to(device)
    optimizer_state = None
    start_step = 0
    if cfg.resume_from is not None:
        ckpt = load_checkpoint(cfg.resume_from, device)
        model.load_state_dict(ckpt["model"])
        optimizer_state, start_step = ckpt["optimizer"], int(ckpt["step"])
    # DDP broadcasts rank 0's parameters now and registers autograd hooks that all-reduce gradients in buckets.
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    recorder = GradRecorder(cfg.comm_hook, record=cfg.telemetry)
    if cfg.telemetry or cfg.comm_hook != "allreduce":
        # Our hook records each bucket's local gradient, then all-reduces it (DDP's own step, done in Python).
        # Without telemetry the bare loop keeps DDP's built-in C++ all-reduce.
        ddp.register_comm_hook(recorder, recording_allreduce_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=cfg.lr, momentum=cfg.momentum)
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)

    n_train = len(data.train_labels)
    per_epoch, first, end = plan_steps(cfg, n_train, world_size, start_step)
    if end - first > buf.capacity:
        raise RuntimeError(f"telemetry buffers hold {buf.capacity} steps, the run needs {end - first}")
    A = cfg.accumulation_steps
    params = list(model.parameters())
    # What the fingerprint hashes: on CPU, NumPy views made once (the optimizer updates the parameters in place).
    hashed = [p.detach().numpy() for p in params] if device.type == "cpu" else params
    capture_steps = {s: i for i, s in enumerate(cfg.capture_grad_steps)}

    if cfg.pipeline == "seed":
        # Listing 7.2's loader: same seed on every rank and no sampler, so all ranks see the same batches.
        dataset = SeedListingDataset(data.train_images, data.train_labels)
        gen = torch.Generator().manual_seed(cfg.seed)
        loader = torch.utils.data.DataLoader(dataset, batch_size=cfg.batch_size, shuffle=True, generator=gen,
                                             num_workers=cfg.num_workers, worker_init_fn=_loader_worker_init,
                                             persistent_workers=cfg.num_workers > 0)
        images = labels = None
    else:
        # Decoded and normalized once in the parent; on a GPU copied once, so a batch is a single gather.
        images = data.train_normalized().to(device)
        labels = data.train_labels.to(device)
        if device.type == "cpu":  # the parent's shared pages: map them now, not at the loop's first gathers
            map_pages(images)
            map_pages(labels)

    def epoch_batches(epoch: int) -> Iterator[Batch]:
        if cfg.pipeline == "seed":
            return _seed_batches(loader, device)
        return _default_batches(cfg, rank, world_size, epoch, device, images, labels)

    # torch (and the torch._dynamo that DDP imports) leaves millions of long-lived objects; freezing them keeps
    # Python's full garbage collections from walking them in the middle of a step (tens of ms each).
    gc.collect()
    gc.freeze()
    row = 0
    gstep = first
    # numpy views of this rank's shared rows: element writes cost ~0.2 us instead of ~9 us through torch
    f64, i64, samples = buf.f64[rank].numpy(), buf.i64[rank].numpy(), buf.samples[rank].numpy()
    count = buf.count.numpy()
    for epoch in range(first // per_epoch, cfg.epochs):
        if gstep >= end:
            break
        batches = epoch_batches(epoch)
        skip = (gstep - epoch * per_epoch) * A  # after a resume: batches of this epoch already trained on
        for _ in range(skip):
            next(batches)
        exhausted = False
        while gstep < end and not exhausted:
            micro: List[Batch] = []
            for _ in range(A):
                b = next(batches, None)
                if b is None:
                    exhausted = True
                    break
                micro.append(b)
            if not micro:
                break
            _inject_fault(cfg, rank, gstep)
            t0 = time.monotonic()
            if row == 0:
                info[R_T_FIRST] = t0
            capture = cfg.telemetry and gstep in capture_steps
            recorder.start_step(capture)
            optimizer.zero_grad(set_to_none=True)
            loss_sum = None
            for j, (x, y, _) in enumerate(micro):
                # no_sync: skip the all-reduce for all but the last micro-batch; gradients accumulate locally.
                sync_ctx = ddp.no_sync() if j < len(micro) - 1 else nullcontext()
                with sync_ctx:
                    loss = F.cross_entropy(ddp(x), y)
                    # The last backward fires the hook per bucket: all-reduce overlaps the rest of backward.
                    (loss / len(micro) if len(micro) > 1 else loss).backward()
                loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
            if capture:
                # After backward() every p.grad holds the averaged gradient: identical on all ranks.
                ci = capture_steps[gstep]
                buf.captures[rank, ci, 0] = torch.cat(
                    [recorder.local_grads[id(p)].reshape(-1).float().cpu() for p in params])
                buf.captures[rank, ci, 1] = torch.cat([p.grad.reshape(-1).float().cpu() for p in params])
                buf.capture_done[rank, ci] = True
            optimizer.step()  # same averaged gradient + same start = same update on every replica
            idx = micro[0][2] if len(micro) == 1 else torch.cat([m[2] for m in micro])
            if cfg.telemetry:
                sq = recorder.squared_norms()
                mean_loss = loss_sum / len(micro) if len(micro) > 1 else loss_sum
                if sq is None:  # no all-reduce ran (e.g. only no_sync micro-batches)
                    loss_v, local_v, synced_v = mean_loss.item(), math.nan, math.nan
                else:
                    loss_v, local_sq, synced_sq = torch.stack([mean_loss, *sq]).tolist()  # one device sync per step
                    local_v, synced_v = math.sqrt(local_sq), math.sqrt(synced_sq)
                f64[row, F_LOSS], f64[row, F_LOCAL], f64[row, F_SYNCED] = loss_v, local_v, synced_v
                i64[row, I_FPRINT] = fingerprint(hashed)
                idx_np = idx.numpy()
                i64[row, I_SAMPLES] = _samples_hash(idx_np)
                samples[row, :len(idx_np)] = idx_np
            i64[row, I_STEP] = gstep
            t1 = time.monotonic()
            f64[row, F_START], f64[row, F_TIME] = t0, t1 - t0
            row += 1
            gstep += 1
            count[rank] = row  # publish last: rows below count are complete
            if rank == 0 and cfg.checkpoint_dir is not None and (
                    gstep == end or (cfg.checkpoint_every and gstep % cfg.checkpoint_every == 0)):
                # Rank 0 alone writes: all replicas are identical, so one copy is enough (and no write races).
                save_checkpoint(cfg.checkpoint_dir, gstep, model.state_dict(), optimizer.state_dict(),
                                cfg.to_dict())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    info[R_T_END] = time.monotonic()
    # Stop the seed pipeline's loader workers now: the rank ends with os._exit, which would skip the finalizers
    # that release their queues' semaphores (Python then warns about "leaked semaphore objects").
    batches = loader = None  # noqa: F841
    info[R_BYTES], info[R_ALLREDUCES] = recorder.bytes_sent, recorder.calls

    correct, total = evaluate(model, data, rank, world_size, device)
    info[R_CORRECT], info[R_TOTAL] = correct, total
    usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss + resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    info[R_RSS] = usage * 1024  # ru_maxrss is in KiB on Linux
    if device.type == "cuda":
        info[R_CUDA] = torch.cuda.max_memory_allocated(device)
    return {"final_params": flat_params(model).numpy() if rank == 0 else None}


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
