"""The data: what they are (catalog, standard library only), where they come from (sources), and how every rank
sees them (splits). `python -m ddp_helpers.data write-mnist ROOT` writes the offline digits where torchvision's
MNIST looks for them. Names are imported on first use, so `ddp_helpers.data.catalog` loads no torch."""
from __future__ import annotations

from ..common.lazy import lazy_exports

_EXPORTS = {
    "DATASETS": "catalog", "DEFAULT_DATA_ROOT": "catalog", "steps_per_epoch": "catalog",
    "DEBIAN_FASHION_DIR": "sources", "MNIST5K_ROOT": "mnist_files", "RAW_FILES": "sources",
    "check_data_root": "sources", "clear_cache": "sources", "load_data": "sources", "load_fashion_mnist": "sources",
    "load_mnist5k": "sources", "load_torchvision_mnist": "sources", "write_mnist": "mnist_files",
    "CachedDataChanged": "splits", "DataError": "splits", "DataSplits": "splits", "SeedListingDataset": "splits",
    "map_pages": "splits", "normalize": "splits", "shard_indices": "splits",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
