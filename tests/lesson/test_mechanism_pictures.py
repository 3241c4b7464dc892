"""The pictures of the mechanism (issue 50): all_reduce and broadcast from real ranks' tensors, the ring's steps
from a hand-written ring on real ranks (its arrows never cross), and DDP's backward in order."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.distributed as dist
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.patches import FancyArrowPatch, Rectangle
from matplotlib.path import Path
from matplotlib.text import Text

from ddp_helpers import launch
from ddp_helpers.lesson.comms import ring_all_reduce, ring_bytes_per_rank
from ddp_helpers.lesson.figures.backward import ddp_backward_events, draw_ddp_backward
from ddp_helpers.lesson.figures.buckets import draw_hook_overlap
from ddp_helpers.lesson.figures.collectives import draw_collective, draw_ring, ring_arrow_ends, ring_received


def _texts(diagram) -> list:
    return [t.get_text() for t in diagram.figure.findobj(Text)]


def _collectives(rank, world_size):
    t = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
    before = t.tolist()
    dist.all_reduce(t)
    w = torch.tensor([42.0 + rank])
    b_before = w.tolist()
    dist.broadcast(w, src=1)
    return before, t.tolist(), b_before, w.tolist()


def _ring(rank, world_size):
    t = torch.tensor([(c + 1) * 2.0 ** rank for c in range(world_size)])
    expected = t.clone()
    dist.all_reduce(expected)
    out = ring_all_reduce(t)
    return out, torch.equal(t, expected)


def test_collective_pictures_print_the_real_ranks_values_before_and_after():
    runs = launch(_collectives, world_size=4, threads_per_rank=1)
    d = draw_collective("all_reduce", [r[0] for r in runs], [r[1] for r in runs])
    texts = _texts(d)
    for r in range(4):  # every rank's values, before, and the sum on every rank after
        assert f"rank {r}" in texts and str(r + 1) in texts and str(10 * (r + 1)) in texts
    assert texts.count("10") >= 1 + 4 and texts.count("100") == 4
    assert "every rank holds [10, 100]" in d.alt
    # no server: the sum is a result drawn without a node, and the picture says it is the logical view
    assert "+" not in texts and "logical view" in d.alt and "ring" in d.alt
    assert "logical view" in d.figure.axes[0].get_title() and "ring" in d.figure.axes[0].get_title()
    assert not [t for t in d.figure.findobj(Text) if t.get_bbox_patch() is not None]
    b = draw_collective("broadcast", [r[2] for r in runs], [r[3] for r in runs], src=1)
    assert _texts(b).count("43") == 1 + 4 and "rank 1's tensor goes to every rank" in b.alt


def test_collective_picture_refuses_what_it_cant_draw():
    with pytest.raises(ValueError, match="op must be"):
        draw_collective("gather", [[1], [2]], [[1], [2]])
    with pytest.raises(ValueError, match="equal-length"):
        draw_collective("all_reduce", [[1], [2]], [[3]])
    with pytest.raises(ValueError, match="src=5"):
        draw_collective("broadcast", [[1], [2]], [[1], [1]], src=5)


@pytest.mark.parametrize("w", [2, 4])
def test_the_hand_ring_equals_all_reduce_and_sends_2_w_minus_1_over_w_of_the_bytes(w):
    runs = launch(_ring, world_size=w, threads_per_rank=1)
    assert all(equal for _, equal in runs)
    for out, _ in runs:
        assert len(out["steps"]) == 2 * w - 1
        assert out["sent_bytes"] == ring_bytes_per_rank(w * 4, w)  # w float32 entries
    d = draw_ring([out["steps"] for out, _ in runs])
    assert f"{w - 1} reduce-scatter steps and {w - 1} all-gather steps" in d.alt


def _cross(p1, p2, q1, q2) -> bool:
    d = lambda a, b, c: (b[0] - a[0]) * (c[1] - a[1]) - (b[1] - a[1]) * (c[0] - a[0])  # noqa: E731
    return d(p1, p2, q1) * d(p1, p2, q2) < 0 and d(q1, q2, p1) * d(q1, q2, p2) < 0


@pytest.mark.parametrize("w", [2, 3, 4])
def test_no_two_ring_arrows_cross(w):
    arrows = [ring_arrow_ends(w, r, ring_received(s, r, w), 2 * w - 2 - s)
              for s in range(1, 2 * w - 1) for r in range(w)]
    assert not [pair for pair in itertools.combinations(arrows, 2) if _cross(*pair[0], *pair[1])]


def test_ddp_backward_launches_buckets_in_order_and_waits_in_the_callback():
    names = [f"p{i}" for i in range(6)]
    buckets = [[5, 4], [3, 2, 1], [0]]
    events = ddp_backward_events(names, buckets)
    texts = [t for _, _, t in events]
    launches = [t for t in texts if "all_reduce (async)" in t]
    assert launches == [f"bucket {i} full: all_reduce (async)" for i in range(3)]
    grads = [t.split(" ->")[0] for t in texts if t.startswith("grad of")]
    assert grads == [f"grad of p{i}" for i in reversed(range(6))]  # last layer first
    order = ["queue_callback(finalize_backward)", "runs the queued callback", "finalize_backward, bucket by",
             "bucket 2: wait() blocks", "bucket 2: all-reduce done", "bucket 2: its means are\ncopied into p.grad",
             "backward() returns", "optimizer.step()"]
    where = [next(i for i, t in enumerate(texts) if o in t) for o in order]
    assert where == sorted(where) and where[0] > texts.index(launches[-1])
    d = draw_ddp_backward(names, buckets)
    assert "3 buckets" in d.alt and "schematic" in d.alt
    with pytest.raises(ValueError, match="every parameter index once"):
        ddp_backward_events(names, [[5, 4]])


def _rows(events) -> dict:
    """Each event's text -> its index (time runs down the diagram)."""
    return {t: i for i, (_, _, t) in enumerate(events)}


@pytest.mark.parametrize("buckets", [[[11, 10, 9, 8, 7, 6], [5, 4, 3, 2], [1, 0]],  # notebook 0's real run
                                     [[5, 4], [3, 2, 1], [0]], [[1, 0]]])
def test_ddp_backward_is_in_time_order_each_copy_after_its_all_reduce_is_done(buckets):
    n = len([p for b in buckets for p in b])
    events = ddp_backward_events([f"p{i}" for i in range(n)], buckets)
    texts = [t for _, _, t in events]
    at = _rows(events)
    for k in range(len(buckets)):  # launched, then done (gloo -> Reducer), then copied into p.grad
        done = at[f"bucket {k}: all-reduce done"]
        assert events[done][:2] == (3, 2)
        assert at[f"bucket {k} full: all_reduce (async)"] < done
        last = k == len(buckets) - 1  # the early buckets' copies share one note, the last its own
        copy = next(i for i, t in enumerate(texts) if "copied into p.grad" in t and
                    (t.startswith(f"bucket {k}:") if last else "finalize_backward" in t))
        assert done < copy < at["backward() returns"]


def test_ddp_backward_shows_a_bucket_all_reducing_while_autograd_still_computes():
    names = [f"p{i}" for i in range(12)]
    events = ddp_backward_events(names, [[11, 10, 9, 8, 7, 6], [5, 4, 3, 2], [1, 0]])
    at = _rows(events)
    grads = [i for i, (_, _, t) in enumerate(events) if t.startswith("grad of")]
    # bucket 0 is launched and done between two gradients: its all-reduce ran while backward computed
    assert grads[0] < at["bucket 0 full: all_reduce (async)"] < at["bucket 0: all-reduce done"] < grads[-1]
    assert any(at["bucket 0 full: all_reduce (async)"] < g < at["bucket 0: all-reduce done"] for g in grads)
    # drawn: a bar in gloo's lane from each launch to its end, beside the gradient arrows of those rows
    fig = draw_ddp_backward(names, [[11, 10, 9, 8, 7, 6], [5, 4, 3, 2], [1, 0]]).figure
    bars = {r.get_label(): r for r in fig.axes[0].patches
            if isinstance(r, Rectangle) and r.get_label().endswith("all-reducing")}
    assert sorted(bars) == [f"bucket {k} all-reducing" for k in range(3)]
    bar = bars["bucket 0 all-reducing"]
    assert bar.get_x() > 3 and bar.get_height() > 1  # in gloo's lane (x = 3), over more than one row
    grad_rows = [t.get_position()[1] for t in fig.axes[0].texts if t.get_text().startswith("grad of p5")]
    assert grad_rows and bar.get_y() < grad_rows[0] < bar.get_y() + bar.get_height()


def test_a_bucket_waits_for_the_one_before_it_even_when_it_is_full_first():
    # bucket 1 (parameter 5) fills first, but is launched only after bucket 0
    texts = [t for _, _, t in ddp_backward_events(["a", "b", "c", "d", "e", "f"], [[4, 3], [5], [2, 1, 0]])]
    assert texts.index("bucket 0 full: all_reduce (async)") < texts.index("bucket 1 full: all_reduce (async)")


def test_hook_overlap_labels_every_layer_and_its_top_bar():
    sizes = [200704, 256, 65536, 1024, 262144, 1024, 262144, 1024, 262144, 1024, 10240, 40]
    names = [f"layer {i // 2 + 1}" for i in range(12)]
    texts = _texts(draw_hook_overlap(sizes, names))
    for layer in range(1, 7):  # on both backward bars and on the row of per-gradient all-reduces
        assert sum(f"layer {layer}" in t.split(", ") for t in texts) >= 3
    assert "all 12 gradients" in texts and "0" not in texts


def test_hook_overlap_names_the_layer_of_every_sliver_under_its_label():
    """The sliver sent right after layer 6's gradients is layer 5's bias: the label it sits under names it."""
    sizes = [200704, 256, 65536, 1024, 262144, 1024, 262144, 1024, 262144, 1024, 10240, 40]
    names = [f"layer {i // 2 + 1}" for i in range(12)]
    fig = draw_hook_overlap(sizes, names).figure
    total = sum(sizes)
    bias5_ready = (sizes[11] + sizes[10] + sizes[9]) / total  # backward: layer 6's bias and weight, then 5's bias
    below = [a for a in fig.axes[0].texts if hasattr(a, "xy") and a.xy[1] < 0.3]  # the all-reduces row's leaders
    nearest = min(below, key=lambda a: abs(a.xy[0] - bias5_ready))
    assert abs(nearest.xy[0] - bias5_ready) < 0.07
    assert "layer 5" in nearest.get_text().split(", ") and "layer 6" in nearest.get_text().split(", ")


@pytest.mark.parametrize("w", [2, 3, 4])
def test_the_ring_labels_of_the_wrapping_arrow_touch_no_arrow_and_no_box(w):
    history = np.arange(w * (2 * w - 1) * w, dtype=float).reshape(w, 2 * w - 1, w)  # only the layout counts
    fig = draw_ring(history).figure
    FigureCanvasAgg(fig).draw()
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    labels = [t for t in ax.texts if t.get_text().startswith(("from rank", "to rank"))]
    assert len(labels) == 2 * (w - 1) * 2  # a "from" and a "to" for each of the 2(W-1) wraps
    for label in labels:
        box = label.get_window_extent(renderer).padded(-0.5)
        for patch in ax.patches:
            if isinstance(patch, FancyArrowPatch):
                path = patch.get_transform().transform_path(patch.get_path())  # on the canvas
                for line in path.to_polygons(closed_only=False):  # the shaft and the head, without a CLOSEPOLY
                    assert not Path(line).intersects_bbox(box, filled=False), label.get_text()
            elif isinstance(patch, Rectangle):
                assert not patch.get_window_extent(renderer).overlaps(box), label.get_text()


def test_per_gradient_sends_take_one_colour_per_layer_never_the_top_rows():
    from ddp_helpers.lesson.figures.buckets import SEND_COLORS, _layer_colors

    names = [f"layer {i // 2 + 1}" for i in range(12)]
    sends = [[p] for p in reversed(range(12))]  # as draw_hook_overlap sends them: last gradient first
    colors = _layer_colors(sends, names)
    by_layer = {}
    for (p,), color in zip(sends, colors):
        by_layer.setdefault(names[p], set()).add(color)
    assert all(len(c) == 1 for c in by_layer.values())  # a layer's weight and bias share a colour
    assert len({c.pop() for c in by_layer.values()}) == 6 and SEND_COLORS[0] not in colors
