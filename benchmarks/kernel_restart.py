"""How long a Jupyter kernel restart takes after launches, against kernels that never launched.

    python benchmarks/kernel_restart.py [--rounds 3] [--markdown]

Three kinds of kernel, restarted the way JupyterLab's restart does (a shutdown request, then a new kernel):
one that ran nothing, one that imported torch (as every notebook's set-up cell does), one that warmed up and
launched. Each row: the median time from the request to the new kernel's ready, and how the old kernel ended
(0 = by itself; a signal = Jupyter killed it after waiting). The launch's own cost is the difference between the
last two rows (torch's teardown in the kernel is the difference between the first two).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

KINDS = {
    "never ran a cell": None,
    "imported torch": "import torch, torch.distributed",
    "warmed up and launched": "import ddp_helpers\nddp_helpers.warm_up()\nddp_helpers.launch(lambda r, w: r, 2)",
}


def restart_once(code: str) -> tuple:
    """(seconds from the shutdown request to the new kernel's ready, the old kernel's exit status)."""
    from jupyter_client.manager import KernelManager

    km = KernelManager(kernel_name="python3")
    km.start_kernel(env={**os.environ, "DDP_HELPERS_PROGRESS": "0"})
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        if code:
            reply = kc.execute_interactive(code, timeout=300, output_hook=lambda msg: None)
            if reply["content"]["status"] != "ok":
                raise RuntimeError(f"the cell failed: {reply['content']}")
        old = km.provisioner.process
        t0 = time.monotonic()
        km.restart_kernel(now=False)
        kc.wait_for_ready(timeout=120)
        return time.monotonic() - t0, old.returncode
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def main(argv=None) -> int:
    """Print one row per kind of kernel."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=3, help="restarts of each kind (the median is printed)")
    p.add_argument("--markdown", action="store_true", help="a Markdown table")
    args = p.parse_args(argv)
    if args.rounds < 1:
        print("error: --rounds must be at least 1", file=sys.stderr)
        return 2
    rows = []
    for name, code in KINDS.items():
        runs = [restart_once(code) for _ in range(args.rounds)]
        rows.append((name, statistics.median(t for t, _ in runs), sorted({c for _, c in runs})))
    if args.markdown:
        print("| kernel | restart (median s) | old kernel's exit |\n|---|---|---|")
        for name, t, codes in rows:
            print(f"| {name} | {t:.2f} | {', '.join(map(str, codes))} |")
    else:
        for name, t, codes in rows:
            print(f"{name:26s} {t:6.2f} s   exit {codes}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
