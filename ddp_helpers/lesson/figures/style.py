"""What every figure shares: the rank colours, the Diagram (a figure with its alt text) and its DPI,
the Plot (a matplotlib Figure with its alt text), the bucket colours, a moving average.

A Diagram or a Plot shows as a PNG in Jupyter; its alt text travels with it, in the output's metadata
({"image/png": {"alt": ...}}, which the site's docs/_ext/figure_alt.py puts on the <img>) and as its
text/plain, what a reader without the image gets (and what nbval compares, so alt text says nothing
that varies by run: no timing, no float that the CPU's kernels could move).
"""
from __future__ import annotations

import io
from typing import Any, Dict, Sequence, Tuple

import numpy as np
from matplotlib.figure import Figure

from ...common.errors import listed, ranks_text  # noqa: F401 - the figures' words for lists


RANK_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f")


def rank_color(rank: int) -> str:
    """The colour of a rank, the same in every figure."""
    return RANK_COLORS[rank % len(RANK_COLORS)]


def moving_average(y: np.ndarray, window: int) -> np.ndarray:
    """A moving average over `window` points (the curve unchanged when it is shorter)."""
    if window <= 1 or len(y) < window:
        return y
    kernel = np.ones(window) / window
    return np.convolve(y, kernel, mode="valid")


DPI = 150


class Diagram:
    """A drawn figure and its alt text: Jupyter shows the PNG, the alt text goes with it."""

    def __init__(self, figure: Figure, alt: str):
        if not alt or not alt.strip():
            raise ValueError("a Diagram needs alt text: one or two sentences saying what the figure shows")
        self.figure, self.alt = figure, " ".join(alt.split())

    def png(self) -> bytes:
        """The figure as PNG bytes (no software version inside, so an unchanged figure gives the same bytes)."""
        return figure_png(self.figure)

    def _repr_png_(self) -> Tuple[bytes, Dict[str, str]]:
        return self.png(), {"alt": self.alt}

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.alt)

    def __repr__(self) -> str:
        return self.alt

    def savefig(self, *args: Any, **kwargs: Any) -> None:
        """Save the figure (matplotlib's Figure.savefig)."""
        self.figure.savefig(*args, **kwargs)


def figure_png(figure: Figure) -> bytes:
    """A figure as PNG bytes at its own DPI, cropped to what is drawn, with no software version inside."""
    buf = io.BytesIO()
    figure.savefig(buf, format="png", dpi=figure.dpi, bbox_inches="tight", metadata={"Software": None})
    return buf.getvalue()


class Plot(Figure):
    """A matplotlib Figure that says what it shows: the package's plot functions return one, described by
    `describe(alt)`. Still a Figure (its axes, savefig); in Jupyter its PNG goes with the alt text, as a Diagram's.
    """

    alt = ""

    def describe(self, alt: str) -> "Plot":
        """Set the alt text (one to three sentences: the chart, its axes and series, what it shows); self."""
        if not alt or not alt.strip():
            raise ValueError("a Plot needs alt text: one to three sentences saying what the figure shows")
        self.alt = " ".join(alt.split())
        return self

    def _repr_mimebundle_(self, include: Any = None, exclude: Any = None) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        # IPython's inline backend may draw the PNG itself (its Figure formatter outranks a bundle's PNG); the
        # metadata and the text/plain given here stay either way.
        return {"image/png": figure_png(self), "text/plain": self.alt}, {"image/png": {"alt": self.alt}}


BUCKET_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
                 "#7f7f7f")
