"""Starting a process group: each rank's rendezvous, drawn from its own timestamps (notebook 1).

Built without pyplot, so a notebook shows each figure once (as the cell's value).
"""
from __future__ import annotations

from typing import Any, List, Mapping, Optional, Sequence

from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import FancyArrowPatch, Patch

from ..rendezvous import address_owner
from .style import DPI, Diagram, rank_color, ranks_text


RDV_STYLES = {
    "connect": dict(color="#d9d9d9", label="connects to the store (a TCPStore client)"),
    "check_in": dict(color="#2ca02c", label="checks in: sets its own address key"),
    "wait": dict(facecolor="white", edgecolor="#1f77b4", hatch="///", label="waits for another rank's address"),
    "barrier": dict(color="#7f7f7f", label="the barrier: adds 1 to a counter, waits for the last rank"),
    "failed": dict(color="#d62728", label="the wait reaches the timeout: DistStoreError"),
}


def _rank_lane(ax: Any, y: float, rec: Mapping[str, Any], t0: float) -> List[float]:
    """Draw one rank's rendezvous on row y; returns the times its check-in (address set) happened."""
    bar = lambda a, b, style: ax.broken_barh([(a - t0, max(b - a, 0.004))], (y - 0.3, 0.6),  # noqa: E731
                                              **{k: v for k, v in RDV_STYLES[style].items() if k != "label"})
    bar(rec["start"], rec["connected"], "connect")
    if rec.get("returned") is not None:  # a thin line: inside init_process_group, between its calls on the store
        ax.plot([rec["connected"] - t0, rec["returned"] - t0], [y, y], color="black", lw=0.6, zorder=0)
    set_times = []
    for e in rec["log"]:
        owner = address_owner(e["key"])
        if e["failed"]:
            bar(e["start"], e["end"], "failed")
            ax.text(e["end"] - t0, y, f"  {e['failed']}", va="center", fontsize=7, color="#d62728")
        elif "barrier" in e["key"]:
            bar(e["start"], e["end"], "barrier")
        elif e["op"] == "set" and owner is not None:
            bar(e["start"], e["end"], "check_in")
            set_times.append(e["start"])
        elif e["op"] == "wait" and owner is not None and e["end"] - e["start"] > 0.02:
            bar(e["start"], e["end"], "wait")
            ax.text((e["start"] + e["end"]) / 2 - t0, y + 0.36, f"for rank {owner}", ha="center", fontsize=6)
    return set_times


def draw_rendezvous(panels: Mapping[str, Sequence[Mapping[str, Any]]], late: Optional[int] = None,
                    timeout_s: Optional[float] = None) -> Diagram:
    """One panel per run (title -> per rank {"start", "connected", "returned", "log"}; "start": when the rank began
    to join): its rendezvous in time.

    "log" is a RecordingStore's log of the calls init_process_group made on the store. Per rank: connecting,
    the check-in (the rank's own address key set), each wait for another rank's address, the barrier at the end
    of init_process_group, a wait that reached the timeout; above, the store, with an arrow from every check-in.
    late: the rank the first run held back; timeout_s: the second run's timeout (both only for the alt text).
    """
    if not panels or any(not ranks for ranks in panels.values()):
        raise ValueError("draw_rendezvous needs {title: [record of rank 0, record of rank 1, ...]}, none empty")
    heights = [len(r) + 1.3 for r in panels.values()]
    fig = Figure(figsize=(8, 1.3 + 0.42 * sum(heights)), layout="constrained", dpi=DPI)
    axes = fig.subplots(len(panels), 1, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    for ax, (title, ranks) in zip(axes, panels.items()):
        t0 = min(r["start"] for r in ranks)
        store_y = len(ranks) + 0.2
        ax.axhline(store_y, color="black", lw=2.5)
        for rank, rec in enumerate(ranks):
            y = len(ranks) - 1 - rank
            for t in _rank_lane(ax, y, rec, t0):
                ax.add_patch(FancyArrowPatch((t - t0, y + 0.3), (t - t0, store_y - 0.05), arrowstyle="-|>",
                                             mutation_scale=8, color=RDV_STYLES["check_in"]["color"], lw=0.8))
            if rec.get("returned") is not None and not any(e["failed"] for e in rec["log"]):
                ax.plot([rec["returned"] - t0], [y], marker="|", ms=14, color=rank_color(rank), mew=2)
        done = [r["returned"] for r in ranks if r.get("returned") is not None and not any(e["failed"] for e in r["log"])]
        if done:
            ax.axvline(max(done) - t0, color="black", lw=0.8, ls="--")
            ax.text(max(done) - t0, store_y + 0.35, "every rank has left init_process_group ", ha="right",
                    fontsize=7)
        ax.set_yticks([len(ranks) - 1 - r for r in range(len(ranks))] + [store_y],
                      [f"rank {r}" for r in range(len(ranks))] + ["the store"], fontsize=8)
        ax.set_ylim(-0.7, store_y + 0.8)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("seconds since the first rank began to join", fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    handles = [Patch(**s) for s in RDV_STYLES.values()]
    handles.append(Line2D([], [], color="black", lw=0.6, label="inside init_process_group"))
    handles.append(Line2D([], [], marker="|", ls="none", ms=10, mew=2, color="black",
                          label="init_process_group returns"))
    fig.legend(handles=handles, loc="outside lower center", ncols=2, fontsize=7, frameon=False)
    return Diagram(fig, _rendezvous_alt(panels, late, timeout_s))


def _rendezvous_alt(panels: Mapping[str, Sequence[Mapping[str, Any]]], late: Optional[int],
                    timeout_s: Optional[float]) -> str:
    parts = []
    for title, ranks in panels.items():
        failed = sorted({e["failed"] for r in ranks for e in r["log"] if e["failed"]})
        n = len(ranks)
        if failed:
            missing = sorted({address_owner(e["key"]) for r in ranks for e in r["log"] if e["failed"]} - {None})
            parts.append(f"{title}: {n} ranks started; each checks in and waits for the address of "
                         f"{ranks_text(missing) if missing else 'a missing rank'}, which never comes, until the "
                         f"{'timeout' if timeout_s is None else f'{timeout_s:g} s timeout'}, when "
                         f"init_process_group raises {', '.join(failed)}.")
        else:
            held = f" {ranks_text([late])} was held back before it connected, so the others wait for its address;" \
                if late is not None else ""
            parts.append(f"{title}: {n} ranks, one lane each under the store. Each connects to the store, checks "
                         "in by setting its own address key (an arrow to the store) and waits for every other "
                         f"rank's key;{held} then each adds 1 to the barrier's counter and waits for the last rank, "
                         "and all of them leave init_process_group together.")
    return "Timeline of the rendezvous, from the calls real ranks made on the store. " + " ".join(parts)
