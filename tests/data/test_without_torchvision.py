"""Without a torchvision that loads (none, or PyPI's CUDA build beside a CPU torch): mnist falls back to mnist-5k
at the default folder with a one-line note, and the listing's per-sample pipeline computes the same bits."""
from __future__ import annotations

import sys

import pytest
import torch

from ddp_helpers.data.splits import DataError
from ddp_helpers.data import sources
from ddp_helpers.data.splits import SeedListingDataset, _to_tensor_normalized


def test_the_pipeline_without_torchvision_gives_torchvisions_bits(monkeypatch):
    pytest.importorskip("torchvision.transforms", exc_type=ImportError)
    images = torch.randint(0, 256, (16, 28, 28), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    labels = torch.arange(16) % 10
    with_tv = SeedListingDataset(images, labels)
    monkeypatch.setitem(sys.modules, "torchvision", None)  # `from torchvision import ...` raises ImportError
    without = SeedListingDataset(images, labels)
    assert without.transform is _to_tensor_normalized
    for i in range(len(labels)):
        a, b = with_tv[i][0], without[i][0]
        assert a.dtype == b.dtype and a.shape == b.shape == (1, 28, 28) and torch.equal(a, b), i


def test_mnist_falls_back_to_mnist5k_when_torchvision_cannot_load(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "torchvision", None)
    splits = sources._decode_cached.__wrapped__("mnist", str(tmp_path), True)
    assert splits.name == "mnist-5k" and "torchvision can't be imported" in splits.notice, splits.notice
    assert splits.notice.count("\n") == 0
    with pytest.raises(DataError, match="torchvision, which can't be imported here.*dataset='mnist-5k'"):
        sources._decode_cached.__wrapped__("mnist", str(tmp_path), False)  # a data_root the user named
