"""How a check's verdict is shown: in Jupyter a coloured, bold verdict and a hint that wraps between words;
elsewhere (a terminal, a script, pytest) the plain line.

JupyterLab shows a printed line in a <pre> that breaks anywhere (`word-break: break-all`), in the middle of a
word once the window is narrow. An HTML output is laid out as prose instead: it wraps at spaces, and only a
word longer than the whole line (a path) is broken. The text/plain beside it is the printed line, so a
notebook's stored output reads the same in a terminal, a diff and nbval.
"""
from __future__ import annotations

import html
import sys
from typing import Dict

_COLORS: Dict[str, str] = {"PASS": "#1a7f37", "TRY AGAIN": "#b42318", "NOT DONE YET": "#9a6700"}
_BOX = ("border-left: 4px solid {color}; padding: 0.3em 0.8em; margin: 0.2em 0; white-space: normal; "
        "word-break: normal; overflow-wrap: break-word; line-height: 1.5; max-width: 100ch")
_WORD = "color: {color}; font-weight: 700; font-size: 1.2em; margin-right: 0.5em"


class VerdictView:
    """One verdict for IPython's display: HTML in Jupyter, the printed line as its plain text."""

    def __init__(self, verdict: str, exercise: str, hint: str):
        self.verdict, self.exercise, self.hint = verdict, exercise, hint

    def __repr__(self) -> str:
        return f"{self.verdict}  {self.exercise}: {self.hint}"

    def _repr_html_(self) -> str:
        color = _COLORS.get(self.verdict, "#444444")
        return (f'<div class="ddp-verdict" style="{_BOX.format(color=color)}">'
                f'<span class="ddp-verdict-word" style="{_WORD.format(color=color)}">{html.escape(self.verdict)}'
                f'</span> {html.escape(self.exercise)}: {html.escape(self.hint)}</div>')


def in_ipython() -> bool:
    """True inside IPython (a Jupyter kernel, nbgrader's autograder): there display() chooses the form."""
    ipython = sys.modules.get("IPython")  # never imported here: a plain script or pytest stays on print
    return ipython is not None and ipython.get_ipython() is not None


def show(view: VerdictView) -> None:
    """Display the verdict in IPython, print its plain line anywhere else."""
    if in_ipython():
        from IPython.display import display

        display(view)
    else:
        print(repr(view))
