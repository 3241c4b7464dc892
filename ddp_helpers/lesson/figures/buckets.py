"""Gradients synchronized during backward: which parameters' all-reduces overlap the rest of
backward, per gradient or per bucket (notebooks 0, 3b and 7) or per compiled graph piece (notebook 11), and
each rank's bucket timeline.

Built without pyplot, so a notebook shows each figure once (as the cell's value).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Sequence

from matplotlib.figure import Figure
from matplotlib.legend_handler import HandlerTuple
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from .labels import label_spans, merge_spans
from .style import BUCKET_COLORS, DPI, Diagram, Plot, listed


SEND_COLORS = tuple(c for c in BUCKET_COLORS if c != "#7f7f7f")  # grey is backward's colour in these diagrams


def _bucket_rows(ax: Any, y: float, buckets: Sequence[Sequence[int]], ready: Sequence[float],
                 param_bytes: Sequence[int], rate: float, names: Optional[Sequence[str]] = None,
                 colors: Optional[Sequence[str]] = None, labels: Optional[Sequence[str]] = None) -> list:
    """Draw the all-reduces of buckets (one lane, one after the other) from their ready times; each one's
    (start, end).
    A single bucket is the one all-reduce of everything: it is labelled so, not numbered; with names (one
    gradient per bucket) every send is labelled with its layer, slivers below the bar. colors: each bucket's
    (default: one per bucket, in turn); labels: each bucket's text (default: its number)."""
    free, spans, sends = 0.0, [], []
    for i, (b, t) in enumerate(zip(buckets, ready)):
        start = max(t, free)  # one communication channel: a bucket waits for the one before it
        length = sum(param_bytes[p] for p in b) * rate
        color = colors[i] if colors is not None else SEND_COLORS[i % len(SEND_COLORS)]
        ax.broken_barh([(start, length)], (y - 0.3, 0.6), color=color)
        label = labels[i] if labels is not None else f"all {len(b)} gradients" if len(buckets) == 1 else f"{i}"
        if names is not None and len(buckets) > 1:
            spans.append((names[b[0]], start, start + length))
        elif length > 0.025:  # a number on a sliver would run into its neighbours'
            ax.text(start + length / 2, y, label, ha="center", va="center", fontsize=8, color="white")
        free = start + length
        sends.append((start, free))
    if spans:
        label_spans(ax, y, merge_spans(spans), below=True)
    return sends


def _name_spans(ax: Any, y: float, names: Sequence[str], sizes: Sequence[float]) -> None:
    """Label every layer on backward's bar (which computes the gradients last parameter first)."""
    items, x = [], 0.0
    for p in reversed(range(len(names))):
        items.append((names[p], x, x + sizes[p]))
        x += sizes[p]
    label_spans(ax, y, merge_spans(items))


def draw_hook_overlap(param_bytes: Sequence[int], names: Optional[Sequence[str]] = None,
                      comm_per_compute: float = 1.0) -> Diagram:
    """Schematic: one all-reduce after backward (notebook 3b's step 1) against one per gradient, each started as
    soon as backward has produced it (step 2)."""
    per_gradient = [[p] for p in reversed(range(len(param_bytes)))]
    return draw_bucket_overlap(param_bytes, per_gradient, names, comm_per_compute, per_gradient=True)


def draw_bucket_overlap(param_bytes: Sequence[int], buckets: Sequence[Sequence[int]],
                        names: Optional[Sequence[str]] = None, comm_per_compute: float = 1.0,
                        per_gradient: bool = False) -> Diagram:
    """Schematic: the same backward with one all-reduce after it, and with buckets sent as they fill
    (per_gradient: each bucket is one gradient, drawn and described as such: draw_hook_overlap).

    param_bytes: each parameter's gradient bytes, in model.parameters() order; buckets: the parameter indices of
    each bucket, in the order they are sent (DDP's: last layer first). Backward produces the gradients in
    reverse order, each taking time in proportion to its bytes; an all-reduce takes comm_per_compute times as
    long per byte. Not measured: notebook 7 measures the real timeline.
    """
    order = [p for b in buckets for p in b]
    if sorted(order) != list(range(len(param_bytes))):
        raise ValueError("draw_bucket_overlap: the buckets must hold every parameter index once "
                         f"(0 .. {len(param_bytes) - 1}); got {list(buckets)}")
    total = float(sum(param_bytes))
    sizes = [b / total for b in param_bytes]
    done, t = {}, 0.0
    for p in reversed(range(len(param_bytes))):  # backward: the last parameter's gradient first
        t += sizes[p]
        done[p] = t
    fig = Figure(figsize=(8, 3.2), layout="constrained", dpi=DPI)
    ax = fig.add_subplot()
    layer_colors = _layer_colors(buckets, names) if per_gradient else None
    _overlap_axes(fig, ax, len(buckets), comm_per_compute, layer_colors)  # first: labels are placed in its layout
    sends = {}
    for row, (label, groups) in enumerate((("one all-reduce after backward", [order]), ("buckets", buckets))):
        y_bwd, y_comm = 3.2 - 2.2 * row, 2.5 - 2.2 * row
        start = 0.0
        for p in reversed(range(len(param_bytes))):
            ax.broken_barh([(start, sizes[p])], (y_bwd - 0.3, 0.6), facecolor="#7f7f7f", edgecolor="white")
            start += sizes[p]
        if names is not None:
            _name_spans(ax, y_bwd, names, sizes)
        ready = [max(done[p] for p in b) for b in groups]
        sends[label] = _bucket_rows(ax, y_comm, groups, ready, sizes, comm_per_compute,
                                    names if per_gradient else None, layer_colors if row == 1 else None)
        end = sends[label][-1][1]
        ax.axvline(end, ymin=(y_comm - 0.5 + 0.6) / 4.6, ymax=(y_bwd + 0.5 + 0.6) / 4.6, color="black",
                   ls="--", lw=0.8)
        ax.text(end, y_bwd + 0.4, " step can go on", fontsize=7, va="bottom")
    first = [names[p] for p in buckets[0]] if names is not None else None
    share = sends["buckets"][-1][1] / sends["one all-reduce after backward"][-1][1]
    alt = _overlap_alt(len(param_bytes), sends["buckets"], first, share, per_gradient)
    return Diagram(fig, alt)


def _overlap_axes(fig: Figure, ax: Any, n_sends: int, comm_per_compute: float,
                  layer_colors: Optional[Sequence[str]]) -> None:
    """draw_bucket_overlap's axes, title and legend; the time axis fixed, from 0 to past the longest row's end.
    layer_colors: the per-gradient sends' colours (None: buckets)."""
    per_gradient = layer_colors is not None
    ax.set_yticks([3.2, 2.5, 1.0, 0.3], ["backward", "all-reduce", "backward", "all-reduces"], fontsize=8)
    ax.set_ylim(-0.9 if per_gradient else -0.6, 4.4)
    # backward takes 1 (the bytes, normalized), the one all-reduce after it comm_per_compute; room for a label
    ax.set_xlim(-0.03, (1 + comm_per_compute) * 1.17)
    ax.set_xlabel("time (schematic: in proportion to the bytes of each gradient)", fontsize=8)
    ax.set_xticks([])
    bottom = (f"{n_sends} all-reduces, one per gradient, each sent as soon as it is ready" if per_gradient
              else f"{n_sends} buckets, each sent when full, after the one before it")
    ax.set_title(f"top: one all-reduce after backward; bottom: {bottom}", fontsize=9)
    _overlap_legend(fig, per_gradient, layer_colors)


def _layer_colors(groups: Sequence[Sequence[int]], names: Optional[Sequence[str]]) -> list:
    """One colour per layer for per-gradient sends (a layer's weight and bias share it), never the first colour,
    which is the top row's one all-reduce; without names, one per send, in turn."""
    keys = [names[g[0]] if names is not None else i for i, g in enumerate(groups)]
    order = list(dict.fromkeys(keys))
    palette = SEND_COLORS[1:]
    return [palette[order.index(k) % len(palette)] for k in keys]


def _overlap_legend(fig: Figure, per_gradient: bool, send_colors: Optional[Sequence[str]]) -> None:
    """The legend under draw_bucket_overlap: backward's grey, and what the coloured bars are."""
    handles: list = [Patch(color="#7f7f7f")]
    labels = ["backward computes one parameter's gradient (last layer first)"]
    if per_gradient and send_colors:
        handles += [Patch(color=SEND_COLORS[0]), tuple(Patch(color=c) for c in dict.fromkeys(send_colors))]
        labels += ["top: one all-reduce of all the gradients",
                   "bottom: one gradient's all-reduce (colour and label: its layer)"]
    else:
        handles.append(Patch(color=BUCKET_COLORS[0]))
        labels.append("a bucket's all-reduce (number: the bucket)")
    fig.legend(handles, labels, loc="outside lower center", ncols=2, fontsize=7, frameon=False,
               handler_map={tuple: HandlerTuple(ndivide=None, pad=0)})


def _overlap_alt(n_params: int, sends: Sequence[tuple], first: Optional[Sequence[str]], share: float,
                 per_gradient: bool) -> str:
    """draw_bucket_overlap's alt text: what the two rows show, and the bottom row's time as a share of the top's.
    sends: each bottom-row all-reduce's (start, end); backward ends at 1."""
    n_sends = len(sends)
    if per_gradient:
        bottom = (f"Bottom: each of the {n_sends} gradients has an all-reduce of its own, started as soon as backward "
                  "has produced it, while backward computes the earlier layers, so when backward ends only the "
                  "transfers still queued are left, and the step can ")
    else:
        early = sum(start < 1 - 1e-9 for start, _ in sends)
        during = ("none starts before backward ends" if early == 0 else
                  f"{early} of them {'starts' if early == 1 else 'start'} while backward still computes the "
                  f"earlier layers, the other {n_sends - early} after backward has ended")
        bottom = (f"Bottom: the gradients go into {n_sends} buckets"
                  + (f" (the first holds {', '.join(first)})" if first else "")
                  + "; a bucket's all-reduce starts once its last gradient is ready and the all-reduce of the "
                  f"bucket before it has finished (one link, one bucket at a time): {during}. The step can ")
    return (f"Schematic of one backward pass, twice. Top: backward computes all {n_params} gradients, last layer "
            "first, and only then one all-reduce sends them all, so the whole transfer adds to the step. " + bottom
            + f"go on sooner ({share:.0%} of the time of the top row in this schematic).")


def _layer_text(start: int, size: int) -> str:
    """Layers start .. start + size - 1, in forward order: '5' or '3-4'."""
    return f"{start}" if size == 1 else f"{start}-{start + size - 1}"


def compiled_backward(pieces: Sequence[int], buckets: Sequence[int]) -> tuple:
    """((start, end) of each graph piece's backward, last piece first; when each bucket is ready, in send order).

    pieces, buckets: the layers of each graph piece and of each DDP bucket, in forward order; one time unit a layer.
    """
    # A compiled piece is one autograd node: its gradients are ready only once its whole backward has run, so a
    # bucket is ready when the piece holding its first layer (the last one backward reaches) has run.
    pieces, buckets = list(pieces), list(buckets)
    if not pieces or min(pieces + buckets) <= 0 or sum(pieces) != sum(buckets):
        raise ValueError("compiled_backward: pieces and buckets must each split the same layers into groups of at "
                         f"least one layer (the same total), in forward order; got pieces {pieces}, buckets {buckets}")
    total = sum(pieces)
    starts = [sum(pieces[:i]) for i in range(len(pieces))]
    runs = [(total - s - n, total - s) for s, n in zip(starts, pieces)][::-1]  # the last piece runs first
    piece_end = {layer: total - s for s, n in zip(starts, pieces) for layer in range(s, s + n)}
    ready = [piece_end[sum(buckets[:j])] for j in range(len(buckets))][::-1]
    return runs, ready


def draw_compiled_overlap(settings: Dict[str, tuple], comm_per_compute: float = 1.0) -> Diagram:
    """Schematic per setting: a compiled DDP model's backward piece by piece, each bucket's all-reduce once ready.

    settings: title -> (layers per graph piece, layers per DDP bucket), in forward order, as notebook 11 records them
    (one piece: `optimize_ddp=False`'s one graph); an all-reduce takes comm_per_compute times a layer's backward.
    """
    if not settings:
        raise ValueError("draw_compiled_overlap: give at least one setting, {title: (pieces, buckets)}")
    drawn = {title: compiled_backward(pieces, buckets) for title, (pieces, buckets) in settings.items()}
    fig = Figure(figsize=(8, 0.9 + 1.15 * len(settings)), layout="constrained", dpi=DPI)
    axes = fig.subplots(len(settings), 1, squeeze=False, sharex=True)[:, 0]
    total = max(sum(pieces) for pieces, _ in settings.values())
    sends = {}
    for ax, (title, (pieces, buckets)) in zip(axes, settings.items()):
        runs, ready = drawn[title]
        sends[title] = _compiled_panel(ax, title, list(pieces), list(buckets), runs, ready, comm_per_compute)
    axes[-1].set_xlim(-0.02 * total, (1 + comm_per_compute) * total * 1.2)  # room for "step can go on"
    axes[-1].set_xlabel("time (schematic, not measured: a piece's backward in proportion to its layers, an "
                        "all-reduce to its bucket's)", fontsize=8)
    fig.legend([Patch(color="#7f7f7f"), Patch(color=SEND_COLORS[0])],
               ["a graph piece's backward (its Linear layers, numbered in forward order)",
                "a DDP bucket's all-reduce (its layers), started once every piece holding one of them has run"],
               loc="outside lower center", ncols=1, fontsize=7, frameon=False)
    return Diagram(fig, _compiled_alt(settings, drawn, sends))


def _compiled_panel(ax: Any, title: str, pieces: list, buckets: list, runs: list, ready: list,
                    comm_per_compute: float) -> list:
    """One setting's lanes: the pieces' backward (y=1) and the buckets' all-reduces (y=0); the sends' (start, end)."""
    starts = [sum(pieces[:i]) for i in range(len(pieces))][::-1]  # backward order, as runs
    for (a, b), first in zip(runs, starts):
        ax.broken_barh([(a, b - a)], (0.7, 0.6), facecolor="#7f7f7f", edgecolor="white")
        ax.text((a + b) / 2, 1.0, _layer_text(first, b - a), ha="center", va="center", fontsize=8, color="white")
    order = list(range(len(buckets)))[::-1]  # DDP sends the last layers' bucket first
    labels = [_layer_text(sum(buckets[:j]), buckets[j]) for j in order]
    sends = _bucket_rows(ax, 0.0, [[i] for i in range(len(order))], ready, [buckets[j] for j in order],
                         comm_per_compute, labels=labels)
    end = sends[-1][1]
    ax.plot([end, end], [-0.4, 1.4], color="black", ls="--", lw=0.8)
    ax.text(end, 1.35, " step can go on", fontsize=7, va="top")
    ax.set_yticks([1.0, 0.0], ["backward", "all-reduces"], fontsize=8)
    ax.set_ylim(-0.5, 1.5)
    ax.set_xticks([])
    ax.set_title(title, fontsize=9, loc="left")
    return sends


def _compiled_alt(settings: Dict[str, tuple], drawn: Dict[str, tuple], sends: Dict[str, list]) -> str:
    """draw_compiled_overlap's alt text: per setting, its pieces, its buckets and how many all-reduces overlap."""
    parts = []
    for title, (pieces, buckets) in settings.items():
        runs, _ = drawn[title]
        bwd_end = runs[-1][1]
        early = sum(start < bwd_end for start, _ in sends[title])
        parts.append(f"{' '.join(title.split())}: pieces of {listed([str(n) for n in pieces])} layers, buckets of "
                     f"{listed([str(n) for n in buckets])}; {early} of the {len(buckets)} all-reduces start before "
                     "backward ends")
    return ("Schematic, not measured: for each setting a lane of backward, the compiled graph pieces' backward run "
            "last piece first, and a lane of DDP's bucket all-reduces, one at a time, each starting once the piece "
            "that holds its gradients has run, so with one graph every all-reduce waits for the whole backward. "
            + "; ".join(parts) + ".")


# Where a rank's backward() returned: black, one line style per rank, so no rank line takes a bucket's colour.
RANK_LINES = ("-", "--", "-.", ":")


def _check_marks(record: dict, names: Sequence[str]) -> None:
    missing = [n for n in names if n not in record.get("marks", {})]
    if missing:
        raise ValueError(f"plot_timeline: a record has no {missing} mark(s); set them in the training loop with "
                         "Timeline.mark(...) before returning Timeline.records()")


def _timeline_legend(fig: Figure) -> None:
    """What each bar and line of plot_timeline stands for, below the panels."""
    handles = [Patch(color="#d9d9d9", label="forward"),
               Patch(color="#7f7f7f", label="backward, computing gradients"),
               Patch(facecolor="white", edgecolor="#7f7f7f", hatch="///",
                     label="backward, waiting for the last all-reduces"),
               Patch(color=BUCKET_COLORS[0],
                     label="a bucket (its number): handed to the hook -> its future's callback ran"),
               Line2D([], [], color="black", lw=1.2, ls=RANK_LINES[0], label="rank 0's backward() returned"),
               Line2D([], [], color="black", lw=1.2, ls=RANK_LINES[1], label="rank 1's backward() returned")]
    fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=7, frameon=False)


def plot_timeline(panels: Dict[str, Sequence[dict]], unit_ms: bool = True) -> Plot:
    """One Gantt chart per panel (title -> one Timeline record per rank): compute above, one lane per bucket below.

    For each rank: forward (light grey), backward up to the last bucket's hand-over, i.e. computing gradients
    (dark grey), then backward waiting for the last all-reduces (hatched); below, one bar per bucket from the
    moment DDP handed it to the hook to the moment the callback chained to its future ran (bucket index left
    of the bar); a black line over the rank's own rows, one style per rank, where its backward() returned. The
    panels share one time axis, so bars of the same length take the same time in every panel; a legend below
    says what each mark stands for.
    """
    if not panels:
        raise ValueError("plot_timeline needs at least one panel: {title: [record of rank 0, record of rank 1, ...]}")
    scale = 1e3 if unit_ms else 1.0
    if any(not recs for recs in panels.values()):
        raise ValueError("plot_timeline: every panel needs one record per rank, got an empty list")
    # Each rank: a compute row, one lane per bucket, a gap; each panel as tall as its lanes need.
    heights = [len(recs) * (1.4 + 0.45 * max(len(r["buckets"]) for r in recs)) for recs in panels.values()]
    fig = Plot(figsize=(7.5, 1.5 + 0.32 * sum(heights) + 0.5 * len(panels)), layout="constrained", dpi=DPI)
    axes = fig.subplots(len(panels), 1, squeeze=False, sharex=True, gridspec_kw={"height_ratios": heights})[:, 0]
    for ax, (title, records) in zip(axes, panels.items()):
        rank_h = 1.4 + 0.45 * max(len(r["buckets"]) for r in records)
        ticks = []
        for rank, rec in enumerate(records):
            _check_marks(rec, ("backward_start", "backward_end"))
            m = rec["marks"]
            top = (len(records) - rank) * rank_h  # rank 0 at the top
            y_compute = top - 1.0
            last_handed = max((b["handed"] for b in rec["buckets"]), default=m["backward_end"])
            bars = [((0.0, m["backward_start"]), dict(color="#d9d9d9")),
                    ((m["backward_start"], last_handed), dict(color="#7f7f7f")),
                    ((last_handed, m["backward_end"]), dict(facecolor="white", edgecolor="#7f7f7f", hatch="///"))]
            for (a, b), style in bars:
                ax.broken_barh([(a * scale, (b - a) * scale)], (y_compute, 0.8), **style)
            ticks.append((y_compute + 0.4, f"rank {rank}: fwd | bwd"))
            for lane, b in enumerate(rec["buckets"]):
                y = y_compute - 0.45 * (lane + 1)
                ax.broken_barh([(b["handed"] * scale, (b["done"] - b["handed"]) * scale)], (y, 0.38),
                               color=BUCKET_COLORS[b["index"] % len(BUCKET_COLORS)], alpha=0.9)
                # the number left of the bar: right of it, a rank's backward() line can fall on it
                ax.text(b["handed"] * scale, y + 0.19, f"{b['index']} ", ha="right", va="center", fontsize=9,
                        fontweight="bold")
            if rec["buckets"]:
                ticks.append((y_compute - 0.45 * (len(rec["buckets"]) + 1) / 2 + 0.19, f"rank {rank}: buckets"))
            # over this rank's rows only, so that it crosses no other rank's bars or numbers
            ax.plot([m["backward_end"] * scale] * 2, [y_compute - 0.45 * len(rec["buckets"]), y_compute + 0.8],
                    color="black", lw=1.2, ls=RANK_LINES[rank % len(RANK_LINES)])
        pos, names = zip(*ticks)
        ax.set_yticks(pos, names, fontsize=8)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("ms since the iteration started" if unit_ms else "s since the iteration started", fontsize=8)
        ax.xaxis.set_tick_params(labelbottom=True)  # sharex hides the upper panels' tick labels; keep them
        ax.grid(axis="x", alpha=0.3)
    _timeline_legend(fig)
    return fig.describe(_timeline_alt(panels, "ms" if unit_ms else "s"))


def _timeline_alt(panels: Dict[str, Sequence[dict]], unit: str) -> str:
    """The timeline in words: its panels, ranks and buckets (no times: they vary by run)."""
    parts = [f"{' '.join(title.split())}: {len(recs)} ranks, "
             f"{listed(sorted({str(len(r['buckets'])) for r in recs}))} bucket(s) each"
             for title, recs in panels.items()]
    return (f"Timeline of one training iteration on each rank, {len(panels)} panel(s) on one time axis in {unit} "
            f"({'; '.join(parts)}). For each rank a bar shows its forward, its backward computing gradients, and its "
            "backward waiting for the last all-reduces; below it one bar per gradient bucket runs from DDP handing "
            "the bucket to the communication hook to its all-reduce finishing, and a black line marks where the "
            "rank's backward() returned.")
