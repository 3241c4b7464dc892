"""What every figure shares: the rank colours, the Diagram (a figure with its alt text) and its DPI,
the bucket colours, a moving average.

A Diagram shows as a PNG in Jupyter; its alt text travels with it, in the output's metadata
({"image/png": {"alt": ...}}, which the site's docs/_ext/figure_alt.py puts on the <img>) and as its
text/plain, what a reader without the image gets (and what nbval compares, so alt text says nothing
that varies by run).
"""
from __future__ import annotations

import io
from typing import Any, Dict, Tuple

import numpy as np
from matplotlib.figure import Figure


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
        buf = io.BytesIO()
        self.figure.savefig(buf, format="png", dpi=self.figure.dpi, bbox_inches="tight", metadata={"Software": None})
        return buf.getvalue()

    def _repr_png_(self) -> Tuple[bytes, Dict[str, str]]:
        return self.png(), {"alt": self.alt}

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.alt)

    def __repr__(self) -> str:
        return self.alt

    def savefig(self, *args: Any, **kwargs: Any) -> None:
        """Save the figure (matplotlib's Figure.savefig)."""
        self.figure.savefig(*args, **kwargs)


BUCKET_COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf",
                 "#7f7f7f")
