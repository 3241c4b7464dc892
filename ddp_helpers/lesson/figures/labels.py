"""Labels on a bar of spans (a layer's gradients, a bucket's sends), placed so that none overlaps
another: inside a span where the name fits, else beside it with a leader line.

Built without pyplot, so a notebook shows each figure once (as the cell's value).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence


def merge_spans(items: Sequence[tuple]) -> list:
    """(name, start, end) in time order, neighbours of one name (a layer's weight and bias) merged into one."""
    spans: list = []
    for name, a, b in items:
        if spans and spans[-1][0] == name and abs(spans[-1][2] - a) < 1e-9:
            spans[-1] = (name, spans[-1][1], b)
        else:
            spans.append((name, a, b))
    return spans


def label_spans(ax: Any, y: float, spans: Sequence[tuple], below: bool = False) -> None:
    """Label every name of a bar once, per parameter where the labels fit without touching, else per layer
    ("9.*" for 9.weight and 9.bias): inside its span where the name fits, else beside it with a leader line."""
    ax.figure.draw_without_rendering()  # the layout as drawn, so that a label's width is known in data units
    layers = merge_spans([(n.rsplit(".", 1)[0] + ".*" if "." in n else n, a, b) for n, a, b in spans])
    for attempt, last in ((spans, False), (layers, True)):
        drawn = _draw_labels(ax, y, attempt, below, force=last)
        if drawn is not None:
            return


def _draw_labels(ax: Any, y: float, spans: Sequence[tuple], below: bool, force: bool) -> Optional[list]:
    """The labels of spans (inside, or beside: _place_beside); None, with nothing left drawn, where the ones
    beside would crowd (unless force)."""
    inside, drawn = set(), []
    for i, (name, a, b) in enumerate(spans):
        text = ax.text((a + b) / 2, y, name, ha="center", va="center", fontsize=7, color="white")
        if name not in {spans[j][0] for j in inside} and _data_width(ax, text) < 0.92 * (b - a):
            inside.add(i)
            drawn.append(text)
        else:
            text.remove()
    # every span not labelled inside gets a label beside it, even where its name is written on another span:
    # a sliver far from its layer's label (layer 5's bias sent beside layer 6) must not read as its neighbour's
    beside = [(name, (a + b) / 2) for i, (name, a, b) in enumerate(spans) if i not in inside]
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
        text = ax.annotate(", ".join(dict.fromkeys(n for n, _ in group)), xy=(x, y + 0.3 * sign), fontsize=7, ha="left",
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
