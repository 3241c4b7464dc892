"""Process hygiene shared by launched ranks and their DataLoader workers."""
from __future__ import annotations

import signal


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies, so no worker outlives a crashed launcher."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the launcher's own cleanup still applies
        pass
