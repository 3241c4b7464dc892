"""pytest plugin for make test's nbval runs: each kernel talks over Unix sockets (ipc), not TCP ports.

jupyter_client picks a kernel's five TCP ports by binding port 0 and closing the socket; the kernel binds them a
moment later. With two nbval workers starting kernels, and notebooks whose ranks take free ports the same way,
another process can take one in between: the kernel dies at start ("Kernel died before replying to
kernel_info", once in about ten notebook runs here). Sockets in files have no ports to race for. Each kernel's
files get a prefix of their own in the temp folder (jupyter_client's default would put them in the notebook's
folder, shared by both workers). Windows has no ipc transport: there the plugin changes nothing.

    pytest -p nbval_ipc --nbval ...      (with tools/ on sys.path)
"""
from __future__ import annotations

import os
import tempfile
import uuid


def pytest_configure(config) -> None:
    """Make nbval start its kernels with the ipc transport."""
    if os.name == "nt":
        return
    import nbval.kernel
    from jupyter_client.manager import KernelManager

    class IpcKernelManager(KernelManager):
        def __init__(self, **kwargs):
            prefix = os.path.join(tempfile.gettempdir(), f"nbval-{uuid.uuid4().hex[:12]}-ipc")
            super().__init__(**{"transport": "ipc", "ip": prefix, **kwargs})

    nbval.kernel.KernelManager = IpcKernelManager  # what nbval.kernel.start_new_kernel instantiates
