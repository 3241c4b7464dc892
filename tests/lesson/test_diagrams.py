"""The diagrams: each is a figure with alt text (in its PNG output's metadata and its text), drawn from the records
it is given, refusing records it can't draw; the rendezvous store records what init_process_group really does."""
from __future__ import annotations

import datetime
import time

import numpy as np
import pytest
import torch.distributed as dist
from matplotlib.collections import PolyCollection
from matplotlib.figure import Figure

from ddp_helpers import launch
from ddp_helpers.lesson.figures.buckets import draw_bucket_overlap, draw_compiled_overlap, draw_hook_overlap
from ddp_helpers.lesson.figures.checkpoints import draw_resume
from ddp_helpers.lesson.figures.collectives import draw_ring, ring_received
from ddp_helpers.lesson.figures.memory import draw_holdings
from ddp_helpers.lesson.figures.process_group import draw_rendezvous
from ddp_helpers.lesson.figures.style import Diagram
from ddp_helpers.lesson.figures.uneven_inputs import draw_join
from ddp_helpers.lesson.rendezvous import RecordingStore, address_owner


def _simulated_ring(w: int) -> list:
    """history[rank][step][chunk] of a textbook ring all-reduce, rank r starting with (c + 1) * 2**r in chunk c."""
    state = [[(c + 1) * 2.0 ** r for c in range(w)] for r in range(w)]
    history = [[list(s)] for s in state]
    for step in range(1, 2 * w - 1):
        sent = [list(s) for s in state]  # what every rank holds before the step
        for r in range(w):
            c = ring_received(step, r, w)
            left = sent[(r - 1) % w][c]
            state[r][c] = state[r][c] + left if step < w else left
        for r in range(w):
            history[r].append(list(state[r]))
    return history


def test_a_diagram_carries_its_alt_text_in_the_png_output_and_as_its_text():
    fig = Figure()
    fig.add_subplot().plot([0, 1])
    d = Diagram(fig, "  a line\n  going up ")
    png, meta = d._repr_png_()
    assert png.startswith(b"\x89PNG") and meta == {"alt": "a line going up"}
    assert repr(d) == "a line going up"
    assert b"Matplotlib" not in png  # no version inside: an unchanged figure stores the same bytes
    with pytest.raises(ValueError, match="alt text"):
        Diagram(fig, " ")


@pytest.mark.parametrize("w", [2, 3, 4])
def test_the_ring_diagram_reads_who_holds_which_sum(w):
    history = _simulated_ring(w)
    final = [(c + 1) * (2 ** w - 1) for c in range(w)]
    assert all(h[-1] == final for h in history)  # the simulation is a correct all-reduce
    d = draw_ring(history)
    assert isinstance(d.figure, Figure)
    for r in range(w):  # after reduce-scatter rank r holds chunk (r + 1) % w complete
        assert f"rank {r} holds the complete sum of chunk {(r + 1) % w}" in d.alt
    assert f"every rank holds [{', '.join(str(v) for v in final)}]" in d.alt


def test_the_ring_diagram_refuses_a_history_of_the_wrong_shape():
    with pytest.raises(ValueError, match="2W-1 steps"):
        draw_ring(np.zeros((4, 6, 4)))


def _bucket_case():
    param_bytes = [400, 40, 300, 30, 100, 10]  # model.parameters() order: weight, bias per layer
    buckets = [[5, 4, 3, 2], [1, 0]]  # last layer first
    return param_bytes, buckets


def test_bucket_overlap_says_how_many_buckets_and_what_overlap_saves():
    param_bytes, buckets = _bucket_case()
    d = draw_bucket_overlap(param_bytes, buckets, ["w0", "b0", "w1", "b1", "w2", "b2"])
    assert "2 buckets (the first holds b2, w2, b1, w1)" in d.alt
    saved = float(d.alt.split("sooner (")[1].split("%")[0])
    assert 0 < saved < 100
    one = draw_bucket_overlap(param_bytes, [[5, 4, 3, 2, 1, 0]])
    assert "(100% of the time" in one.alt  # one bucket: nothing overlaps


def test_hook_overlap_sends_each_gradient_alone_and_leaves_only_the_first_layers_transfer():
    param_bytes, _ = _bucket_case()
    d = draw_hook_overlap(param_bytes, ["w0", "b0", "w1", "b1", "w2", "b2"])
    assert "each of the 6 gradients has an all-reduce of its own" in d.alt and "bucket" not in d.alt
    per_gradient = float(d.alt.split("sooner (")[1].split("%")[0])
    two_buckets = float(draw_bucket_overlap(param_bytes, _bucket_case()[1]).alt.split("sooner (")[1].split("%")[0])
    # the same transfers, started earlier: never later than two buckets, and sooner than one all-reduce
    assert per_gradient <= two_buckets and per_gradient < 100


def test_bucket_overlap_refuses_buckets_that_miss_a_parameter():
    with pytest.raises(ValueError, match="every parameter index once"):
        draw_bucket_overlap([1, 2, 3], [[2, 1]])


def _lanes(ax) -> dict:
    """A panel's bars as drawn: lane name (its y tick) -> each bar's (start, end), in time order."""
    names = {round(y, 3): t.get_text() for y, t in zip(ax.get_yticks(), ax.get_yticklabels())}
    lanes: dict = {name: [] for name in names.values()}
    for bars in ax.collections:
        if isinstance(bars, PolyCollection):
            for path in bars.get_paths():
                xs, ys = path.vertices[:, 0], path.vertices[:, 1]
                lanes[names[round((ys.min() + ys.max()) / 2, 3)]].append((xs.min(), xs.max()))
    return {name: sorted(spans) for name, spans in lanes.items()}


def _compiled(pieces, buckets, comm_per_compute=0.5) -> tuple:
    d = draw_compiled_overlap({"split": (pieces, buckets), "one graph": ([sum(pieces)], buckets)}, comm_per_compute)
    split, one = (_lanes(ax) for ax in d.figure.axes)
    return d, split, one


@pytest.mark.parametrize("pieces, buckets", [([1, 1, 1, 1], [1, 1, 1, 1]), ([5, 1], [5, 1]), ([1, 2, 2, 1], [2, 2, 2])])
def test_compiled_overlap_draws_a_block_per_piece_and_an_all_reduce_per_bucket(pieces, buckets):
    _, split, one = _compiled(pieces, buckets)
    assert len(split["backward"]) == len(pieces) and len(one["backward"]) == 1
    assert len(split["all-reduces"]) == len(one["all-reduces"]) == len(buckets)
    # backward runs the pieces last first: the first block drawn is the last piece, as long as its layers
    assert split["backward"][0][1] - split["backward"][0][0] == pytest.approx(pieces[-1])


def test_compiled_overlap_starts_each_all_reduce_when_the_piece_holding_its_bucket_has_run():
    pieces, buckets = [1, 2, 2, 1], [2, 2, 2]  # layers 0 | 1-2 | 3-4 | 5 against buckets 0-1 | 2-3 | 4-5
    _, split, _ = _compiled(pieces, buckets, comm_per_compute=0.25)
    piece_ends = [end for _, end in split["backward"]]  # pieces 5, 3-4, 1-2, 0
    starts = [start for start, _ in split["all-reduces"]]  # buckets 4-5, 2-3, 0-1
    # bucket 4-5 needs layer 4, of piece 3-4; bucket 2-3 needs layer 2, of piece 1-2; bucket 0-1 the last piece
    assert starts == pytest.approx([piece_ends[1], piece_ends[2], piece_ends[3]])
    assert starts[0] < piece_ends[-1]  # overlaps the backward still running


def test_compiled_overlap_one_graph_starts_every_all_reduce_after_the_whole_backward():
    _, split, one = _compiled([1, 1, 1], [1, 1, 1], comm_per_compute=0.5)
    (bwd_start, bwd_end), = one["backward"]
    assert one["all-reduces"][0][0] == pytest.approx(bwd_end) and all(s >= bwd_end for s, _ in one["all-reduces"])
    # split: each all-reduce starts as its own piece's backward ends, all but the last before backward ends
    assert [s for s, _ in split["all-reduces"]] == pytest.approx([e for _, e in split["backward"]])
    assert one["all-reduces"][-1][1] > split["all-reduces"][-1][1]  # one graph: the step waits longer


def test_compiled_overlap_says_how_many_all_reduces_start_during_backward():
    d, _, _ = _compiled([1, 2, 2, 1], [2, 2, 2])
    assert "split: pieces of 1, 2, 2 and 1 layers, buckets of 2, 2 and 2; 2 of the 3 all-reduces start" in d.alt
    assert "one graph: pieces of 6 layers, buckets of 2, 2 and 2; 0 of the 3 all-reduces start" in d.alt
    labels = [t.get_text() for t in d.figure.axes[0].texts]
    assert {"5", "3-4", "1-2", "0", "4-5", "2-3", "0-1"} <= set(labels)  # each block names its layers


@pytest.mark.parametrize("pieces, buckets", [([5, 1], [5]), ([], []), ([2, 0], [1, 1])])
def test_compiled_overlap_refuses_pieces_and_buckets_of_other_layers(pieces, buckets):
    with pytest.raises(ValueError, match="the same total"):
        draw_compiled_overlap({"x": (pieces, buckets)})


def _join_logs():
    iteration = lambda i: [("all_reduce", i), ("all_reduce", i), ("bucket", i)]  # noqa: E731
    shadow = [("all_reduce", "after"), ("all_reduce", "after"), ("bucket", "after")]
    return ([x for i in (1, 2, 3) for x in iteration(i)] + shadow * 2 + [("all_reduce", "after")] * 2,
            [x for i in (1, 2, 3, 4, 5) for x in iteration(i)] + [("all_reduce", "after")] * 2)


def test_join_diagram_counts_each_ranks_shadows():
    d = draw_join(_join_logs())
    assert "rank 0 trains 3 iterations, then, joined, takes part in 2 gradient all-reduces with zeros and 6" in d.alt
    assert "rank 1 trains 5 iterations, then in 2 last one-number all-reduces" in d.alt
    assert "Each iteration makes 2 one-number all-reduces and 1 gradient all-reduce(s)" in d.alt
    with pytest.raises(ValueError, match="one non-empty log per rank"):
        draw_join([[], []])


def test_resume_diagram_names_the_checkpoint_it_resumed_from():
    d = draw_resume(40, [12, 24, 36], 64, 32, crashed_rank=1, final_equal=True)
    assert "stops when rank 1 fails at step 40" in d.alt and "checkpoint of step 36" in d.alt
    assert "redoing the 4 steps" in d.alt and "bitwise equal" in d.alt
    with pytest.raises(ValueError, match="no checkpoint at or before step 10"):
        draw_resume(10, [12, 24], 64, 32)


def test_holdings_diagram_adds_up_what_each_rank_holds():
    total = {"parameters": 4e6, "gradients": 4e6, "optimizer state": 8e6}
    d = draw_holdings({"DDP": [total, total], "FSDP2": [{k: v / 2 for k, v in total.items()}] * 2}, total)
    assert "one full copy of 16.00 MB" in d.alt and "FSDP2: rank 0 8.00 MB, rank 1 8.00 MB" in d.alt
    with pytest.raises(ValueError, match="total lacks"):
        draw_holdings({"DDP": [total]}, {"parameters": 1})


# ----------------------------------------------------------------------------------------- the rendezvous
def _join(rank, world_size, port, late, group_size, timeout_s):
    if rank == late:
        time.sleep(0.3)
    start = time.time()
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    connected = time.time()
    store = RecordingStore(client)
    try:
        dist.init_process_group("gloo", store=store, rank=rank, world_size=group_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        dist.destroy_process_group()
    except dist.DistStoreError:
        pass
    return {"start": start, "connected": connected, "returned": time.time(), "log": store.log}


@pytest.mark.slow
def test_the_recording_store_sees_each_rank_check_in_and_the_barrier():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ranks = launch(_join, world_size=3, args=(master.port, 2, 3, 30), init_group=False, threads_per_rank=1)
    for rank, rec in enumerate(ranks):
        sets = [address_owner(e["key"]) for e in rec["log"] if e["op"] == "set"]
        waited = {address_owner(e["key"]) for e in rec["log"] if e["op"] == "wait"}
        assert rank in sets and {0, 1, 2} <= waited, rec["log"]
        assert any("barrier" in e["key"] for e in rec["log"]), "no store-based barrier (TORCH_DIST_INIT_BARRIER)"
        assert not any(e["failed"] for e in rec["log"])
    late_set = next(e["end"] for e in ranks[2]["log"] if e["op"] == "set")
    assert all(r["returned"] >= late_set for r in ranks)  # nobody leaves before the late rank has checked in
    d = draw_rendezvous({"3 ranks": ranks}, late=2)
    assert "rank 2 was held back" in d.alt and "leave init_process_group together" in d.alt


@pytest.mark.slow
def test_the_recording_store_records_the_wait_that_times_out():
    master = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    # 5 s: long enough that under load the two ranks that exist still publish their addresses within it (with 1 s
    # CI's load once made rank 0's own address the wait that timed out); the missing rank 2's never comes.
    ranks = launch(_join, world_size=2, args=(master.port, None, 3, 5), init_group=False, threads_per_rank=1)
    for rec in ranks:
        failed = [e for e in rec["log"] if e["failed"]]
        assert [(address_owner(e["key"]), e["failed"]) for e in failed] == [(2, "DistStoreError")]
        assert failed[0]["end"] - failed[0]["start"] >= 4.9  # it waited for the timeout, 5 s
    d = draw_rendezvous({"2 of 3": ranks}, timeout_s=5)
    assert "address of rank 2, which never comes, until the 5 s timeout" in d.alt and "DistStoreError" in d.alt


def test_address_owner_reads_gloos_keys_only():
    assert address_owner("0//cpu//0/2") == 2 and address_owner("store_based_barrier_key:1") is None
