"""make env's pip, without silent minutes: say what it will download and roughly how much, then show each package
as pip fetches it and, every STATUS_S while pip is otherwise quiet, one line saying what it is doing and how much
so far: the file being fetched and its bytes (pip's --progress-bar raw), else the packages collected or the bytes
written into the venv (everything also goes to the log). Usage: python tools/pip_progress.py LOG -- PIP_ARGS..."""
from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path
from typing import List, Optional

STATUS_S = 15.0  # the longest the terminal stays silent while pip works
SHOWN = ("Collecting ", "Downloading ", "Installing collected", "Successfully installed", "ERROR")
RAW_PIP = (24, 1)  # the first pip with --progress-bar raw ("Progress N of M" lines on a pipe too)
PROGRESS = re.compile(r"^Progress (\d+) of (\d+)$")
DOWNLOADING = re.compile(r"^\s*Downloading (\S+)")


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


def size_text(n_bytes: float) -> str:
    """Bytes in the unit a reader compares with the announced sizes: kB, MB or GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.1f} {unit}"
    return f"{n_bytes / 1e3:.0f} kB"


def folder_bytes(folder: Path) -> int:
    """The bytes of the files under folder (links not followed); 0 if it is gone."""
    total = 0
    for parent, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.lstat(os.path.join(parent, name)).st_size
            except OSError:
                pass  # removed meanwhile (pip's temporary files)
    return total


class Progress:
    """What pip is doing, from its lines: the phase, the file being fetched and the bytes fetched so far."""

    def __init__(self, site_packages: Path):
        self.site_packages = site_packages
        self.collected = 0
        self.fetched_bytes = 0  # of the files finished
        self.file: Optional[str] = None
        self.file_done, self.file_total = 0, 0
        self.installing_from: Optional[int] = None  # site-packages' bytes when pip began installing

    def read(self, line: str) -> bool:
        """Take one of pip's lines; True if it is a raw progress line (kept out of the terminal and the log)."""
        match = PROGRESS.match(line.strip())
        if match:
            self.file_done, self.file_total = int(match[1]), int(match[2])
            return True
        if line.startswith("Collecting "):
            self.collected += 1
        elif DOWNLOADING.match(line):
            self._file_finished()
            self.file = DOWNLOADING.match(line)[1].rsplit("/", 1)[-1]
        elif line.startswith("Installing collected"):
            self._file_finished()
            self.installing_from = folder_bytes(self.site_packages)
        return False

    def _file_finished(self) -> None:
        if self.file is not None:
            self.fetched_bytes += self.file_done
        self.file, self.file_done, self.file_total = None, 0, 0

    def status(self, seconds: float) -> str:
        """One line: what pip is doing now and how much so far, with the time since it started."""
        took = f"{seconds // 60:.0f} min {seconds % 60:02.0f} s"
        if self.installing_from is not None:
            written = folder_bytes(self.site_packages) - self.installing_from
            return f"  ... installing: {size_text(max(written, 0))} written into the venv so far ({took})"
        if self.file is not None:
            of = f" of {size_text(self.file_total)}" if self.file_total else ""
            share = f" ({100 * self.file_done / self.file_total:.0f}%)" if self.file_total else ""
            return (f"  ... fetching {self.file}: {size_text(self.file_done)}{of}{share}; "
                    f"{size_text(self.fetched_bytes + self.file_done)} fetched in all ({took})")
        return (f"  ... resolving: {self.collected} packages collected, {size_text(self.fetched_bytes)} fetched "
                f"so far ({took})")


def pip_version(python: str) -> tuple:
    """The version of pip that `python -m pip` runs, as numbers; () when it can't be read."""
    proc = subprocess.run([python, "-m", "pip", "--version"], capture_output=True, text=True)
    match = re.match(r"pip (\d+)\.(\d+)", proc.stdout)
    return tuple(int(x) for x in match.groups()) if match else ()


def with_raw_progress(command: List[str]) -> List[str]:
    """command with --progress-bar raw after `install` where its pip has it (pip >= 24.1): byte counts on a pipe."""
    if "install" not in command or "--progress-bar" in command or pip_version(command[0]) < RAW_PIP:
        return command
    at = command.index("install") + 1
    return command[:at] + ["--progress-bar", "raw"] + command[at:]


def run(log: Path, command: List[str], status_s: float = STATUS_S, out=sys.stdout,
        site_packages: Optional[Path] = None) -> int:
    """command (pip), its output in log; shown lines and status lines on out. Returns its exit status."""
    progress = Progress(site_packages or Path(sysconfig.get_paths()["purelib"]))
    start = time.monotonic()
    last = [time.monotonic()]
    done = threading.Event()
    lock = threading.Lock()

    def say(text: str) -> None:
        with lock:
            print(text, file=out, flush=True)
            last[0] = time.monotonic()

    def beat() -> None:
        while not done.wait(min(1.0, status_s / 4)):
            if time.monotonic() - last[0] >= status_s:
                say(progress.status(time.monotonic() - start))

    threading.Thread(target=beat, daemon=True).start()
    with open(log, "a") as sink:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, bufsize=1)
        for line in proc.stdout:
            if progress.read(line):
                continue
            sink.write(line)
            if line.lstrip().startswith(SHOWN):
                say("  " + line.strip())
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
    return run(Path(argv[0]), with_raw_progress([sys.executable, "-m", "pip", *argv[2:]]))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
