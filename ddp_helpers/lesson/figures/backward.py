"""DDP's backward in sequence: gradients last layer first, each hook filling its bucket, buckets
launched in order, and the callback that waits for them before backward() returns (notebook 0).

Built without pyplot, so a notebook shows each figure once (as the cell's value).
"""
from __future__ import annotations

from typing import Any, Sequence

from matplotlib.figure import Figure

from .style import DPI, Diagram


SEQ_LANES = ("your loop", "autograd\nengine", "DDP's Reducer\n(C++)", "gloo")


def _seq_note(ax: Any, lane: int, row: float, text: str, color: str = "#f0f0f0") -> None:
    ax.text(lane, -row, text, ha="center", va="center", fontsize=7, wrap=True,
            bbox=dict(boxstyle="round,pad=0.25", facecolor=color, edgecolor="#888888", lw=0.5))


def _seq_arrow(ax: Any, a: int, b: int, row: float, color: str = "black") -> None:
    ax.annotate("", xy=(b + (0.04 if b < a else -0.04), -row), xytext=(a + (0.04 if a < b else -0.04), -row),
                arrowprops=dict(arrowstyle="-|>", color=color, lw=0.8, shrinkA=0, shrinkB=0))


def ddp_backward_events(names: Sequence[str], buckets: Sequence[Sequence[int]]) -> list:
    """The events of one DDP backward, in order: (lane from, lane to, text) per step. buckets: parameter indices
    of each bucket, in launch order (as a communication hook sees them); backward makes the gradients in the
    reverse of model.parameters() order; Reducer::mark_bucket_ready launches buckets strictly in index order."""
    order = [p for b in buckets for p in b]
    if sorted(order) != list(range(len(names))):
        raise ValueError("ddp_backward_events: the buckets must hold every parameter index once "
                         f"(0 .. {len(names) - 1}); got {list(buckets)}")
    home = {p: i for i, b in enumerate(buckets) for p in b}
    missing, launched = [len(b) for b in buckets], 0
    events = [(0, 1, "loss.backward()"), (1, 1, "gradients, last layer first; each\nfires Reducer::autograd_hook"
                                            "\n-> mark_variable_ready: copied\ninto its bucket, x 1/W only if\n"
                                            "no comm hook is registered\n(allreduce_hook divides itself)")]
    for p in reversed(range(len(names))):
        events.append((1, 2, f"grad of {names[p]} -> bucket {home[p]}"))
        missing[home[p]] -= 1
        while launched < len(buckets) and missing[launched] == 0:  # in order, never out of turn
            events.append((2, 3, f"bucket {launched} full: all_reduce (async)"))
            launched += 1
    events.append((2, 1, "last bucket launched:\nqueue_callback(finalize_backward)"))
    events.append((1, 2, "graph done: the engine\nruns the queued callback"))
    events.append((2, 2, "finalize_backward:\nwait() on each bucket's work,\ncopy the means into p.grad"))
    events.append((3, 2, "all works done"))
    events.append((2, 0, "backward() returns"))
    events.append((0, 0, "optimizer.step()"))
    return events


def draw_ddp_backward(names: Sequence[str], buckets: Sequence[Sequence[int]]) -> Diagram:
    """Sequence diagram of one DDP backward on CPU (gloo): gradients last layer first, each parameter's hook
    copying into its bucket, each full bucket's all-reduce launched in order, and the queued callback
    (Reducer::finalize_backward, queued by mark_variable_ready once the last bucket is launched) that waits for
    them all before backward() returns. A schematic of the order of events (torch 2.14.1's reducer), with the
    buckets given (e.g. those a real DDP run formed): not timed."""
    events = ddp_backward_events(names, buckets)
    fig = Figure(figsize=(4.6, 1.0 + 0.3 * len(events)), layout="constrained", dpi=DPI)  # narrow: a phone
    ax = fig.add_subplot()
    colors = {3: "#c6dbef", 0: "#e5f5e0"}
    row = 0.0
    for a, b, text in events:
        half = 0.3 * text.count("\n")  # a note of several lines takes the room of more than one row
        row += 1 + half
        if a != b:
            _seq_arrow(ax, a, b, row, "#1f77b4" if b == 3 else "black")
            ax.text((a + b) / 2, -row + 0.1, text, ha="center", va="bottom", fontsize=7,
                    color="#1f77b4" if b == 3 else "black")
        else:
            _seq_note(ax, a, row, text, colors.get(a, "#f0f0f0"))
        row += half
    for lane, label in enumerate(SEQ_LANES):
        ax.plot([lane, lane], [-0.4, -row - 0.6], color="#bbbbbb", lw=0.8, zorder=0)
    ax.set_xticks(range(len(SEQ_LANES)), SEQ_LANES, fontsize=8)
    ax.xaxis.tick_top()
    ax.set_yticks([])
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_xlim(-0.6, len(SEQ_LANES) - 0.4)
    ax.set_ylim(-row - 0.8, 0)
    ax.set_title("one DDP backward, in order: a schematic of torch\n2.14.1's Reducer, not timed (time runs down)",
                 fontsize=8)
    launches = [t for _, b, t in events if b == 3]
    alt = (f"Sequence diagram, a schematic of the order of events, not timed: loss.backward() starts autograd, "
           f"which computes the {len(names)} gradients last layer first; for each, DDP's Reducer::autograd_hook "
           f"calls mark_variable_ready, which copies it into its bucket (times 1/W when no communication hook is "
           "registered; with torch's allreduce_hook the hook divides the bucket by W before its all-reduce); "
           f"{len(launches)} buckets "
           "each launch an asynchronous all_reduce as soon as they are full, in bucket order; once the last is "
           "launched, mark_variable_ready queues finalize_backward with the engine's queue_callback; when the "
           "graph is done the engine runs finalize_backward, "
           "which waits for every bucket's all-reduce and copies the means into p.grad, and only then does "
           "backward() return and the loop call optimizer.step().")
    return Diagram(fig, alt)
