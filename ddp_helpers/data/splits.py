"""The data as every rank sees it: DataSplits, the listing's normalization, and DistributedSampler's shards."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from ..common.shared import guard



class DataError(RuntimeError):
    """A data file is missing or unreadable; the message says which, where, and how to get it."""


@dataclass
class DataSplits:
    """Train and test images as uint8 (N, 28, 28) tensors with int64 labels, plus where they came from."""

    name: str  # the data set actually used (after any fallback)
    source: str  # a short human description of where the files were read from
    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor
    notice: Optional[str] = None  # one-line fallback notice, if the requested data set was replaced
    _train_float: Optional[torch.Tensor] = None
    _guard: Optional[Tuple[str, Callable[[], None]]] = None  # (name, forget) once the data cache holds these

    def train_normalized(self) -> torch.Tensor:
        """Training images as normalized float32 in shared memory: computed once, then mapped by every rank.

        run_training calls it before launching, so the ranks receive the finished tensor instead of each
        normalizing its own 188 MB copy (for 60,000 images) during start-up.
        """
        if self._train_float is None:
            self._train_float = normalize(self.train_images).share_memory_()
            if self._guard is not None:
                guard(self._train_float.untyped_storage().data_ptr(), f"{self._guard[0]}.train_normalized()",
                      self._guard[1])
        return self._train_float

    def guard(self, name: str, forget: Callable[[], None]) -> None:
        """Register these shared tensors as read-only for ranks, named `name`.<field> (common/shared.py)."""
        self._guard = (name, forget)
        for field in ("train_images", "train_labels", "test_images", "test_labels"):
            guard(getattr(self, field).untyped_storage().data_ptr(), f"{name}.{field}", forget)

    def share_memory_(self) -> "DataSplits":
        """Move the tensors to shared memory so ranks read them without copies."""
        for t in (self.train_images, self.train_labels, self.test_images, self.test_labels):
            t.share_memory_()
        return self


def normalize(images_u8: torch.Tensor) -> torch.Tensor:
    """uint8 pixels -> float, exactly ToTensor() then Normalize((0.5,), (0.5,)) as in the listing."""
    return images_u8.to(torch.float32).div_(255.0).sub_(0.5).div_(0.5)


def map_pages(t: torch.Tensor) -> None:
    """Read one element per 4 KiB page of t, so this process maps shared pages now and not inside the training loop.

    A rank that receives a shared tensor has it mapped but not yet in its page tables: its first touch of each
    page faults. Paid here in one pass it costs ~20 ms for 188 MB; paid by the loop's random batch gathers it
    made the first ~50 gathers 3-4x slower (measured on the 2-core VM of docs/benchmarks.md).
    """
    flat = t.reshape(-1)
    flat[::max(1, 4096 // flat.element_size())].sum()


def shard_indices(n: int, rank: int, world_size: int, seed: int, epoch: int, shuffle: bool = True) -> torch.Tensor:
    """The indices DistributedSampler gives `rank` in `epoch`: disjoint across ranks, padded to equal length."""
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(n), num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed)
    sampler.set_epoch(epoch)  # without set_epoch every epoch would repeat the same order
    return torch.tensor(list(iter(sampler)), dtype=torch.int64)


# ------------------------------------------------------------------------------------ the seed's pipeline
def _to_tensor_normalized(img) -> torch.Tensor:
    """ToTensor then Normalize((0.5,), (0.5,)) of a mode-L image, as torchvision's functional code computes them
    (to_tensor: view as C x H x W, float, div(255); normalize: sub_(mean).div_(std)): the same bits."""
    x = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(1, img.size[1], img.size[0])
    return x.to(torch.get_default_dtype()).div(255).sub_(0.5).div_(0.5)


class SeedListingDataset(torch.utils.data.Dataset):
    """Listing 7.2's per-sample path: uint8 -> PIL image -> ToTensor -> Normalize, one sample at a time."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels
        try:
            from torchvision import transforms
        except Exception:  # noqa: BLE001 - missing, or built for another torch: its two steps' own tensor ops
            self.transform = _to_tensor_normalized
        else:
            self.transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5,), (0.5,))])

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> Tuple[torch.Tensor, int, int]:
        from PIL import Image

        img = Image.fromarray(self.images[i].numpy(), mode="L")  # what torchvision's MNIST does per sample
        return self.transform(img), int(self.labels[i]), i  # i: so telemetry can see which samples were used
