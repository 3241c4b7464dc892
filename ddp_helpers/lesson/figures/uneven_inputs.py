"""Uneven inputs: each rank's DDP iterations with and without Join, and Join's shadow
all-reduces (notebook 10).

Built without pyplot, so a notebook shows each figure once (as the cell's value).
"""
from __future__ import annotations

from typing import Any, Dict, Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Patch

from .style import DPI, Diagram, Plot, listed, rank_color


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
            ax.plot([joined, joined], [y - 0.5, y + 0.5], color=rank_color(rank), lw=1.5)
            ax.text(joined + 0.1, y - 0.42, f"rank {rank} has run out of batches: it joins", fontsize=6, va="top",
                    color=rank_color(rank))
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


# What a rank does in one DDP iteration, and how plot_rank_steps draws it.
STEP_STYLES = {
    "trained": dict(color="#1f77b4", label="trains on its own batch"),
    "shadowed": dict(facecolor="white", edgecolor="#1f77b4", hatch="///",
                     label="joined: answers the others' all-reduces with zeros"),
    "blocked": dict(color="#d62728", label="blocked in its all-reduce: no rank answers"),
    "left": dict(color="#e0e0e0", label="left the loop: no collective"),
}


def plot_rank_steps(panels: Dict[str, Sequence[Sequence[str]]]) -> Plot:
    """One panel per run (title -> per rank, what it did in each DDP iteration): a row of boxes per rank.

    The states are STEP_STYLES' keys: "trained", "shadowed" (joined, answering with zeros), "blocked" (waiting
    in an all-reduce nobody answers) and "left" (out of the loop, issuing no collective).
    """
    if not panels:
        raise ValueError("plot_rank_steps needs at least one panel: {title: [states of rank 0, states of rank 1]}")
    for title, ranks in panels.items():
        for rank, states in enumerate(ranks):
            unknown = sorted(set(states) - set(STEP_STYLES))
            if unknown:
                raise ValueError(f"plot_rank_steps: panel {title!r}, rank {rank}: unknown state(s) {unknown}; "
                                 f"use one of {sorted(STEP_STYLES)}")
    n_steps = max(len(states) for ranks in panels.values() for states in ranks)
    n_rows = sum(len(ranks) for ranks in panels.values())
    fig = Plot(figsize=(7.5, 1.3 + 0.45 * n_rows + 0.4 * len(panels)), layout="constrained", dpi=DPI)
    axes = fig.subplots(len(panels), 1, squeeze=False, sharex=True,
                        gridspec_kw={"height_ratios": [len(r) for r in panels.values()]})[:, 0]
    for ax, (title, ranks) in zip(axes, panels.items()):
        for rank, states in enumerate(ranks):
            y = len(ranks) - 1 - rank  # rank 0 at the top
            for step, state in enumerate(states, start=1):
                ax.broken_barh([(step - 0.45, 0.9)], (y - 0.35, 0.7), **{k: v for k, v in STEP_STYLES[state].items()
                                                                          if k != "label"})
        ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in reversed(range(len(ranks)))], fontsize=8)
        ax.set_ylim(-0.6, len(ranks) - 0.4)
        ax.set_title(title, fontsize=9)
        ax.set_xticks(range(1, n_steps + 1))
        ax.xaxis.set_tick_params(labelbottom=True)
        ax.set_xlim(0.4, n_steps + 0.6)
    axes[-1].set_xlabel("DDP iteration (one all-reduce of the gradients each)", fontsize=8)
    used = {s for ranks in panels.values() for states in ranks for s in states}
    handles = [Patch(**STEP_STYLES[s]) for s in STEP_STYLES if s in used]
    fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=7, frameon=False)
    return fig.describe(_rank_steps_alt(panels, n_steps))


def _rank_steps_alt(panels: Dict[str, Sequence[Sequence[str]]], n_steps: int) -> str:
    """Each panel in words: per rank, what it did and in how many iterations."""
    def rank_words(rank: int, states: Sequence[str]) -> str:
        counts = [f"{STEP_STYLES[s]['label'].split(':')[0]} ({states.count(s)})" for s in STEP_STYLES if s in states]
        return f"rank {rank}: {listed(counts)}"
    said = " ".join(f"{' '.join(title.split())}: {'; '.join(rank_words(r, list(st)) for r, st in enumerate(ranks))}."
                    for title, ranks in panels.items())
    return (f"One row of boxes per rank, one box per DDP iteration (up to {n_steps}), in {len(panels)} panel(s), "
            f"each box coloured by what the rank did in that iteration. {said}")
