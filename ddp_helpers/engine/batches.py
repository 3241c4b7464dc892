"""What each rank iterates over: its DistributedSampler shard of the shared tensors, or the listing's DataLoader."""
from __future__ import annotations

import multiprocessing
import sys
from typing import Iterator, Optional, Tuple

import torch

from ..ranks.cores import unbind_this_process
from ..ranks.starting import die_with_parent
from .config import TrainConfig
from ..data import DataSplits, SeedListingDataset, map_pages, shard_indices

Batch = Tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # images, labels, sample indices


def shard_batches(cfg: TrainConfig, rank: int, world_size: int, epoch: int, images: torch.Tensor,
                  labels: torch.Tensor) -> Iterator[Batch]:
    """This rank's batches of one epoch: its own disjoint shard, what the listing lacks (it has no sampler)."""
    idx_all = shard_indices(len(labels), rank, world_size, cfg.seed, epoch)
    on_cpu = images.device.type == "cpu"
    for start in range(0, len(idx_all), cfg.batch_size):
        idx = idx_all[start:start + cfg.batch_size]
        dev_idx = idx if on_cpu else idx.to(images.device, non_blocking=True)
        # index_select, not images[idx]: the same rows, faster on CPU than advanced indexing (docs/benchmarks.md)
        yield images.index_select(0, dev_idx), labels.index_select(0, dev_idx), idx


def _listing_batches(loader: torch.utils.data.DataLoader, device: torch.device) -> Iterator[Batch]:
    for batch_idx, (x, y, idx) in enumerate(loader):
        # The listing prints every batch. Here stdout is the rank's log file, so the notebook stays clean,
        # but the cost is kept: this path exists to measure the listing as written.
        print(f"Process {device}, Batch {batch_idx}")
        yield x.to(device), y.to(device), idx


def loader_worker_init(_: int) -> None:
    """A DataLoader worker: dies with its rank, may use every core, and runs one torch thread."""
    die_with_parent()
    unbind_this_process()  # the rank's own core binding is not for its loader workers: they may use any core
    torch.set_num_threads(1)


def listing_loader(cfg: TrainConfig, data: DataSplits) -> torch.utils.data.DataLoader:
    """Listing 7.2's loader: per-sample transforms, shuffle with the same seed on every rank, no sampler."""
    gen = torch.Generator().manual_seed(cfg.seed)
    return torch.utils.data.DataLoader(SeedListingDataset(data.train_images, data.train_labels),
                                       batch_size=cfg.batch_size, shuffle=True, generator=gen,
                                       num_workers=cfg.num_workers, worker_init_fn=loader_worker_init,
                                       persistent_workers=cfg.num_workers > 0,
                                       multiprocessing_context=_workers_start_method(cfg.num_workers))


def _workers_start_method(num_workers: int) -> Optional[str]:
    """How the loader starts its workers: as the rank itself was started (spawned by the listing's mp.spawn, so
    each worker imports torch again, a cost the seed pipeline exists to measure), except under a forkserver.
    A rank forked by the package's forkserver would start a forkserver of its own just for its workers (seconds
    of imports that the listing never pays); on Linux they are forked from the rank instead."""
    if num_workers > 0 and sys.platform.startswith("linux") and \
            multiprocessing.get_start_method(allow_none=True) == "forkserver":
        return "fork"
    return None


class RankBatches:
    """rank_batches(epoch) -> this rank's batches of that epoch, for cfg.pipeline; close() when training ends."""

    def __init__(self, cfg: TrainConfig, data: DataSplits, rank: int, world_size: int, device: torch.device):
        self.cfg, self.rank, self.world_size, self.device = cfg, rank, world_size, device
        self.loader: Optional[torch.utils.data.DataLoader] = None
        if cfg.pipeline == "seed":
            self.loader = listing_loader(cfg, data)
            return
        # Decoded and normalized once in the parent; on a GPU copied once, so a batch is a single gather.
        self.images = data.train_normalized().to(device)
        self.labels = data.train_labels.to(device)
        if device.type == "cpu":  # the parent's shared pages: map them now, not at the loop's first gathers
            map_pages(self.images)
            map_pages(self.labels)

    def __call__(self, epoch: int) -> Iterator[Batch]:
        if self.loader is not None:
            return _listing_batches(self.loader, self.device)
        return shard_batches(self.cfg, self.rank, self.world_size, epoch, self.images, self.labels)

    def close(self) -> None:
        """Stop the listing loader's workers now: the rank ends with os._exit, which would skip the finalizers
        that release their queues' semaphores (Python then warns about "leaked semaphore objects")."""
        self.loader = None
