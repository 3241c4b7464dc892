"""The data as every rank sees it: DataSplits, the listing's normalization, and DistributedSampler's shards."""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..common.errors import SaysSettings, render
from ..common.shared import guard



class DataError(SaysSettings, RuntimeError):
    """A data file is missing or unreadable; the message says which, where, and how to get it (on one line)."""

    def __init__(self, message: object = "", *rest: object):
        self.marked = str(message)
        super().__init__(render(self.marked), *rest)


class CachedDataChanged(UserWarning):
    """The data cache's tensors were changed in place since they were loaded (they are loaded again)."""


warnings.simplefilter("always", CachedDataChanged)  # every time: each edit is a new one

FIELDS = ("train_images", "train_labels", "test_images", "test_labels", "_train_float")


def digest(t: torch.Tensor) -> int:
    """xxh3 of the bytes t's storage holds (a small part of a load: docs/benchmarks.md)."""
    import xxhash

    raw = torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage())  # its bytes, whatever its dtype
    return xxhash.xxh3_64_intdigest(raw.numpy())


Layout = Tuple[Any, ...]  # what a tensor's in-place metadata ops change: see layout()


def layout(t: torch.Tensor) -> Layout:
    """What t's in-place metadata ops change (transpose_, resize_, unsqueeze_, as_strided_, set_), which its
    bytes' digest can't see: dtype, shape, strides, storage offset, and which storage (address and size)."""
    storage = t.untyped_storage()
    return (t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), storage.data_ptr(), storage.nbytes())


_LAYOUT_WORDS = ("dtype", "shape", "strides", "storage offset")


def layout_change(before: Layout, after: Layout) -> str:
    """'' if the layouts are equal, else what changed, e.g. 'its shape went from (5000,) to (100,)'."""
    said = [f"its {word} went from {b} to {a}" for word, b, a in zip(_LAYOUT_WORDS, before, after) if b != a]
    if before[4:] != after[4:]:
        said.append("its storage was replaced")
    return ", ".join(said)


def fingerprint(t: torch.Tensor) -> Tuple[Layout, int]:
    """t's layout and its bytes' digest: together, what no in-place op changes without changing one of them."""
    return layout(t), digest(t)


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
    _digests: Dict[str, Tuple[Layout, int]] = field(default_factory=dict)  # each cached tensor's when it was made

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
                self._digests["_train_float"] = fingerprint(self._train_float)
        return self._train_float

    def guard(self, name: str, forget: Callable[[], None]) -> None:
        """Register these shared tensors as read-only for ranks, named `name`.<field> (common/shared.py)."""
        self._guard = (name, forget)
        for name_ in FIELDS[:4]:
            guard(getattr(self, name_).untyped_storage().data_ptr(), f"{name}.{name_}", forget)
            self._digests[name_] = fingerprint(getattr(self, name_))
        if self._train_float is not None:
            self._digests["_train_float"] = fingerprint(self._train_float)

    def changed(self) -> List[str]:
        """The cached tensors changed in place since loaded: their bytes (named as a notebook reaches them, e.g.
        "load_data('mnist-5k').train_normalized()"), or their shape, strides, offset or storage (named so, with
        what changed: "load_data('mnist-5k').train_labels (its shape went from (5000,) to (100,))")."""
        name = self._guard[0] if self._guard is not None else f"load_data({self.name!r})"
        found = []
        for f, (was, bytes_were) in self._digests.items():
            shown = f"{name}.{'train_normalized()' if f == '_train_float' else f}"
            t = getattr(self, f)
            moved = layout_change(was, layout(t)) if isinstance(t, torch.Tensor) else "it is no longer a tensor"
            if moved:
                found.append(f"{shown} ({moved})")
            elif digest(t) != bytes_were:
                found.append(shown)
        return found

    def warn_changed(self, what: List[str]) -> None:
        """Say that the cached tensors `what` were changed in place, and that they are loaded again."""
        warnings.warn(
            f"the cached {self.name} data ({', '.join(what)}) were changed in place since they were loaded (an "
            "in-place op such as IMAGES.mul_(2), x.sub_(mean) or images[:] = ... on them or a slice of them, or one "
            "that changes their shape or storage such as transpose_(), resize_() or set_(), in this "
            "process or in a rank forked from it): they are loaded again from the files, so this run uses the data "
            "as they are stored. Tensors taken before (e.g. a global IMAGES) still hold the changed values: take "
            "them again from load_data(...), and change a copy (x = x.clone() first, or x = x * 2)",
            CachedDataChanged, stacklevel=4)

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
    page faults. Paid here in one pass it costs little; paid by the loop's random batch gathers it made the first
    gathers several times slower (docs/benchmarks.md).
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
