"""The data: where they come from (sources), and how every rank sees them (splits). `python -m ddp_helpers.data
write-mnist ROOT` writes the offline digits where torchvision's MNIST looks for them."""
from .sources import (DEBIAN_FASHION_DIR, DEFAULT_DATA_ROOT, MNIST5K_ROOT, RAW_FILES, check_data_root, clear_cache,
                      load_data, load_fashion_mnist, load_mnist5k, load_torchvision_mnist, write_mnist)
from .splits import DataError, DataSplits, SeedListingDataset, map_pages, normalize, shard_indices, steps_per_epoch

__all__ = ["DEBIAN_FASHION_DIR", "DEFAULT_DATA_ROOT", "MNIST5K_ROOT", "RAW_FILES", "DataError", "DataSplits",
           "SeedListingDataset", "check_data_root", "clear_cache", "load_data", "load_fashion_mnist", "load_mnist5k",
           "load_torchvision_mnist", "map_pages", "normalize", "shard_indices", "steps_per_epoch", "write_mnist"]
