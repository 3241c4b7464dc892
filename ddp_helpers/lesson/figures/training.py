"""Training runs drawn: each rank's loss, gradient norms and weight fingerprints, loss curves on
two axes, losses against a reference run's, and local against synchronized gradients.

Built without pyplot, so a notebook shows each figure once (as the cell's value).
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence

import numpy as np
from matplotlib.colors import ListedColormap
from matplotlib.ticker import MaxNLocator

from ...engine.result import TrainResult
from .style import DPI, Plot, listed, moving_average, rank_color, ranks_text


def plot_losses(result: TrainResult, reference_loss: Optional[np.ndarray] = None, smooth: int = 1) -> Plot:
    """Each rank's loss per step (different data, so different curves), optionally with a one-process reference."""
    fig = Plot(figsize=(7, 3.6), dpi=150, layout="constrained")
    ax = fig.add_subplot()
    for r in result.ranks:
        y = moving_average(r.loss, smooth)
        ax.plot(r.step[len(r.step) - len(y):], y, color=rank_color(r.rank), lw=1.2, label=f"rank {r.rank}")
    if reference_loss is not None:
        y = moving_average(np.asarray(reference_loss), smooth)
        first = int(result.ranks[0].step[0]) if result.n_steps else 0
        ax.plot(np.arange(first, first + len(y)) + (len(reference_loss) - len(y)), y, color="black", lw=1.0,
                ls="--", label="one process, global batch")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy loss" + (f" ({smooth}-step mean)" if smooth > 1 else ""))
    ax.set_title(f"Per-rank loss ({result.dataset}, {result.world_size} ranks)")
    ax.legend(loc="upper right")
    ax.grid(alpha=0.3)
    mean = f", each point the mean of {smooth} steps" if smooth > 1 else ""
    reference = (" A dashed black line is one process training on the global batch, for comparison."
                 if reference_loss is not None else "")
    return fig.describe(
        f"Line chart of the cross-entropy loss at each of {result.n_steps} optimizer steps ({result.dataset}, "
        f"{result.world_size} ranks{mean}): one line per rank, {ranks_text([r.rank for r in result.ranks])}, "
        f"each computed on that rank's own shard of the data.{reference}")


def plot_grad_norms(result: TrainResult, max_steps: Optional[int] = None) -> Plot:
    """Local gradient norms differ by rank; after the all-reduce every rank holds the same gradient."""
    fig = Plot(figsize=(7, 3.6), dpi=150, layout="constrained")
    ax = fig.add_subplot()
    n = result.n_steps if max_steps is None else min(max_steps, result.n_steps)
    for r in result.ranks:
        ax.plot(r.step[:n], r.local_grad_norm[:n], color=rank_color(r.rank), lw=1.0, alpha=0.8,
                label=f"rank {r.rank}: local (before all-reduce)")
    for r in result.ranks:
        ax.plot(r.step[:n], r.synced_grad_norm[:n], color="black" if r.rank == 0 else rank_color(r.rank),
                lw=2.2 if r.rank == 0 else 1.0, ls="-" if r.rank == 0 else ":",
                label=f"rank {r.rank}: synced (after)")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("gradient L2 norm")
    ax.set_title("Local vs synchronized gradient norms")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    return fig.describe(
        f"Line chart of the gradient's L2 norm at each of {n} optimizer steps, {result.world_size} ranks: each "
        "rank's local norm before the all-reduce (thin coloured lines) and its synchronized norm after it (rank "
        f"0 thick black, the others dotted over it). {_norms_agree(result, n)}")


def _titled(title: Optional[str]) -> str:
    """A figure's title as the alt text's first sentence ('' without one)."""
    return f"{' '.join(title.split()).rstrip('.:')}. " if title else ""


def _norms_agree(result: TrainResult, n: int) -> str:
    """In words: whether the ranks' synchronized norms are equal at every step, and their local ones differ."""
    if len(result.ranks) < 2:
        return "With one rank, local and synchronized are the same gradient."
    first = result.ranks[0]
    synced = all(np.array_equal(r.synced_grad_norm[:n], first.synced_grad_norm[:n]) for r in result.ranks)
    local = any(not np.array_equal(r.local_grad_norm[:n], first.local_grad_norm[:n]) for r in result.ranks)
    return (("The synchronized norms are equal on every rank at every step, so their lines coincide"
             if synced else "The synchronized norms differ between ranks at some step")
            + ("; the local norms differ from rank to rank." if local else "; the local norms are equal too."))


def plot_fingerprints(result: TrainResult, max_steps: int = 10) -> Plot:
    """After every step each rank's parameter fingerprint, side by side: one value per column, a new one per step.

    Top: the first `max_steps` steps, each cell showing the rank's fingerprint (first 6 hex digits), green where
    it equals rank 0's. Bottom: over all steps, how many ranks hold parameters that differ from rank 0's (a
    sentence instead when none ever does).
    """
    n, w = min(max_steps, result.n_steps), result.world_size
    ref = result.ranks[0].param_fingerprint
    fig = Plot(figsize=(7.5, 1.9 + 0.42 * w), dpi=150, layout="constrained")
    ax, ax2 = fig.subplots(2, 1, height_ratios=[max(w, 1), 1.5])
    same = np.array([[r.param_fingerprint[i] == ref[i] for i in range(n)] for r in result.ranks], dtype=float)
    ax.imshow(same.reshape(w, n), cmap=ListedColormap(["#f4a6a6", "#c7e9c0"]), vmin=0, vmax=1, aspect="auto")
    for k, r in enumerate(result.ranks):
        for i in range(n):
            ax.text(i, k, r.param_fingerprint[i][:6], ha="center", va="center", fontsize=6.5, family="monospace")
    steps = result.ranks[0].step
    ax.set_xticks(range(n), [str(int(s)) for s in steps[:n]], fontsize=8)
    ax.set_yticks(range(w), [f"rank {r.rank}" for r in result.ranks])
    ax.set_xticks(np.arange(n + 1) - 0.5, minor=True)
    ax.set_yticks(np.arange(w + 1) - 0.5, minor=True)
    ax.grid(which="minor", color="white", lw=2)  # one cell per (rank, step)
    ax.tick_params(which="minor", length=0)
    ax.set_xlabel("step (green: the same fingerprint as rank 0, red: a different one)", fontsize=8)
    distinct = len(set(ref[:result.n_steps]))
    ax.set_title(f"Parameter fingerprint after each step (first {n}): equal down each column, "
                 f"{distinct} different values in {result.n_steps} steps", fontsize=9)
    differing = [sum(r.param_fingerprint[i] != ref[i] for r in result.ranks) for i in range(result.n_steps)]
    if not any(differing):  # a line at 0 says nothing a sentence doesn't: say it
        ax2.axis("off")
        ax2.text(0.5, 0.5, f"all {result.n_steps} steps: every rank's fingerprint equals rank 0's (no step differs)",
                 ha="center", va="center", fontsize=9, transform=ax2.transAxes)
        return fig.describe(_fingerprints_alt(n, result, 0))
    ax2.step(steps[:result.n_steps], differing, where="mid", color="black", lw=1.2)
    ax2.set_ylim(-0.3, max(w - 1, 1) + 0.3)
    ax2.set_yticks(range(max(w - 1, 1) + 1))
    ax2.set_ylabel("ranks that\ndiffer from\nrank 0", fontsize=8)
    ax2.set_xlabel(f"optimizer step (all {result.n_steps} steps)")
    ax2.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.grid(alpha=0.3)
    return fig.describe(_fingerprints_alt(n, result, sum(d > 0 for d in differing)))


def _fingerprints_alt(n: int, result: TrainResult, steps_differing: int) -> str:
    grid = (f"Grid of each rank's parameter fingerprint after each of the first {n} optimizer steps, one row per "
            f"rank ({ranks_text([r.rank for r in result.ranks])}), green where it equals rank 0's, red where not. ")
    if not steps_differing:
        return grid + (f"Every cell is green: after all {result.n_steps} steps every rank's parameters equal rank "
                       "0's, bit for bit.")
    return grid + (f"In {steps_differing} of {result.n_steps} steps at least one rank's parameters differ from rank "
                   "0's; a line below counts the ranks that differ at each step.")


def plot_captured_grads(result: TrainResult, step: int = 0, max_points: int = 2000) -> Plot:
    """Scatter of rank 0's vs rank 1's gradient entries at one step, before and after the all-reduce."""
    cap = result.captured_grads[step]
    return plot_gradient_pairs(cap["local"], cap["synced"], step, max_points)


def plot_gradient_pairs(local: np.ndarray, synced: np.ndarray, step: int = 0, max_points: int = 2000) -> Plot:
    """Scatter of rank 0's vs rank 1's gradient entries, before (local) and after (synced) the all-reduce; each
    array holds one row per rank."""
    local, synced = np.asarray(local), np.asarray(synced)
    fig = Plot(figsize=(7, 3.4), dpi=150, layout="constrained")
    a1, a2 = fig.subplots(1, 2, sharex=True, sharey=True)
    m = min(max_points, local.shape[1])
    sel = np.linspace(0, local.shape[1] - 1, m).astype(int)
    other = 1 if local.shape[0] > 1 else 0
    a1.scatter(local[0, sel], local[other, sel], s=4, color=rank_color(1))
    a1.set_title(f"step {step}: local gradients")
    a2.scatter(synced[0, sel], synced[other, sel], s=4, color="black")
    a2.set_title("after all-reduce")
    for a in (a1, a2):
        lo, hi = float(min(local.min(), synced.min())), float(max(local.max(), synced.max()))
        a.plot([lo, hi], [lo, hi], color="gray", lw=0.8, ls="--")
        a.set_xlabel("rank 0 entry")
    a1.set_ylabel(f"rank {other} entry")
    def where(pair: np.ndarray) -> str:
        return ("every point on the diagonal: both ranks hold the same values" if np.array_equal(pair[0], pair[other])
                else "points off the diagonal: the ranks' values differ")
    return fig.describe(
        f"Two scatter plots of {m} gradient entries at step {step}, rank 0's value across and rank {other}'s up, "
        f"with a dashed diagonal. Left, the local gradients before the all-reduce: {where(local)}. Right, after "
        f"the all-reduce: {where(synced)}.")


def plot_loss_curves(curves: Dict[str, dict], smooth: int = 1, title: Optional[str] = None) -> Plot:
    """Loss against optimizer steps (left) and samples seen (right); curves: label -> {"loss", "global_batch"}.

    A curve may also give "color" and "ls" (line style); smooth > 1 plots a running mean over that many steps.
    """
    if not curves:
        raise ValueError("plot_loss_curves needs at least one curve: {label: {'loss': [...], 'global_batch': B}}")
    for label, c in curves.items():
        missing = [k for k in ("loss", "global_batch") if k not in c]
        if missing:
            raise ValueError(f"plot_loss_curves: curve {label!r} has no {missing}; give each curve its per-step "
                             "'loss' list and its 'global_batch' (samples per optimizer step, all ranks together)")
    fig = Plot(figsize=(9, 3.4), layout="constrained", dpi=DPI)
    ax_steps, ax_samples = fig.subplots(1, 2, sharey=True)
    for i, (label, c) in enumerate(curves.items()):
        loss = moving_average(np.asarray(c["loss"], dtype=float), smooth)
        steps = np.arange(1, len(c["loss"]) + 1)[len(c["loss"]) - len(loss):]
        style = dict(color=c.get("color", rank_color(i)), ls=c.get("ls", "-"), lw=1.2,
                     label=label)
        ax_steps.plot(steps, loss, **style)
        ax_samples.plot(steps * int(c["global_batch"]), loss, **style)
    ylabel = "training loss" + (f" ({smooth}-step mean)" if smooth > 1 else "")
    ax_steps.set(xlabel="optimizer steps", ylabel=ylabel)
    ax_samples.set(xlabel="samples seen (steps x global batch)")
    ax_samples.legend(fontsize=8)
    for ax in (ax_steps, ax_samples):
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    runs = listed([f"{label} (global batch {int(c['global_batch'])}, {len(c['loss'])} steps)"
                   for label, c in curves.items()])
    mean = f", each point the mean of {smooth} steps" if smooth > 1 else ""
    return fig.describe(
        _titled(title) + f"Two line charts of the training loss{mean}, one line per run: "
        f"{runs}. Left, against optimizer steps; right, against samples seen (steps times the global batch).")


def plot_loss_gaps(losses: Dict[str, Sequence[float]], reference: str, title: Optional[str] = None) -> Plot:
    """Top: each run's (or rank's) loss per step (the reference on top, black dashed with markers); below: each
    other one's loss minus the reference's, per step.

    Runs that agree closely draw one line at the top; the lower panel shows how far apart they are (0: the
    same number at that step), so "close, not bitwise" can be seen. losses: label -> per-step losses.
    """
    if reference not in losses or len(losses) < 2:
        raise ValueError(f"plot_loss_gaps needs the reference run {reference!r} and at least one other: "
                         f"{{label: per-step losses}}, got {list(losses)}")
    ref = np.asarray(losses[reference], dtype=float)
    fig = Plot(figsize=(6.4, 6.4), layout="constrained", dpi=DPI)  # stacked: reads on a phone
    ax_loss, ax_gap = fig.subplots(2, 1, sharex=True)
    for i, (label, loss) in enumerate(losses.items()):
        loss = np.asarray(loss, dtype=float)
        steps = np.arange(len(loss))  # step 0 first, as the records number them
        if label == reference:  # drawn last and on top, black and dashed with markers: never hidden by the others
            ax_loss.plot(steps, loss, color="black", lw=1.6, ls="--", marker="o", markersize=3, zorder=5,
                         label=f"{label} (reference)")
            continue
        ax_loss.plot(steps, loss, color=rank_color(i), lw=1.2, label=label)
        n = min(len(loss), len(ref))
        ax_gap.plot(steps[:n], loss[:n] - ref[:n], color=rank_color(i), lw=1.2, marker="o", markersize=2.5,
                    label=f"{label} - {reference}")
    ax_gap.axhline(0.0, color="black", lw=1.2, ls="--", label=f"{reference} (0)", zorder=5)
    ax_loss.set(xlabel="step", ylabel="training loss")
    ax_gap.set(xlabel="step", ylabel=f"loss minus the {reference} loss")
    for ax in (ax_loss, ax_gap):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    others = [label for label in losses if label != reference]
    return fig.describe(
        _titled(title) + f"Two stacked line charts over {len(ref)} optimizer steps. Top, the "
        f"training loss per step of {listed(others)}, with the {reference} loss dashed black on top; below, each of "
        f"them minus the {reference} loss at each step, with zero dashed.")
