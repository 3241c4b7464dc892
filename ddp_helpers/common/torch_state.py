"""A torch whose import was interrupted (Ctrl-C during a cold kernel's own `import torch`) can't be imported again
in that process: Python drops `torch` from sys.modules but keeps the submodules and the C extension it had loaded,
and a second import fails with errors such as "partially initialized module 'torch'" or "cannot initialize type".
Said once, clearly: only a restart of the kernel helps. Standard library only."""
from __future__ import annotations

import sys
from types import ModuleType
from typing import List

from .errors import one_line

RESTART = ("torch's import was interrupted in this process (Ctrl-C or the stop button while `import torch` ran), "
           "and Python can't import torch again here: restart the kernel (Kernel > Restart Kernel), then run the "
           "cells again")


class TorchImportBroken(ImportError):
    """torch was half imported in this process; only a new process (a kernel restart) can import it. In a
    notebook it shows as its one line (IPython honours _render_traceback_), not as torch's traceback."""

    def _render_traceback_(self) -> List[str]:
        return [f"TorchImportBroken: {self}"]


def half_imported() -> bool:
    """True when torch's submodules are loaded but torch itself is not: an import of it that didn't finish."""
    return "torch" not in sys.modules and any(name.startswith("torch.") for name in sys.modules)


def broken_message(e: BaseException) -> str:
    """The one-line message, ending with what the failed import raised."""
    return one_line(f"{RESTART} ({type(e).__name__}: {str(e)[:200]})")


def import_torch() -> ModuleType:
    """torch, or TorchImportBroken saying to restart the kernel when an interrupted import left it broken."""
    broken = half_imported()
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - a second import fails with RuntimeError, AttributeError, ValueError...
        if broken:
            raise TorchImportBroken(broken_message(e)) from None
        raise
    return torch
