"""pytest plugin for make test's nbval runs: each kernel talks over Unix sockets (ipc), not TCP ports, and gets the
environment variables its notebook's folder asks for.

jupyter_client picks a kernel's five TCP ports by binding port 0 and closing the socket; the kernel binds them a
moment later. With two nbval workers starting kernels, and notebooks whose ranks take free ports the same way,
another process can take one in between: the kernel dies at start ("Kernel died before replying to
kernel_info", once in about ten notebook runs here). Sockets in files have no ports to race for. Each kernel's
files get a prefix of their own in the temp folder (jupyter_client's default would put them in the notebook's
folder, shared by both workers). Windows has no ipc transport: there the kernels keep TCP.

A folder holding KERNEL_ENV_FILE (a JSON object of names to strings) gives the kernels of its notebooks those
variables on top of pytest's environment (nbval starts each kernel in its notebook's folder). So one pytest
session runs some notebooks twice, once as they are and once as copies in such a folder: make test-notebooks'
other CPU kernels (tools/pip_user.py --again). Variables read once, when the kernel's torch starts
(ATEN_CPU_CAPABILITY, MKL_CBWR), reach only those kernels and the processes they start.

    pytest -p nbval_ipc --nbval ...      (with tools/ on sys.path)
"""
from __future__ import annotations

import json
import os
import tempfile
import uuid
from typing import Dict, Optional

KERNEL_ENV_FILE = "nbval_kernel_env.json"


def folder_env(folder: Optional[str]) -> Dict[str, str]:
    """The variables folder's KERNEL_ENV_FILE asks for ({} without one); a ValueError naming the file if malformed."""
    path = os.path.join(folder or os.getcwd(), KERNEL_ENV_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as fh:
        wanted = json.load(fh)
    if not isinstance(wanted, dict) or not all(isinstance(v, str) for v in wanted.values()):
        raise ValueError(f"{path}: expected a JSON object of variable names to strings, got {wanted!r}")
    return wanted


def pytest_configure(config) -> None:
    """Make nbval start its kernels with the ipc transport (not on Windows) and their folder's variables."""
    import nbval.kernel
    from jupyter_client.manager import KernelManager

    class NbvalKernelManager(KernelManager):
        def __init__(self, **kwargs):
            if os.name != "nt":
                prefix = os.path.join(tempfile.gettempdir(), f"nbval-{uuid.uuid4().hex[:12]}-ipc")
                kwargs = {"transport": "ipc", "ip": prefix, **kwargs}
            super().__init__(**kwargs)

        def start_kernel(self, **kw):
            extra = folder_env(kw.get("cwd"))
            if extra:  # kept in the launch arguments, so a restarted kernel gets them again
                kw["env"] = {**(kw.get("env") or os.environ), **extra}
            return super().start_kernel(**kw)

    nbval.kernel.KernelManager = NbvalKernelManager  # what nbval.kernel.start_new_kernel instantiates
