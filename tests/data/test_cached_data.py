"""The data cache is fingerprinted when loaded and checked before each use (issue 49, B4): an in-place edit of its
tensors, in a cell (the lessons' IMAGES global is the cache's own tensor) or in a forked rank, is named and the data
loaded again, so that no later run trains on changed data without a word."""
from __future__ import annotations

import warnings

import pytest
import torch

from ddp_helpers import launch, load_data, run_training
from ddp_helpers.data import CachedDataChanged, clear_cache
from ddp_helpers.data.splits import normalize


@pytest.fixture(autouse=True)
def fresh_cache():
    clear_cache()
    yield
    clear_cache()


def _as_stored(data) -> bool:
    return torch.equal(data.train_normalized(), normalize(data.train_images))


def test_images_mul_in_a_cell_is_named_and_the_data_loaded_again():
    IMAGES = load_data("mnist-5k").train_normalized()  # as the lessons take it
    IMAGES.mul_(2)
    with pytest.warns(CachedDataChanged, match=r"load_data\('mnist-5k'\)\.train_normalized\(\)\) were changed in "
                                               r"place since they were loaded.*IMAGES"):
        data = load_data("mnist-5k")
    assert data.train_normalized() is not IMAGES and _as_stored(data)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CachedDataChanged)
        assert load_data("mnist-5k") is data  # unchanged since: the cache is used, without a word


def test_an_in_place_normalization_of_the_raw_images_is_named():
    images = load_data("mnist-5k").train_images
    first = images[0].clone()
    images[:16] = images[:16] // 2  # a "normalization" written into a slice of the cache's tensor
    with pytest.warns(CachedDataChanged, match=r"load_data\('mnist-5k'\)\.train_images"):
        data = load_data("mnist-5k")
    assert torch.equal(data.train_images[0], first)


def _edit_in_a_forked_rank(rank: int, world_size: int) -> int:
    if rank == 0:
        load_data("mnist-5k", quiet=True).train_normalized().sub_(0.5)  # the parent's pages: shared memory
    return rank


def test_a_forked_ranks_edit_is_named_at_the_next_use():
    data = load_data("mnist-5k")
    data.train_normalized()
    assert launch(_edit_in_a_forked_rank, 2, start_method="fork") == [0, 1]
    with pytest.warns(CachedDataChanged, match=r"train_normalized\(\)"):
        again = load_data("mnist-5k")
    assert _as_stored(again)


def test_a_run_after_an_edit_trains_on_the_stored_data():
    """End to end: run_training after IMAGES.mul_(2) says so and trains as before the edit."""
    settings = dict(dataset="mnist-5k", max_steps=2, progress=False)
    before = run_training(**settings)
    load_data("mnist-5k").train_normalized().mul_(2)
    with pytest.warns(CachedDataChanged):
        after = run_training(**settings)
    assert after.final_params.tobytes() == before.final_params.tobytes()


# Issue 61, N2: the in-place ops that change a cached tensor's shape, strides, offset or storage, not its bytes.
# Each: (the edit, the name and the change the warning says).
METADATA_EDITS = {
    "transpose_": (lambda d: d.train_images.transpose_(1, 2),
                   r"\.train_images \(its strides went from \(784, 28, 1\) to \(784, 1, 28\)\)"),
    "resize_": (lambda d: d.train_labels.resize_(100),
                r"\.train_labels \(its shape went from \(4000,\) to \(100,\)\)"),
    "unsqueeze_": (lambda d: d.train_normalized().unsqueeze_(1),
                   r"\.train_normalized\(\) \(its shape went from \(4000, 28, 28\) to \(4000, 1, 28, 28\), its "
                   r"strides"),
    "as_strided_": (lambda d: d.test_images.as_strided_((500, 28, 28), (784, 28, 1), 784),
                    r"\.test_images \(its shape went from \(1000, 28, 28\) to \(500, 28, 28\), its storage offset "
                    r"went from 0 to 784\)"),
    "set_": (lambda d: d.test_labels.set_(d.test_labels.clone()), r"\.test_labels \(its storage was replaced\)"),
}


@pytest.fixture(scope="module")
def unedited_run():
    clear_cache()
    return run_training(dataset="mnist-5k", max_steps=2, progress=False)


@pytest.mark.slow  # a run each
@pytest.mark.parametrize("op", list(METADATA_EDITS))
def test_an_in_place_change_of_shape_or_storage_is_named_and_the_next_run_reloads(op, unedited_run):
    edit, said = METADATA_EDITS[op]
    edited = load_data("mnist-5k")
    edit(edited)
    with pytest.warns(CachedDataChanged, match=r"load_data\('mnist-5k'\)" + said):
        after = run_training(dataset="mnist-5k", max_steps=2, progress=False)
    assert after.final_params.tobytes() == unedited_run.final_params.tobytes()
    data = load_data("mnist-5k")
    assert data is not edited and data.train_labels.shape == (4000,) and data.test_images.shape == (1000, 28, 28)
