"""Run code in a real Jupyter kernel (ipykernel, as JupyterLab starts it) and collect what the cell showed."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]


def cell_outputs(code: str, timeout: float = 120.0, on_message: Optional[Callable[[dict], None]] = None,
                 **env: str) -> List[Dict[str, Any]]:
    """The iopub messages (msg_type plus content) the cell's execution sent, in order, in a fresh kernel;
    on_message sees each message as it arrives (to answer a program that waits for what the cell showed)."""
    from jupyter_client.manager import KernelManager

    km = KernelManager(kernel_name="python3")
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    km.start_kernel(cwd=str(ROOT), env={**os.environ, "PYTHONPATH": path, **env})
    kc = km.client()
    kc.start_channels()
    outputs: List[Dict[str, Any]] = []
    try:
        kc.wait_for_ready(timeout=60)
        def hook(msg: dict) -> None:
            outputs.append({"msg_type": msg["msg_type"], **msg["content"]})
            if on_message is not None:
                on_message(msg)

        reply = kc.execute_interactive(code, timeout=timeout, output_hook=hook)
        errors = [o for o in outputs if o["msg_type"] == "error"]
        assert reply["content"]["status"] == "ok", errors or reply["content"]
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    return [o for o in outputs if o["msg_type"] not in ("status", "execute_input")]
