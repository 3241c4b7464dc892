"""mnist-5k written as torchvision's MNIST files, for code that reads them with datasets.MNIST offline
(`python -m ddp_helpers.data write-mnist ROOT`)."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from ..common.files import atomic_write
from .catalog import DEFAULT_DATA_ROOT
from .sources import RAW_FILES, _looks_like_listing_root, _raw_dir, load_mnist5k
from .splits import DataError

MNIST5K_ROOT = "~/.pytorch/MNIST_5k/"  # where write-mnist's files go by default: a folder of their own


def idx_bytes(t: torch.Tensor) -> bytes:
    """A uint8 tensor as an IDX file (the format of MNIST's *-ubyte files): magic, sizes, then the bytes."""
    magic = 0x0800 + t.dim()  # 0x08: unsigned bytes; then the number of dimensions (3 images, 1 labels)
    header = magic.to_bytes(4, "big") + b"".join(int(n).to_bytes(4, "big") for n in t.shape)
    return header + t.contiguous().numpy().tobytes()


def write_mnist(root: str = MNIST5K_ROOT) -> str:
    """Write mnist-5k as torchvision's MNIST files (<root>/MNIST/raw/*-ubyte, 4,000 train / 1,000 test).

    torchvision's datasets.MNIST(root, download=True) then finds them and reads them offline (it checks only that
    the four files exist). Refuses the listing's own MNIST folder and a folder holding a different MNIST: there,
    4,000 digits would pass for the full data set and torchvision would never download the real one.
    Returns the raw folder; writing the same files again is a no-op.
    """
    root = os.path.abspath(os.path.expanduser(str(root)))
    if _looks_like_listing_root(root):
        raise DataError(f"write-mnist won't write into {root}: it is (or looks like) the listing's MNIST folder "
                        f"{DEFAULT_DATA_ROOT}, where 5,000 digits would pass for the full MNIST and stop torchvision "
                        f"from ever downloading it. Give it a folder of its own, e.g. {MNIST5K_ROOT}")
    raw = _raw_dir(root, "MNIST")
    if os.path.exists(os.path.join(root, "MNIST", "processed")):  # torchvision's old cache: read before raw/
        raise DataError(f"{os.path.join(root, 'MNIST', 'processed')} holds another MNIST (torchvision's old "
                        "format, which it reads first); choose an empty folder, e.g. " + MNIST5K_ROOT)
    d = load_mnist5k()
    files = dict(zip(RAW_FILES, (d.train_images, d.train_labels.to(torch.uint8), d.test_images,
                                 d.test_labels.to(torch.uint8))))
    contents = {f: idx_bytes(t) for f, t in files.items()}
    for f, data in contents.items():
        path = os.path.join(raw, f)
        other = os.path.exists(path + ".gz") or (os.path.exists(path) and Path(path).read_bytes() != data)
        if other:
            raise DataError(f"{raw} already holds a different MNIST ({f} differs from the 5,000-digit subset); "
                            "write-mnist never overwrites data: choose an empty folder, e.g. " + MNIST5K_ROOT)
    try:
        os.makedirs(raw, exist_ok=True)
        for f, data in contents.items():
            path = os.path.join(raw, f)
            if not os.path.exists(path):
                atomic_write(path, lambda tmp, data=data: Path(tmp).write_bytes(data))  # never a half-written file
    except OSError as e:
        raise DataError(f"can't write the MNIST files into {raw} ({e}); choose a writable folder") from e
    return raw
