"""The lesson's figures, one module per subject (style.py: what they share).

The notebooks call them as `figures.draw_ring(...)` (`from ddp_helpers.lesson import figures`): each name is
imported from its module on first use, so a figure's module moves without a notebook changing.
"""
from __future__ import annotations

from ...common.lazy import lazy_exports

_EXPORTS = {
    "draw_ddp_backward": "backward",
    "draw_bucket_overlap": "buckets", "draw_compiled_overlap": "buckets", "draw_hook_overlap": "buckets",
    "plot_timeline": "buckets",
    "plot_buffer_sync": "buffers",
    "draw_resume": "checkpoints",
    "draw_collective": "collectives", "draw_ring": "collectives",
    "plot_shard_strip": "data_shards", "shard_owners": "data_shards",
    "draw_desync": "debugging", "draw_restarts": "debugging",
    "draw_holdings": "memory",
    "draw_rendezvous": "process_group",
    "plot_losses": "training", "plot_grad_norms": "training", "plot_fingerprints": "training",
    "plot_captured_grads": "training", "plot_gradient_pairs": "training", "plot_loss_curves": "training",
    "plot_loss_gaps": "training",
    "draw_join": "uneven_inputs", "plot_rank_steps": "uneven_inputs",
}
__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
