"""Without a torchvision that loads (none, or PyPI's CUDA build beside a CPU torch): mnist falls back to mnist-5k
at the default folder with a one-line note, and the listing's per-sample pipeline computes the same bits."""
from __future__ import annotations

import sys

import pytest
import torch

from ddp_helpers.data.splits import DataError
from ddp_helpers.data import sources
from ddp_helpers.data.splits import SeedListingDataset, _to_tensor_normalized


@pytest.mark.needs_torchvision
def test_the_pipeline_without_torchvision_gives_torchvisions_bits(monkeypatch):
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


def _refusal_without_torchvision(monkeypatch, root) -> str:
    """load_data's DataError for dataset='mnist' at root, with torchvision made unimportable."""
    from ddp_helpers import TrainConfig

    monkeypatch.setitem(sys.modules, "torchvision", None)
    sources.clear_cache()
    try:
        with pytest.raises(DataError) as e:
            sources.load_data(TrainConfig(dataset="mnist", data_root=str(root)))
    finally:
        sources.clear_cache()
    return str(e.value)


def test_a_named_root_holding_mnist_says_torchvision_is_missing_not_the_files(monkeypatch, tmp_path):
    """With MNIST's four files in place, the refusal blames torchvision (install it), not files that are there."""
    from test_data import _fake_raw

    _fake_raw(tmp_path / "MNIST" / "raw")
    msg = _refusal_without_torchvision(monkeypatch, tmp_path)
    assert msg.startswith(f"TrainConfig.data_root={str(tmp_path)!r} holds MNIST's files in "), msg
    assert "lacks" not in msg and "but torchvision can't be imported with this torch (" in msg, msg
    assert "install the torchvision paired with this torch" in msg and "dataset='mnist-5k'" in msg, msg


def test_a_named_empty_root_still_says_it_lacks_the_files(monkeypatch, tmp_path):
    """No files and no torchvision: the refusal names the missing files and why they can't be downloaded."""
    msg = _refusal_without_torchvision(monkeypatch, tmp_path)
    assert msg.startswith(f"TrainConfig.data_root={str(tmp_path)!r} holds no MNIST: "), msg
    assert "can't be downloaded (torchvision can't be imported)" in msg and "dataset='mnist-5k'" in msg, msg
