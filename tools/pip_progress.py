"""make env's pip, without silent minutes: say what it will download and roughly how much, then show each package
as pip fetches it and, when pip says nothing for a minute, one line that it is still going (everything also goes
to the log). Usage: python tools/pip_progress.py LOG -- PIP_ARGS..."""
from __future__ import annotations

import importlib.metadata
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import List, Optional

HEARTBEAT_S = 60.0  # the longest the terminal stays silent
SHOWN = ("Collecting ", "Downloading ", "Installing collected", "Successfully installed", "ERROR")


def installed_torch() -> Optional[str]:
    """The torch already in this interpreter's environment (kept when it satisfies the pins), else None."""
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def torch_estimate(torch: Optional[str], system: str, machine: str) -> str:
    """What installing torch will cost here, in words: PyPI's Linux x86_64 torch is the CUDA build."""
    if torch is not None:
        return f"torch {torch} is already installed (kept when it satisfies the pins given to pip)"
    if system == "Linux" and machine in ("x86_64", "AMD64"):
        return ("torch from PyPI: on Linux x86_64 the CUDA build, ~4.5 GB of downloads (torch, nvidia-*, triton) "
                "and a ~6 GB .venv; a CPU-only torch installed first is kept (README, Set up)")
    return "torch from PyPI: the CPU build for this platform, ~0.1-0.3 GB"


def announce(out=sys.stdout) -> None:
    """The line said before pip starts."""
    what = torch_estimate(installed_torch(), platform.system(), platform.machine())
    print(f"installing the package and its test tools: {what}, plus ~120 small packages (~0.4 GB). "
          "This takes a few minutes on a fast network; each package is listed as it is fetched.", file=out, flush=True)


def run(log: Path, command: List[str], heartbeat_s: float = HEARTBEAT_S, out=sys.stdout) -> int:
    """command (pip), its output in log; shown lines and heartbeats on out. Returns its exit status."""
    start = time.monotonic()
    last = [time.monotonic()]
    done = threading.Event()

    def beat() -> None:
        while not done.wait(min(5.0, heartbeat_s / 4)):
            if time.monotonic() - last[0] >= heartbeat_s:
                minutes = (time.monotonic() - start) / 60
                print(f"  ... pip still working ({minutes:.0f} min so far; a large wheel such as torch takes "
                      f"minutes; log: {log})", file=out, flush=True)
                last[0] = time.monotonic()

    threading.Thread(target=beat, daemon=True).start()
    with open(log, "a") as sink:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        for line in proc.stdout:
            sink.write(line)
            if line.lstrip().startswith(SHOWN):
                print("  " + line.strip(), file=out, flush=True)
                last[0] = time.monotonic()
        status = proc.wait()
    done.set()
    if status:
        print(f"pip failed (exit {status}); the end of {log}:", file=out)
        print("".join(log.read_text().splitlines(keepends=True)[-40:]), file=out, flush=True)
    return status


def main(argv: List[str]) -> int:
    if len(argv) < 2 or argv[1] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    announce()
    return run(Path(argv[0]), [sys.executable, "-m", "pip", *argv[2:]])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
