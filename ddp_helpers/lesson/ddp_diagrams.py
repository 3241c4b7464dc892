"""Diagrams of DDP's side of the mechanism: buckets overlapping backward (notebooks 3b, 7), Join's shadow
all-reduces (notebook 10), a crashed job resumed from a checkpoint (notebook 6), and who holds what under DDP,
ZeRO and FSDP2 (notebook 12). Each returns a diagrams.Diagram: a figure and its alt text, built from real
records where there are any (bucket layouts, the collectives each rank made, steps and checkpoints, bytes).
"""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

from matplotlib.figure import Figure
from matplotlib.legend_handler import HandlerTuple
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from .diagrams import DPI, Diagram
from .lesson_plots import BUCKET_COLORS
from .plots import _color


# ------------------------------------------------------------------------------------- buckets and overlap
SEND_COLORS = tuple(c for c in BUCKET_COLORS if c != "#7f7f7f")  # grey is backward's colour in these diagrams


def _bucket_rows(ax: Any, y: float, buckets: Sequence[Sequence[int]], ready: Sequence[float],
                 param_bytes: Sequence[int], rate: float, names: Optional[Sequence[str]] = None,
                 colors: Optional[Sequence[str]] = None) -> list:
    """Draw the all-reduces of buckets (one lane, one after the other) from their ready times; each one's
    (start, end).
    A single bucket is the one all-reduce of everything: it is labelled so, not numbered; with names (one
    gradient per bucket) every send is labelled with its layer, slivers below the bar. colors: each bucket's
    (default: one per bucket, in turn)."""
    free, spans, sends = 0.0, [], []
    for i, (b, t) in enumerate(zip(buckets, ready)):
        start = max(t, free)  # one communication channel: a bucket waits for the one before it
        length = sum(param_bytes[p] for p in b) * rate
        color = colors[i] if colors is not None else SEND_COLORS[i % len(SEND_COLORS)]
        ax.broken_barh([(start, length)], (y - 0.3, 0.6), color=color)
        label = f"all {len(b)} gradients" if len(buckets) == 1 else f"{i}"
        if names is not None and len(buckets) > 1:
            spans.append((names[b[0]], start, start + length))
        elif length > 0.025:  # a number on a sliver would run into its neighbours'
            ax.text(start + length / 2, y, label, ha="center", va="center", fontsize=8, color="white")
        free = start + length
        sends.append((start, free))
    if spans:
        _label_spans(ax, y, _merge_spans(spans), below=True)
    return sends


def _merge_spans(items: Sequence[tuple]) -> list:
    """(name, start, end) in time order, neighbours of one name (a layer's weight and bias) merged into one."""
    spans: list = []
    for name, a, b in items:
        if spans and spans[-1][0] == name and abs(spans[-1][2] - a) < 1e-9:
            spans[-1] = (name, spans[-1][1], b)
        else:
            spans.append((name, a, b))
    return spans


def _label_spans(ax: Any, y: float, spans: Sequence[tuple], below: bool = False) -> None:
    """Label every name of a bar once, per parameter where the labels fit without touching, else per layer
    ("9.*" for 9.weight and 9.bias): inside its span where the name fits, else beside it with a leader line."""
    ax.figure.draw_without_rendering()  # the layout as drawn, so that a label's width is known in data units
    layers = _merge_spans([(n.rsplit(".", 1)[0] + ".*" if "." in n else n, a, b) for n, a, b in spans])
    for attempt, last in ((spans, False), (layers, True)):
        drawn = _draw_labels(ax, y, attempt, below, force=last)
        if drawn is not None:
            return


def _draw_labels(ax: Any, y: float, spans: Sequence[tuple], below: bool, force: bool) -> Optional[list]:
    """The labels of spans (inside, or beside: _place_beside); None, with nothing left drawn, where the ones
    beside would crowd (unless force)."""
    inside, drawn = set(), []
    for name, a, b in spans:
        text = ax.text((a + b) / 2, y, name, ha="center", va="center", fontsize=7, color="white")
        if name not in inside and _data_width(ax, text) < 0.92 * (b - a):
            inside.add(name)
            drawn.append(text)
        else:
            text.remove()
    beside, shown = [], set()
    for name, a, b in spans:
        if name not in inside and name not in shown:
            shown.add(name)
            beside.append((name, (a + b) / 2))
    placed = _place_beside(ax, y, beside, below, force)
    if placed is None:
        for text in drawn:
            text.remove()
        return None
    return drawn + placed


def _data_width(ax: Any, text: Any) -> float:
    """How wide a text is drawn, in ax's data units (the layout drawn already)."""
    box = text.get_window_extent()
    to_data = ax.transData.inverted()
    return float(to_data.transform((box.x1, 0))[0] - to_data.transform((box.x0, 0))[0])


def _place_beside(ax: Any, y: float, labels: Sequence[tuple], below: bool, force: bool) -> Optional[list]:
    """Labels (name, x) above (or below) the bar at y, on two levels, with a straight leader to x; slivers side
    by side (11.bias, 11.weight, 9.bias) share one label, their names in time order. No label overlaps another:
    where they can't all stand with straight leaders, None (nothing drawn), or with force, leaders that slant."""
    groups: list = []
    for name, x in labels:
        if groups and x - groups[-1][0][1] < 0.07:  # near the group's first: one label for them
            groups[-1].append((name, x))
        else:
            groups.append([(name, x)])
    sign, va = (-1, "top") if below else (1, "bottom")
    items = []
    for group in groups:
        x = (group[0][1] + group[-1][1]) / 2
        text = ax.annotate(", ".join(n for n, _ in group), xy=(x, y + 0.3 * sign), fontsize=7, ha="left",
                           va=va, xytext=(x, y), arrowprops=dict(arrowstyle="-", lw=0.5))
        items.append((text, x, 1.1 * _data_width(ax, text)))  # a tenth to spare
    spots = _spots_uncrossed(items)
    if spots is None and not force:
        for text, _, _ in items:
            text.remove()
        return None
    for (text, _, _), (start, level) in zip(items, spots or _spots_pushed(items)):
        text.set_position((start, y + sign * (0.55 + 0.25 * level)))
    return [text for text, _, _ in items]


def _spots_uncrossed(items: Sequence[tuple]) -> Optional[list]:
    """(start, level) per label, placed right to left: each on the lower of two levels where it overlaps no label
    and its leader (straight up from x) crosses none; None where some label finds no such place."""
    placed: list = [[], []]  # per level: the (start, end) of its labels
    spots = []
    for _, x, width in reversed(items):
        start, end = x + 0.01, x + 0.01 + width

        def fits(level: int) -> bool:
            free = all(end < a or start > b for a, b in placed[level])
            return free and all(not a <= x <= b for low in placed[:level] for a, b in low)

        level = next((k for k in range(2) if fits(k)), None)
        if level is None:
            return None
        placed[level].append((start, end))
        spots.append((start, level))
    return spots[::-1]


def _spots_pushed(items: Sequence[tuple]) -> list:
    """(start, level) per label, left to right, where too many crowd for _spots_uncrossed: each on the level
    where it can start soonest, moved right past the labels there (leaders then slant, and may cross)."""
    ends, spots = [float("-inf"), float("-inf")], []
    for _, x, width in items:
        starts = [max(x + 0.01, end + 0.01) for end in ends]
        level = min(range(2), key=lambda k: (starts[k], k))
        ends[level] = starts[level] + width
        spots.append((starts[level], level))
    return spots


def _name_spans(ax: Any, y: float, names: Sequence[str], sizes: Sequence[float]) -> None:
    """Label every layer on backward's bar (which computes the gradients last parameter first)."""
    items, x = [], 0.0
    for p in reversed(range(len(names))):
        items.append((names[p], x, x + sizes[p]))
        x += sizes[p]
    _label_spans(ax, y, _merge_spans(items))


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


# --------------------------------------------------------------------------------------------------- Join
JOIN_STYLES = {
    "grads": dict(color="#1f77b4", label="all-reduce of a gradient bucket"),
    "zeros": dict(facecolor="white", edgecolor="#1f77b4", hatch="///",
                  label="shadow: a joined rank's bucket of zeros"),
    "control": dict(color="#bdbdbd", label="one-number all-reduce of Join or DDP (who is still training, sync?)"),
    "control_joined": dict(facecolor="white", edgecolor="#7f7f7f", hatch="...",
                           label="the same, answered by a joined rank"),
}


def _join_style(kind: str, when: Any) -> str:
    after = when == "after"
    if kind == "bucket":
        return "zeros" if after else "grads"
    return "control_joined" if after else "control"


def draw_join(logs: Sequence[Sequence[Sequence[Any]]]) -> Diagram:
    """Every all-reduce each rank made under Join, in order: logs[rank] = [(kind, when), ...], kind "bucket" (the
    gradients) or "all_reduce" (one number), when the rank's loop iteration or "after" (its loop was over).

    The k-th all-reduce of every rank is one collective, so the boxes of a column are matched: a line joins
    them. A rank's boxes after its loop are its shadows of the others' iterations."""
    if not logs or any(not log for log in logs):
        raise ValueError("draw_join needs one non-empty log per rank: [[(kind, when), ...], ...]")
    n = max(len(log) for log in logs)
    gap = 1.7  # rows apart: room for the iteration labels above a row and the join mark below it
    fig = Figure(figsize=(max(6.0, 0.36 * n + 1.8), 1.3 + 0.85 * len(logs)), layout="constrained", dpi=DPI)
    ax = fig.add_subplot()
    for rank, log in enumerate(logs):
        y = (len(logs) - 1 - rank) * gap
        for k, (kind, when) in enumerate(log):
            style = {a: b for a, b in JOIN_STYLES[_join_style(kind, when)].items() if a != "label"}
            ax.broken_barh([(k + 0.08, 0.84)], (y - 0.3, 0.6), **style)
            if when != "after" and (k == 0 or log[k - 1][1] != when):
                ax.text(k + 0.1, y + 0.36, f"iteration {when}", fontsize=6, va="bottom")
        joined = next((k for k, (_, w) in enumerate(log) if w == "after"), None)
        if joined is not None:
            ax.plot([joined, joined], [y - 0.5, y + 0.5], color=_color(rank), lw=1.5)
            ax.text(joined + 0.1, y - 0.42, f"rank {rank} has run out of batches: it joins", fontsize=6, va="top",
                    color=_color(rank))
    for k in range(min(len(log) for log in logs)):  # the k-th all-reduce of every rank is one collective
        ax.plot([k + 0.5, k + 0.5], [0.3, (len(logs) - 1) * gap - 0.3], color="black", lw=0.4, alpha=0.5)
    ax.set_yticks([r * gap for r in range(len(logs))], [f"rank {r}" for r in reversed(range(len(logs)))], fontsize=8)
    ax.set_ylim(-0.9, (len(logs) - 1) * gap + 0.8)
    ax.set_xlim(0, n)
    ax.set_xlabel("the ranks' all-reduces, in the order each rank made them (a column is one collective)",
                  fontsize=8)
    ax.set_xticks([])
    used = {_join_style(k, w) for log in logs for k, w in log}
    fig.legend(handles=[Patch(**JOIN_STYLES[s]) for s in JOIN_STYLES if s in used], loc="outside lower center",
               ncols=2, fontsize=7, frameon=False)
    return Diagram(fig, _join_alt(logs))


def _join_alt(logs: Sequence[Sequence[Sequence[Any]]]) -> str:
    first = logs[0][0][1]
    per_iteration = [k for k, w in logs[0] if w == first]
    parts = []
    for rank, log in enumerate(logs):
        iters = len({w for _, w in log if w != "after"})
        shadow = sum(k == "bucket" and w == "after" for k, w in log)
        control = sum(k != "bucket" and w == "after" for k, w in log)
        joined = (f", then, joined, takes part in {shadow} gradient all-reduces with zeros and {control} one-number "
                  "all-reduces" if shadow else f", then in {control} last one-number all-reduces" if control else "")
        parts.append(f"rank {rank} trains {iters} iterations{joined}")
    return ("The all-reduces of each rank under Join, in order, one row per rank; the k-th all-reduce of every "
            f"rank is the same collective. Each iteration makes {per_iteration.count('all_reduce')} one-number "
            f"all-reduces and {per_iteration.count('bucket')} gradient all-reduce(s). " + "; ".join(parts) +
            ": every collective has a partner on the other rank, and nobody waits for one that never comes.")


# --------------------------------------------------------------------------------------- crash and resume
def draw_resume(crashed_at: int, checkpoints: Sequence[int], total_steps: int, steps_per_epoch: int,
                crashed_rank: Optional[int] = None, final_equal: Optional[bool] = None) -> Diagram:
    """A job that crashed at step crashed_at, with checkpoints written at the given steps, resumed from the
    latest one before the crash and run to total_steps, against the same job never interrupted; final_equal:
    whether the two ended with bitwise equal parameters (said on the figure when given)."""
    before = [c for c in checkpoints if c <= crashed_at]
    if not before:
        raise ValueError(f"draw_resume: no checkpoint at or before step {crashed_at} in {list(checkpoints)}: "
                         "the job would restart from step 0")
    resume = max(before)
    fig = Figure(figsize=(8, 2.4), layout="constrained", dpi=DPI)
    ax = fig.add_subplot()
    rows = (("first run", 0, crashed_at, "#1f77b4"), ("resumed run", resume, total_steps, "#2ca02c"),
            ("never interrupted", 0, total_steps, "#7f7f7f"))
    for i, (label, a, b, color) in enumerate(rows):
        y = 2 - i
        ax.broken_barh([(a, b - a)], (y - 0.3, 0.6), color=color, alpha=0.85)
    ax.broken_barh([(resume, crashed_at - resume)], (2 - 0.3, 0.6), facecolor="none", edgecolor="#d62728",
                   hatch="///", lw=0)
    ax.plot(checkpoints, [2] * len(checkpoints), ls="none", marker="D", ms=6, color="white", mec="black")
    ax.plot([crashed_at], [2], marker="X", ms=11, color="#d62728")
    who = f"rank {crashed_rank} fails" if crashed_rank is not None else "a rank fails"
    ax.text(crashed_at + 0.6, 2.35, f"{who} at step {crashed_at}", fontsize=7, color="#d62728")
    ax.annotate("", xy=(resume, 1.3), xytext=(resume, 1.7), arrowprops=dict(arrowstyle="-|>", color="black"))
    ax.text(resume + 0.6, 1.45, f"loads the step-{resume} checkpoint", fontsize=7)
    if final_equal is not None:
        ax.text(total_steps, 0.5, "final parameters " + ("bitwise equal" if final_equal else "differ"),
                ha="right", va="center", fontsize=7)
    for e in range(steps_per_epoch, total_steps, steps_per_epoch):
        ax.axvline(e, color="black", lw=0.6, ls=":")
        ax.text(e, -0.65, f" epoch {e // steps_per_epoch}", fontsize=7)
    ax.set_yticks([2, 1, 0], [r[0] for r in rows], fontsize=8)
    ax.set_ylim(-0.8, 2.8)
    ax.set_xlim(0, total_steps + 1)
    ax.set_xlabel("optimizer step", fontsize=8)
    handles = [Line2D([], [], ls="none", marker="D", color="white", mec="black", label="checkpoint written by rank 0"),
               Patch(facecolor="none", edgecolor="#d62728", hatch="///", label="steps lost and redone")]
    fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=7, frameon=False)
    alt = (f"Three runs of the same {total_steps}-step job on one step axis. The first run writes checkpoints at "
           f"steps {', '.join(map(str, checkpoints))} and stops when {who} at step {crashed_at}; the resumed run "
           f"loads the checkpoint of step {resume} and trains steps {resume} to {total_steps - 1}, redoing the "
           f"{crashed_at - resume} steps after it, and ends "
           + ("with parameters bitwise equal to those of" if final_equal else
              "with other parameters than" if final_equal is False else "where") +
           " the run that was never interrupted" + (" ends." if final_equal is None else "."))
    return Diagram(fig, alt)


# -------------------------------------------------------------------------------------------- who holds what
PART_COLORS = {"parameters": "#1f77b4", "gradients": "#ff7f0e", "optimizer state": "#2ca02c"}


def draw_holdings(per_rank: Mapping[str, Sequence[Mapping[str, int]]], total: Mapping[str, int]) -> Diagram:
    """One panel per method (name -> one rank_bytes() per rank, lesson.sharding): what each rank holds of the
    parameters, gradients and optimizer state, stacked, against one full copy of all three (dashed)."""
    if not per_rank or any(not ranks for ranks in per_rank.values()):
        raise ValueError("draw_holdings needs {method: [rank_bytes() of rank 0, rank 1, ...]}, none empty")
    missing = [p for p in PART_COLORS if p not in total]
    if missing:
        raise ValueError(f"draw_holdings: total lacks {missing}: give one full copy's bytes of each part")
    full = sum(total[p] for p in PART_COLORS) / 1e6
    fig = Figure(figsize=(6.4, 2.0 * len(per_rank) + 0.9), layout="constrained", dpi=DPI)
    axes = fig.subplots(len(per_rank), 1, sharey=True, squeeze=False)[:, 0]  # stacked: every panel on a phone
    for ax, (method, ranks) in zip(axes, per_rank.items()):
        for r, held in enumerate(ranks):
            bottom = 0.0
            for part, color in PART_COLORS.items():
                mb = held.get(part, 0) / 1e6
                ax.bar(r, mb, bottom=bottom, color=color, width=0.7)
                bottom += mb
        ax.axhline(full, color="black", ls="--", lw=0.8)
        ax.set_xticks(range(len(ranks)), [f"rank {r}" for r in range(len(ranks))], fontsize=9)
        ax.set_title(method, fontsize=10)
        ax.set_ylabel("MB held", fontsize=9)
    handles = [Patch(color=c, label=p) for p, c in PART_COLORS.items()]
    handles.append(Line2D([], [], color="black", ls="--", lw=0.8, label="one full copy of all three"))
    fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=8, frameon=False)
    alt = "What each rank holds, stacked (parameters, gradients, optimizer state), against one full copy of " \
          f"{full:.2f} MB. " + " ".join(
              f"{method}: " + ", ".join(f"rank {r} {sum(h.get(p, 0) for p in PART_COLORS) / 1e6:.2f} MB"
                                        for r, h in enumerate(ranks)) + "."
              for method, ranks in per_rank.items())
    return Diagram(fig, alt)
