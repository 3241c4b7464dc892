"""DDP's backward in sequence: gradients last layer first, each hook filling its bucket, buckets
launched in order, and the callback that waits for them before backward() returns (notebook 0).

Built without pyplot, so a notebook shows each figure once (as the cell's value).
"""
from __future__ import annotations

from typing import Any, Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

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
    reverse of model.parameters() order; Reducer::mark_bucket_ready launches buckets strictly in index order.
    Each bucket but the last is drawn done while the next one fills (a schematic: gloo may take longer), the
    last while Reducer::finalize_backward waits for it; each bucket's means reach p.grad after its wait()."""
    order = [p for b in buckets for p in b]
    if sorted(order) != list(range(len(names))):
        raise ValueError("ddp_backward_events: the buckets must hold every parameter index once "
                         f"(0 .. {len(names) - 1}); got {list(buckets)}")
    home = {p: i for i, b in enumerate(buckets) for p in b}
    missing, launched = [len(b) for b in buckets], 0
    events = [(0, 1, "loss.backward()"), (1, 1, "gradients, last layer first; each\nfires Reducer::autograd_hook"
                                            "\n-> mark_variable_ready: copied\ninto its bucket, x 1/W only if\n"
                                            "no comm hook is registered\n(allreduce_hook divides itself)")]
    running, grads_since = None, 0  # the bucket whose all-reduce runs, and the gradients computed meanwhile
    for p in reversed(range(len(names))):
        events.append((1, 2, f"grad of {names[p]} -> bucket {home[p]}"))
        missing[home[p]] -= 1
        grads_since += 1
        if running is not None and grads_since >= max(1, len(buckets[running + 1]) // 2):
            events.append((3, 2, f"bucket {running}: all-reduce done"))  # while autograd still computes
            running = None
        while launched < len(buckets) and missing[launched] == 0:  # in order, never out of turn
            if running is not None:  # a bucket full at once: the one before it is drawn done first
                events.append((3, 2, f"bucket {running}: all-reduce done"))
            events.append((2, 3, f"bucket {launched} full: all_reduce (async)"))
            running, grads_since, launched = launched, 0, launched + 1
    last = len(buckets) - 1
    events.append((2, 1, "last bucket launched:\nqueue_callback(finalize_backward)"))
    events.append((1, 2, "graph done: the engine\nruns the queued callback"))
    if last > 0:
        done = "bucket 0" if last == 1 else f"buckets 0-{last - 1}"
        events.append((2, 2, f"finalize_backward, bucket by bucket:\n{done}: wait() returns at once\n"
                             "(done already), then their\nmeans are copied into p.grad"))
    events.append((2, 2, f"bucket {last}: wait() blocks"))
    events.append((3, 2, f"bucket {last}: all-reduce done"))
    events.append((2, 2, f"bucket {last}: its means are\ncopied into p.grad"))
    events.append((2, 0, "backward() returns"))
    events.append((0, 0, "optimizer.step()"))
    return events


def draw_ddp_backward(names: Sequence[str], buckets: Sequence[Sequence[int]]) -> Diagram:
    """Sequence diagram of one DDP backward on CPU (gloo): gradients last layer first, each parameter's hook
    copying into its bucket, each full bucket's all-reduce launched in order, and the queued callback
    (Reducer::finalize_backward, queued by mark_variable_ready once the last bucket is launched) that waits for
    them all, bucket by bucket, then copies each bucket's means into p.grad, before backward() returns; a bar in
    gloo's lane spans each bucket's all-reduce, from its launch to its end. A schematic of the order of events (the recorded torch's reducer), with the
    buckets given (e.g. those a real DDP run formed): not timed."""
    events = ddp_backward_events(names, buckets)
    fig = Figure(figsize=(4.6, 1.0 + 0.3 * len(events)), layout="constrained", dpi=DPI)  # narrow: a phone
    ax = fig.add_subplot()
    colors = {3: "#c6dbef", 0: "#e5f5e0"}
    row, started, spans = 0.0, {}, {}
    for a, b, text in events:
        half = 0.3 * text.count("\n")  # a note of several lines takes the room of more than one row
        row += 1 + half
        if b == 3:  # a launch: its all-reduce runs from here until gloo says it is done
            started[text.split(" full")[0]] = row
        elif a == 3:
            bucket = text.split(":")[0]
            spans[bucket] = (started[bucket], row)
        if a != b:
            _seq_arrow(ax, a, b, row, "#1f77b4" if b == 3 else "black")
            ax.text((a + b) / 2, -row + 0.1, text, ha="center", va="bottom", fontsize=7,
                    color="#1f77b4" if b == 3 else "black")
        else:
            _seq_note(ax, a, row, text, colors.get(a, "#f0f0f0"))
        row += half
    for bucket, (top, bottom) in spans.items():  # gloo's lane: each bucket's all-reduce while it runs
        ax.add_patch(Rectangle((3.06, -bottom), 0.1, bottom - top, facecolor="#9ecae1", edgecolor="#1f77b4",
                               lw=0.5, label=f"{bucket} all-reducing"))
        ax.text(3.2, -(top + bottom) / 2, f"{bucket}\nall-reducing", fontsize=6, va="center", color="#1f77b4")
    for lane, label in enumerate(SEQ_LANES):
        ax.plot([lane, lane], [-0.4, -row - 0.6], color="#bbbbbb", lw=0.8, zorder=0)
    ax.set_xticks(range(len(SEQ_LANES)), SEQ_LANES, fontsize=8)
    ax.xaxis.tick_top()
    ax.set_yticks([])
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_xlim(-0.6, len(SEQ_LANES) - 0.2)
    ax.set_ylim(-row - 0.8, 0)
    ax.set_title("one DDP backward, in order: a schematic of torch\n2.14.1's Reducer, not timed (time runs down)",
                 fontsize=8)
    launches = [t for _, b, t in events if b == 3]
    alt = (f"Sequence diagram, a schematic of the order of events, not timed: loss.backward() starts autograd, "
           f"which computes the {len(names)} gradients last layer first; for each, DDP's Reducer::autograd_hook "
           f"calls mark_variable_ready, which copies it into its bucket (times 1/W when no communication hook is "
           "registered; with torch's allreduce_hook the hook divides the bucket by W before its all-reduce); "
           f"{len(launches)} buckets "
           "each launch an asynchronous all_reduce as soon as they are full, in bucket order, and a bucket's "
           "all-reduce runs in gloo while autograd still computes the next gradients (drawn done before the "
           "next bucket is full; on a slower network it ends later); once the last is "
           "launched, mark_variable_ready queues finalize_backward with the engine's queue_callback; when the "
           "graph is done the engine runs finalize_backward, which, bucket by bucket, waits for the all-reduce "
           "(done already for the early buckets, still running for the last) and then copies its means into "
           "p.grad; only then does backward() return and the loop call optimizer.step().")
    return Diagram(fig, alt)
