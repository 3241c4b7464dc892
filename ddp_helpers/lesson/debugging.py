"""Reading a job that hangs, diverges or restarts: a stack dump's frames (each thread's), the first step at which
the ranks' parameter fingerprints differ, and torchrun's agent log without its timestamps, process ids and paths.
"""
from __future__ import annotations

import os
import re
from typing import List, Optional, Sequence, Tuple

# faulthandler.dump_traceback writes one line per frame, innermost first: '  File "path", line 12 in name'
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<name>\S+)')
# The agent's log lines: glog-style 'I1201 21:14:03.987000 22949 torch/.../api.py:943] message'
_AGENT_PREFIX = re.compile(r"^[IWEF]\d{4} [\d:.]+ \d+ \S+:\d+\] ")
# What the agent says when a worker fails, when it restarts the group and when the group finishes.
AGENT_EVENTS = (r"failed \(exitcode: -?\d+\) local_rank: \d+", r"Worker group \w+\. \d+/\d+ attempts left",
                r"will restart worker group", r"restart_count=\d+", r"worker group successfully finished")


def stack_frames(dump: str) -> List[Tuple[str, str, int]]:
    """(function, file name, line) of each frame in a faulthandler dump, innermost first (the first thread's)."""
    frames = []
    for line in dump.splitlines():
        if frames and not line.strip():
            break  # a blank line ends the thread's stack
        m = _FRAME.match(line)
        if m:
            frames.append((m["name"], os.path.basename(m["file"]), int(m["line"])))
    return frames


def thread_stacks(dump: str) -> List[Tuple[bool, List[Tuple[str, str, int]]]]:
    """Every thread's stack in a faulthandler dump, in the dump's order: (whether it is the thread that took the
    signal, its (function, file name, line) frames innermost first). all_threads=True writes one block per thread
    ("Thread 0x...", "Current thread 0x..."); all_threads=False one block ("Stack"), the signalled thread's."""
    stacks: List[Tuple[bool, List[Tuple[str, str, int]]]] = []
    for line in dump.splitlines():
        if line.startswith(("Thread 0x", "Current thread 0x", "Stack (most recent call first)")):
            stacks.append((not line.startswith("Thread 0x"), []))
            continue
        m = _FRAME.match(line)
        if m and stacks:
            stacks[-1][1].append((m["name"], os.path.basename(m["file"]), int(m["line"])))
    return stacks


def first_divergence(fingerprints: Sequence[Sequence[int]]) -> Optional[int]:
    """The first step at which the ranks' fingerprints (one list per rank, one value per step) differ, or None."""
    if not fingerprints:
        return None
    n = min(len(f) for f in fingerprints)
    for step in range(n):
        if len({f[step] for f in fingerprints}) > 1:
            return step
    return None


def agent_events(log: str) -> List[str]:
    """The lines of a torchrun agent's log that tell its story (a worker failed, a restart, the end), each without
    the timestamp, process id and source location that vary from run to run."""
    events = []
    for line in log.splitlines():
        text = _AGENT_PREFIX.sub("", line.strip())
        if any(re.search(p, text) for p in AGENT_EVENTS):
            text = re.sub(r"\s*\(pid: \d+\)", "", text)
            text = re.sub(r" of binary: \S+", "", text)
            events.append(text.strip())
    return events
