"""plot_shard_strip: the image it draws maps every sample index to the rank that owns it, epoch by epoch;
plot_gradient_pairs: one point per gradient entry, rank 0 across and rank 1 up."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from ddp_helpers import shard_indices  # noqa: E402
from ddp_helpers.lesson.figures.data_shards import OWNED_BY_NONE, SHARED_BY_RANKS, plot_shard_strip, shard_owners  # noqa: E402


def _image(fig) -> np.ndarray:
    (ax,) = fig.axes
    (img,) = ax.images
    return np.asarray(img.get_array())


def test_each_cell_is_the_owning_rank_one_row_per_epoch():
    n, world_size = 40, 2
    epochs = {f"epoch {e}": [shard_indices(n, r, world_size, seed=3, epoch=e) for r in range(world_size)]
              for e in range(3)}
    img = _image(plot_shard_strip(epochs, n))
    assert img.shape == (3, n)
    for row, by_rank in enumerate(epochs.values()):
        for rank, idx in enumerate(by_rank):
            assert (img[row, idx.numpy()] == rank).all()
    assert not np.array_equal(img[0], img[1]), "set_epoch's reshuffle should change who owns what"


def test_padding_repeats_and_missing_indices_are_marked():
    # 10 samples on 3 ranks: DistributedSampler pads to 12 by repeating two indices on a second rank.
    by_rank = [shard_indices(10, r, 3, seed=0, epoch=0) for r in range(3)]
    owners = shard_owners(by_rank, 10)
    flat = np.concatenate([i.numpy() for i in by_rank])
    repeated = {i for i in flat if (flat == i).sum() > 1}
    assert set(np.flatnonzero(owners == SHARED_BY_RANKS)) == repeated and len(repeated) == 2
    assert shard_owners([[0, 1], [2]], 5).tolist() == [0, 0, 1, OWNED_BY_NONE, OWNED_BY_NONE]


def test_first_limits_the_columns_and_bad_indices_are_named():
    img = _image(plot_shard_strip({"e0": [[0, 2, 4], [1, 3, 5]]}, 6, first=4))
    assert img.tolist() == [[0, 1, 0, 1]]
    with pytest.raises(ValueError, match="outside 0..5"):
        plot_shard_strip({"e0": [[0, 6]]}, 6)


def test_fingerprint_plot_says_in_words_when_no_rank_ever_differs_and_draws_the_count_when_one_does(small_run):
    import copy

    from ddp_helpers.lesson.figures.training import plot_fingerprints

    agreeing = plot_fingerprints(small_run)
    bottom = agreeing.axes[1]
    assert not bottom.axison and not bottom.lines
    assert "every rank's fingerprint equals rank 0's" in bottom.texts[0].get_text()

    diverged = copy.deepcopy(small_run)
    diverged.ranks[1].param_fingerprint = list(diverged.ranks[1].param_fingerprint)
    diverged.ranks[1].param_fingerprint[2] = "0" * 16  # rank 1 differs after step 2
    (line,) = plot_fingerprints(diverged).axes[1].lines
    assert list(line.get_ydata()).count(1) == 1 and max(line.get_ydata()) == 1


def test_gradient_pairs_put_rank_0_across_and_rank_1_up_before_and_after_the_all_reduce():
    from ddp_helpers.lesson.figures.training import plot_gradient_pairs

    local = np.array([[1.0, 2.0, 3.0], [3.0, 0.0, 1.0]])
    synced = np.tile(local.mean(axis=0), (2, 1))
    before, after = plot_gradient_pairs(local, synced).axes
    (points,) = before.collections
    assert np.array_equal(points.get_offsets(), local.T)  # (rank 0's entry, rank 1's entry) per point
    (points,) = after.collections
    xy = np.asarray(points.get_offsets())
    assert np.array_equal(xy[:, 0], xy[:, 1])  # synchronized: every point on the diagonal


def _shown(fig, inline: bool):
    """What IPython's display sends for fig: (data, metadata); inline: with a Figure PNG printer registered, as
    matplotlib's inline backend registers one in a Jupyter kernel (it outranks a bundle's own PNG)."""
    from IPython.core.formatters import DisplayFormatter
    from matplotlib.figure import Figure

    formatter = DisplayFormatter()
    if inline:
        formatter.formatters["image/png"].for_type(Figure, lambda f: b"inline PNG")
    return formatter.format(fig)


def test_every_plot_says_what_it_shows_in_the_outputs_metadata_as_a_diagram_does(small_run):
    """Issue 62: 20 of the site's figures had their file path as alt text. A plot function's figure now carries
    alt text (in the output's metadata, which the site puts on the <img>, and as its text/plain) that names the
    chart and its series and states what the data show, checked against the data."""
    from ddp_helpers.lesson.figures.buffers import plot_buffer_sync
    from ddp_helpers.lesson.figures.training import (plot_fingerprints, plot_grad_norms, plot_gradient_pairs,
                                                     plot_loss_curves, plot_loss_gaps, plot_losses)
    from ddp_helpers.lesson.figures.uneven_inputs import plot_rank_steps

    local = np.array([[1.0, 2.0, 3.0], [3.0, 0.0, 1.0]])
    same = {"at_entry": np.zeros((3, 1)), "after_step": np.ones((3, 1))}
    figures = {
        "losses": (plot_losses(small_run), ["Line chart", "cross-entropy loss", "ranks 0 and 1"]),
        "norms": (plot_grad_norms(small_run), ["synchronized norms are equal on every rank at every step"]),
        "fingerprints": (plot_fingerprints(small_run), ["Every cell is green"]),
        "pairs": (plot_gradient_pairs(local, np.tile(local.mean(axis=0), (2, 1))),
                  ["Left, the local gradients before the all-reduce: points off the diagonal",
                   "after the all-reduce: every point on the diagonal"]),
        "strip": (plot_shard_strip({"e0": [[0, 2, 4], [1, 3, 5]]}, 6), ["rank 0 reads 3 and rank 1 reads 3"]),
        "curves": (plot_loss_curves({"W=1": {"loss": [3.0, 2.0], "global_batch": 64}}, title="Batch"),
                   ["Batch.", "W=1 (global batch 64, 2 steps)"]),
        "gaps": (plot_loss_gaps({"fp32": [3.0, 2.0], "bf16": [3.0, 2.1]}, "fp32"), ["bf16", "fp32 loss dashed"]),
        "buffers": (plot_buffer_sync({"sync on": [same, same]}), ["sync on: every rank's forward receives the same"]),
        "steps": (plot_rank_steps({"Join": [["trained"] * 3, ["trained", "trained", "shadowed"]]}),
                  ["rank 0: trains on its own batch (3)", "rank 1: trains on its own batch (2) and joined (1)"]),
    }
    for name, (fig, phrases) in figures.items():
        assert all(p in fig.alt for p in phrases), f"{name}: {fig.alt}"
        assert fig.axes, "still a matplotlib Figure"
        for inline in (False, True):
            data, metadata = _shown(fig, inline)
            assert metadata["image/png"]["alt"] == fig.alt and data["text/plain"] == fig.alt, (name, inline)
            assert data["image/png"] == b"inline PNG" if inline else data["image/png"].startswith(b"\x89PNG")
