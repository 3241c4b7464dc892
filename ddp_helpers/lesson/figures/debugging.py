"""Reading a broken or restarted job, drawn from its records (notebook 12): the collectives two ranks paired after
one skipped a step (their flight recorders), and a torchrun job's attempts on one step axis.

Built without pyplot, so a notebook shows each figure once (as the cell's value).
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch, Rectangle

from .style import DPI, Diagram, listed, rank_color, ranks_text

BUILT = -1  # the column of DDP(...)'s own collectives, before step 0
KINDS = {"built": dict(facecolor="#d9d9d9", edgecolor="#7f7f7f"),
         "grads": dict(facecolor="#aec7e8", edgecolor="#1f77b4"),
         "other": dict(facecolor="#ffdca8", edgecolor="#ff7f0e")}
SLIPPED, PAIRED, FAILED = "#d62728", "#555555", "#d62728"
LANE, BOX = 1.9, 0.8  # lanes apart, a box's height: room for the pair lines between lanes
Placed = List[Tuple[int, Dict[str, Any]]]  # (step, or BUILT, and the flight recorder's entry), in issue order
Rows = Sequence[Tuple[int, int, List[int]]]  # (attempt, rank, the steps it trained), top row first


def _op(entry: Mapping[str, Any]) -> str:
    """'gloo:all_reduce' -> 'all_reduce'."""
    return str(entry["op"]).rsplit(":", 1)[-1]


def collectives_by_step(entries: Sequence[Mapping[str, Any]], steps: Sequence[int]) -> Placed:
    """Each entry with the step that issued it: the first entries, from the line of the first, before any
    all_reduce, are DDP(...)'s own (BUILT); then each all_reduce (a step's gradients) ends the step steps[k],
    and the collectives since the one before are that step's too (its forward's)."""
    ends = [i for i, e in enumerate(entries) if _op(e) == "all_reduce"]
    if len(ends) != len(steps) or (ends and ends[-1] != len(entries) - 1):
        raise ValueError(f"collectives_by_step: {len(ends)} all_reduce(s) among {len(entries)} entries, the last "
                         f"at {ends[-1:]}, for {len(steps)} steps {list(steps)}: give the steps this rank ran, "
                         "one all_reduce each, and its recorder's entries of the default group")
    built = 0
    while built < len(entries) and _op(entries[built]) != "all_reduce" and \
            entries[built].get("where") == entries[0].get("where"):
        built += 1
    placed: Placed = []
    for i, entry in enumerate(entries):
        k = sum(end < i for end in ends)
        placed.append((BUILT if i < built else steps[k], dict(entry)))
    return placed


def _kind(step: int, entry: Mapping[str, Any]) -> str:
    """Which of KINDS a placed entry is."""
    return "built" if step == BUILT else "grads" if _op(entry) == "all_reduce" else "other"


def _columns(placed: Sequence[Placed], steps_run: Sequence[Sequence[int]]) -> Dict[int, Tuple[float, int]]:
    """Each column (BUILT, then every step) -> (its left x, its slots: the most collectives one rank issued there)."""
    columns, x = {}, 0.0
    for c in [BUILT] + sorted({s for steps in steps_run for s in steps}):
        slots = max(1, max(sum(s == c for s, _ in p) for p in placed))
        columns[c], x = (x, slots), x + slots + 0.6
    return columns


def _draw_lane(ax: Axes, rank: int, placed: Placed, columns: Dict[int, Tuple[float, int]], y: float,
               steps: Sequence[int]) -> Dict[int, Tuple[int, float]]:
    """One rank's boxes and its skipped steps; each sequence number -> (its step, its box's centre x)."""
    at, used = {}, {c: 0 for c in columns}
    for step, entry in placed:
        x = columns[step][0] + used[step]
        used[step] += 1
        box = Rectangle((x + 0.07, y - BOX / 2), 0.86, BOX, lw=0.8, gid=f"rank {rank} #{entry['seq']}",
                        **KINDS[_kind(step, entry)])
        ax.add_patch(box)
        ax.text(x + 0.5, y, f"#{entry['seq']}\n{_op(entry)}", ha="center", va="center", fontsize=5.5)
        at[entry["seq"]] = (step, x + 0.5)
    for c in sorted(set(columns) - {BUILT} - set(steps)):
        ax.add_patch(Rectangle((columns[c][0] + 0.07, y - BOX / 2), 0.86, BOX, facecolor="none", edgecolor=SLIPPED,
                               ls="--", lw=1, gid=f"rank {rank} skipped step {c}"))
        ax.text(columns[c][0] + 0.5, y, f"step {c}\nskipped", ha="center", va="center", fontsize=5.5, color=SLIPPED)
    return at


def _draw_pairs(ax: Axes, at: Sequence[Dict[int, Tuple[int, float]]], ys: Sequence[float]) -> None:
    """A line between neighbouring lanes for each sequence number both ranks issued: red where the steps differ."""
    for r in range(len(at) - 1):
        for seq in sorted(set(at[r]) & set(at[r + 1])):
            (s0, x0), (s1, x1) = at[r][seq], at[r + 1][seq]
            ax.plot([x0, x1], [ys[r] - BOX / 2, ys[r + 1] + BOX / 2], color=SLIPPED if s0 != s1 else PAIRED,
                    lw=1.6 if s0 != s1 else 0.9, gid=f"pair #{seq} ranks {r}-{r + 1}")


def _draw_unmatched(ax: Axes, at: Sequence[Dict[int, Tuple[int, float]]], ys: Sequence[float],
                    ended: Optional[str]) -> Dict[int, List[int]]:
    """The collectives some rank issued that not every rank did, outlined and said: seq -> the ranks that did."""
    every = set.intersection(*(set(a) for a in at))
    lone = {seq: [r for r in range(len(at)) if seq in at[r]] for seq in sorted(set().union(*at) - every)}
    for seq, holders in lone.items():
        for r in holders:
            ax.add_patch(Rectangle((at[r][seq][1] - 0.5, ys[r] - BOX / 2 - 0.08), 1, BOX + 0.16, facecolor="none",
                                   edgecolor=SLIPPED, lw=2.2, gid=f"unmatched rank {r} #{seq}"))
        r = holders[0]
        missing = [q for q in range(len(at)) if q not in holders]
        who = "nobody joins" if len(holders) == 1 else f"{ranks_text(missing)} never join{'s' * (len(missing) == 1)}"
        said = f"#{seq}: {who} it" + (f"; it ends with '{ended}'" if ended else "")
        ax.text(at[r][seq][1] + 0.5, ys[r] + (0.5 if r == 0 else -0.5), said, ha="right",
                va="bottom" if r == 0 else "top", fontsize=6.5, color=SLIPPED)
    return lone


def draw_desync(records: Sequence[Mapping[str, Any]], steps_run: Sequence[Sequence[int]],
                ended: Optional[str] = None) -> Diagram:
    """Each rank's collectives from its flight recorder (records[rank]: lesson.read_flight_recorder's dict), placed
    by the step that issued them (steps_run[rank]: the steps that rank ran), a line joining the ones gloo paired
    (the same sequence number); ended: what became of a collective nobody joined, said beside it."""
    if len(records) < 2 or len(records) != len(steps_run):
        raise ValueError(f"draw_desync needs one flight recorder record per rank (2 or more) and the steps each ran; "
                         f"got {len(records)} records and {len(steps_run)} step lists")
    placed = [collectives_by_step([e for e in rec["entries"] if str(e.get("group", "0")) == "0"], steps)
              for rec, steps in zip(records, steps_run)]
    columns = _columns(placed, steps_run)
    width = max(x + n for x, n in columns.values())
    ys = [(len(records) - 1 - r) * LANE for r in range(len(records))]
    fig = Figure(figsize=(max(6.5, 0.55 * width + 1.2), 1.6 + 0.9 * len(records)), layout="constrained", dpi=DPI)
    ax = fig.add_subplot()
    at = [_draw_lane(ax, r, p, columns, y, steps) for r, (p, y, steps) in enumerate(zip(placed, ys, steps_run))]
    _draw_pairs(ax, at, ys)
    lone = _draw_unmatched(ax, at, ys, ended)
    ax.set_xticks([x + n / 2 for x, n in columns.values()],
                  ["DDP(...)" if c == BUILT else f"step {c}" for c in columns], fontsize=7)
    ax.set_yticks(ys, [f"rank {r}" for r in range(len(records))], fontsize=8)
    ax.set_xlim(-0.3, width + 0.3)
    ax.set_ylim(-0.95, ys[0] + 0.95)
    for side in ("top", "right", "left"):
        ax.spines[side].set_visible(False)
    ax.tick_params(axis="y", length=0)
    fig.legend(handles=_desync_legend(placed), loc="outside lower center", ncols=2, fontsize=6.5, frameon=False)
    return Diagram(fig, _desync_alt(placed, steps_run, at, lone, ended))


def _desync_legend(placed: Sequence[Placed]) -> List[Any]:
    """The kinds of box drawn (another collective named by the torch function that issued it), the lines."""
    bys = sorted({str(e.get("by", "?")) for p in placed for s, e in p if _kind(s, e) == "other"})
    words = {"built": "DDP(...)'s own, as it was built", "grads": "a step's all-reduce of the gradients",
             "other": f"another collective of a step (by {listed(bys or ['?'])})"}
    used = {_kind(s, e) for p in placed for s, e in p}
    return ([Patch(label=words[k], **KINDS[k]) for k in KINDS if k in used]
            + [Line2D([], [], color=PAIRED, lw=0.9, label="paired by gloo (same sequence number), same step"),
               Line2D([], [], color=SLIPPED, lw=1.6, label="paired by gloo, but different steps"),
               Patch(facecolor="none", edgecolor=SLIPPED, lw=2.2, label="issued by one rank only: nobody joins"
                     if len(placed) == 2 else "not issued by every rank: it never completes")])


def _desync_alt(placed: Sequence[Placed], steps_run: Sequence[Sequence[int]],
                at: Sequence[Dict[int, Tuple[int, float]]], lone: Mapping[int, List[int]],
                ended: Optional[str]) -> str:
    """The figure in words: the steps skipped, the pairs that slipped, the collectives nobody joined."""
    every = sorted({s for steps in steps_run for s in steps})
    skipped = [f"rank {r} skipped step{'s' * (len(m) > 1)} {listed([str(s) for s in m])}"
               for r, steps in enumerate(steps_run) if (m := [s for s in every if s not in steps])]
    slipped = [(seq, r, at[0][seq][0], at[r][seq][0]) for r in range(1, len(at))
               for seq in sorted(set(at[0]) & set(at[r])) if at[0][seq][0] != at[r][seq][0]]
    pairs = (f"from #{min(slipped)[0]} on the pairs slip: " + "; ".join(
        f"rank 0's #{seq} of step {a} meets rank {r}'s #{seq} of step {b}" for seq, r, a, b in slipped)
        + " (gradients of different steps averaged)") if slipped else "every pair is of one step"
    alone = "; ".join(f"{ranks_text(h)}'s #{seq} (step {at[h[0]][seq][0]}) " + _never_joined(h, len(at))
                      for seq, h in lone.items())
    n_built = sum(s == BUILT for s, _ in placed[0])
    end = "Every collective is paired."
    if lone:
        end = _upper(alone) + (f", and the job ends: {ended}." if ended else ".")
    return (f"The collectives of {ranks_text(range(len(placed)))} from their flight recorders, one lane per rank, "
            f"placed by the training step that issued them, after the {n_built} of DDP(...) as it was built; a line "
            "joins the collectives gloo paired, those with the same sequence number. "
            + (_upper(listed(skipped)) + ": " if skipped else "") + pairs + ". "
            + end)


def _never_joined(holders: Sequence[int], world: int) -> str:
    """'has no partner' (one rank issued it), or 'is never joined by rank 2'."""
    missing = [q for q in range(world) if q not in holders]
    return "has no partner" if len(holders) == 1 else f"is never joined by {ranks_text(missing)}"


def _upper(text: str) -> str:
    """The text with its first letter a capital."""
    return text[:1].upper() + text[1:]


_FAILED = re.compile(r"failed \(exitcode: (?P<code>-?\d+)\) local_rank: (?P<rank>\d+)")
_CHECKPOINT = re.compile(r"ckpt-(\d+)\.pt")  # engine/checkpoint.py's checkpoint_path: the state after N steps


def attempt_failures(events: Sequence[str]) -> List[List[Tuple[int, int]]]:
    """Per attempt of a one-node torchrun job (its agent's events, lesson.agent_events: each attempt starts at
    its restart_count=N), the (local rank, exit code) of each worker the agent saw fail."""
    attempts: List[List[Tuple[int, int]]] = []
    for line in events:
        if re.fullmatch(r"restart_count=\d+", line.strip()):
            attempts.append([])
        elif (m := _FAILED.search(line)) and attempts:
            attempts[-1].append((int(m["rank"]), int(m["code"])))
    return attempts


def _runs(steps: Sequence[int]) -> List[Tuple[int, int]]:
    """Consecutive steps as (first, count) runs: [3, 4, 5, 9] -> [(3, 3), (9, 1)]."""
    runs: List[Tuple[int, int]] = []
    for s in sorted(int(s) for s in steps):
        if runs and s == runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((s, 1))
    return runs


def _spans(steps: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2 and 5'."""
    return listed([f"{a}-{a + n - 1}" if n > 1 else str(a) for a, n in _runs(steps)]) if len(steps) else "none"


def draw_restarts(attempts: Sequence[Any], checkpoints: Sequence[str], events: Sequence[str]) -> Diagram:
    """A torchrun job's attempts on one step axis, one row per (attempt, rank): the steps each trained (attempts[a]:
    a TrainResult, .ranks[r].step), the checkpoints written (file names ckpt-N.pt), each failure and the agent's
    stop of the other ranks (the agent's events, lesson.agent_events), and where each restart resumed."""
    failed = attempt_failures(events)
    if len(failed) != len(attempts):
        raise ValueError(f"draw_restarts: the agent's events start {len(failed)} attempt(s) (restart_count=N lines), "
                         f"but {len(attempts)} attempts' records were given: pass lesson.agent_events(the agent's "
                         "log) and one TrainResult per attempt, in order")
    saved = sorted(int(m[1]) for name in checkpoints if (m := _CHECKPOINT.fullmatch(str(name).rsplit("/", 1)[-1])))
    rows = [(a, int(r.rank), [int(s) for s in r.step]) for a, res in enumerate(attempts) for r in res.ranks]
    last = max((s for _, _, steps in rows for s in steps), default=0) + 1
    fig = Figure(figsize=(8, 1.3 + 0.42 * len(rows)), layout="constrained", dpi=DPI)
    ax = fig.add_subplot()
    y = {(a, r): len(rows) - 1 - i for i, (a, r, _) in enumerate(rows)}
    for a, r, steps in rows:
        before = {s for b, q, st in rows if b < a and q == r for s in st}
        _draw_row(ax, a, r, steps, before, y[a, r])
    words = [_attempt_events(ax, a, rows, failed[a], saved, y) for a in range(len(attempts))]
    ax.set_yticks(list(y.values()), [f"attempt {a}, rank {r}" for a, r in y], fontsize=7)
    for a in range(1, len(attempts)):
        ax.axhline(max(v for (b, _), v in y.items() if b == a) + 0.5, color="black", lw=0.6)
    ax.set_ylim(-0.7, len(rows) - 0.2)
    ax.set_xlim(0, last + 4)
    ax.set_xlabel("optimizer step (a checkpoint at N holds the state after N steps)", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ranks = sorted({r for _, r, _ in rows})
    fig.legend(handles=_restart_legend(ranks), loc="outside lower center", ncols=3, fontsize=6.5, frameon=False)
    return Diagram(fig, "A torchrun job's attempts on one step axis, one row per attempt and rank: the steps each "
                        "rank trained, the checkpoints rank 0 wrote, the failure and the agent's restart. "
                   + " ".join(words))


def _draw_row(ax: Axes, attempt: int, rank: int, steps: Sequence[int], before: set, y: float) -> None:
    """One rank's trained steps in one attempt as bars, those an earlier attempt had trained hatched."""
    ax.broken_barh(_runs(steps), (y - 0.3, 0.6), color=rank_color(rank), alpha=0.85,
                   gid=f"trained attempt {attempt} rank {rank}")
    redone = [s for s in steps if s in before]
    if redone:
        ax.broken_barh(_runs(redone), (y - 0.3, 0.6), facecolor="none", edgecolor="black", hatch="////", lw=0,
                       gid=f"redone attempt {attempt} rank {rank}")


def _attempt_events(ax: Axes, a: int, rows: Rows, failures: Sequence[Tuple[int, int]], saved: Sequence[int],
                    y: Dict[Tuple[int, int], int]) -> str:
    """Draw an attempt's resume point, checkpoints, failures and stops; say them."""
    mine = {r: steps for b, r, steps in rows if b == a}
    pad = 0.5 + 0.02 * max((s for _, _, steps in rows for s in steps), default=0)  # a label's gap, in steps
    said = [_draw_resume(ax, a, mine, saved, y[a, min(mine)], pad) + _trained_words(mine)]
    # rank 0 writes ckpt-N after step N - 1: the last attempt that trained that step wrote the file listed
    later = {s for b, r, steps in rows if b > a and r == 0 for s in steps}
    wrote = [n for n in saved if n - 1 in mine.get(0, []) and n - 1 not in later]
    if wrote:
        ax.plot(wrote, [y[a, 0]] * len(wrote), ls="none", marker="D", ms=5, color="white", mec="black",
                gid=f"checkpoints attempt {a}")
        said.append(f"rank 0 writes checkpoints after {listed([str(n) for n in wrote])} steps")
    return "; ".join(said + _draw_ends(ax, a, mine, failures, y, pad)) + "."


def _draw_resume(ax: Axes, a: int, mine: Mapping[int, Sequence[int]], saved: Sequence[int], top: float,
                 pad: float) -> str:
    """A restarted attempt's first step, marked and labelled with the checkpoint it loads; the sentence's start."""
    trained = sorted({s for steps in mine.values() for s in steps})
    if not a or not trained:
        return f"Attempt {a}: "
    start = trained[0]
    ax.axvline(start, color="black", lw=0.8, ls=":", gid=f"resume attempt {a}")
    # a restart past step 0 loaded ckpt-<start>, listed or since pruned (checkpoint_keep)
    gone = "" if start in saved else " (since removed)"
    done = f"loads ckpt-{start:07d}.pt{gone}" if start else "finds no checkpoint"
    then = f"{'resumes' if start else 'starts'} at step {start}"
    if start >= 0.3 * (trained[-1] + 1):  # room on the left: the label points at the start
        ax.annotate(f"attempt {a} {done}:\n{then}", xy=(start, top), xytext=(start - 2, top), ha="right",
                    va="center", fontsize=6.5, arrowprops=dict(arrowstyle="-|>", color="black", lw=0.8))
    else:
        ax.text(trained[-1] + 1 + pad, top, f"attempt {a} {done}: {then}", va="center", fontsize=6.5)
    return f"Attempt {a} {done} and {then}: "


def _draw_ends(ax: Axes, a: int, mine: Mapping[int, Sequence[int]], failures: Sequence[Tuple[int, int]],
               y: Dict[Tuple[int, int], int], pad: float) -> List[str]:
    """The ranks that failed in an attempt (a cross) and those the agent stopped then (a square), said."""
    said = []
    for rank, code in failures:
        at = max(mine.get(rank) or [-1]) + 1  # the step it was in: the one after its last recorded
        ax.plot([at + 0.5], [y[a, rank]], marker="X", ms=10, color=FAILED, ls="none", gid=f"failed attempt {a}")
        ax.text(at + 0.5 + pad, y[a, rank], f"rank {rank} fails at step {at} (exit code {code})", va="center",
                fontsize=6.5, color=FAILED)
        said.append(f"rank {rank} fails at step {at}")
    for rank in sorted(set(mine) - {r for r, _ in failures}) if failures else []:
        at = max(mine[rank] or [-1]) + 1
        ax.plot([at + 0.5], [y[a, rank]], marker="s", ms=6, color="black", ls="none", gid=f"stopped attempt {a}")
        ax.text(at + 0.5 + pad, y[a, rank], f"stopped by the agent at step {at}", va="center", fontsize=6.5)
        said.append(f"the agent stops rank {rank} at step {at}")
    return said


def _trained_words(mine: Mapping[int, Sequence[int]]) -> str:
    """'ranks 0 and 1 train steps 0-39', or each rank's steps where they differ."""
    spans = {r: _spans(steps) for r, steps in sorted(mine.items())}
    if len(set(spans.values())) == 1:
        return f"{ranks_text(list(spans))} train steps {next(iter(spans.values()))}"
    return ", ".join(f"rank {r} trains steps {s}" for r, s in spans.items())


def _restart_legend(ranks: Sequence[int]) -> List[Any]:
    """The bars of each rank, the hatching, and the markers."""
    return [*(Patch(color=rank_color(r), alpha=0.85, label=f"steps rank {r} trained") for r in ranks),
            Patch(facecolor="none", edgecolor="black", hatch="////", label="trained again after the restart"),
            Line2D([], [], ls="none", marker="D", color="white", mec="black", label="checkpoint written by rank 0"),
            Line2D([], [], ls="none", marker="X", ms=8, color=FAILED, label="a rank fails"),
            Line2D([], [], ls="none", marker="s", color="black", label="the agent stops the other ranks")]
