"""For first_call_peers.py: when the forkserver's preloads end. Named last in DDP_HELPERS_PRELOAD, it is imported
after every other preload; in that server it writes the wall clock then (and the server's start) and the CPU time it
had used, to the file $FIRST_CALL_CLOCK names. Imported anywhere else, or without that variable, it does nothing."""
import gc
import json
import os
import sys
import time


def _write(path: str) -> None:
    ticks = os.sysconf("SC_CLK_TCK")
    with open("/proc/self/stat") as fh:  # field 22: the process's start, in clock ticks after boot
        fields = fh.read().rsplit(")", 1)[1].split()  # fields 14-15: user and system CPU time, in ticks
    started_ticks, cpu_ticks = int(fields[19]), int(fields[11]) + int(fields[12])
    with open("/proc/uptime") as fh:
        boot = time.time() - float(fh.read().split()[0])
    with open(path, "w") as fh:
        json.dump({"ready": time.time(), "start": boot + started_ticks / ticks, "cpu": cpu_ticks / ticks,
                   "collections": sum(s["collections"] for s in gc.get_stats())}, fh)


if os.environ.get("FIRST_CALL_CLOCK") and "multiprocessing.forkserver" in sys.modules and sys.argv[:1] == ["-c"]:
    _write(os.environ["FIRST_CALL_CLOCK"])
