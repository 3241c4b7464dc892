"""A notebook cell named as IPython names it ("Cell In[3], line 5"), in what a rank printed or raised.

A function defined in a cell reaches a rank with its code's file name, the one the kernel gave the cell
(ipykernel: /tmp/ipykernel_<pid>/<hash>.py; see payload.dumps). Only the kernel knows which cell that is
(IPython.core.compilerop.CachingCompiler.format_code_name) and holds its source (linecache): the ranks, started
from a clean server, have neither. So the launching process rewrites what a rank said. Standard library only.
"""
from __future__ import annotations

import linecache
import re
import sys
from typing import List, Optional

_FRAME = re.compile(r'^(?P<indent>\s*)File "(?P<file>[^"]+)", line (?P<line>\d+)(?P<rest>.*)$')
_WARNING = re.compile(r'^(?P<file>(?:[A-Za-z]:)?[^:]+\.py):(?P<line>\d+): ')  # warnings.formatwarning's first line


def cell_label(filename: str) -> Optional[str]:
    """'Cell In[3]' for a file name this IPython kernel gave one of its cells; else None."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    name = getattr(getattr(shell, "compile", None), "format_code_name", None)
    if name is None:
        return None
    try:
        found = name(filename)
    except Exception:  # noqa: BLE001 - an IPython whose compiler differs: the file name stays
        return None
    return f"{found[0]} {found[1]}" if found else None


def name_cells(text: str) -> str:
    """text (a traceback, or a line a rank printed) with each cell's file name given as IPython gives it, and
    each traceback frame in a cell followed by the cell's line, read from this kernel."""
    if "/" not in text and "\\" not in text and "<" not in text:
        return text  # no file name in it (most printed lines)
    out: List[str] = []
    lines = text.split("\n")
    for i, line in enumerate(lines):
        frame = _FRAME.match(line)
        label = cell_label(frame["file"]) if frame else None
        if frame and label:
            out.append(f"{frame['indent']}{label}, line {frame['line']}{frame['rest']}")
            source = linecache.getline(frame["file"], int(frame["line"])).strip()
            following = lines[i + 1] if i + 1 < len(lines) else ""
            if source and following.strip() != source:  # a rank without the cell's source printed none
                out.append(f"{frame['indent']}  {source}")
            continue
        warning = _WARNING.match(line)
        label = cell_label(warning["file"]) if warning else None
        out.append(f"{label}, line {warning['line']}: {line[warning.end():]}" if label else line)
    return "\n".join(out)
