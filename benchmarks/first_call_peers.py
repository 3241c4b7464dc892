"""Set-up plus the first call, and the warm call, beside Lightning's ddp_notebook and accelerate's notebook_launcher,
each in a fresh Jupyter kernel: what a learner waits for at the top of a notebook.

    python benchmarks/first_call_peers.py [--rounds 6] [--warm-calls 3] [--markdown]

The peers are not dependencies of the package (benchmarks/requirements-peers.txt names them). Install them into a
venv of their own that sees the project's (a .pth file naming its site-packages: pip then finds torch installed
and downloads none, and the project's venv is left as it was), and run the script with that interpreter:

    .venv/bin/python -m venv /tmp/peers
    .venv/bin/python -c "import site; print(site.getsitepackages()[0])" \
        > /tmp/peers/lib/python3.11/site-packages/project.pth      # python3.11: the project venv's version
    /tmp/peers/bin/pip install -r benchmarks/requirements-peers.txt
    /tmp/peers/bin/python benchmarks/first_call_peers.py --markdown

A contender whose package the interpreter can't import is left out, and said so. Every kernel is started with
the interpreter running this script (`--python` to choose another) and the checkout on PYTHONPATH.

The job, the same for every contender: 2 ranks, gloo on CPU, one epoch of mnist-5k's 4,000 training images
(DistributedSampler shards, batch 64 per rank: 32 steps), Flatten -> Linear(784, 10), SGD lr 0.01, then the test
accuracy over the 1,000 test images. Cells, timed from this client (a learner's wait, messages included):
  kernel    the kernel's start to its first reply (the same for all: nothing of the contender yet);
  set-up    the notebook's set-up cell: for ddp_helpers as the notebooks have it (warm_up() first, then the
            imports, then load_data), for a peer its imports and the same data;
  first     the first training call;
  warm      the median of --warm-calls more calls.
For ddp_helpers the first call is split further from the kernel's clocks: the wait for the forkserver (its preload
ends when a module listed last in DDP_HELPERS_PRELOAD is imported, benchmarks/_server_clock.py), the ranks'
start-up after that, the loop, and the rest (evaluation, the launch's end, the result). The contenders' order
rotates each round (the machine's drift spreads over all of them); the load average is printed with each run.

    --also-tree DIR      ddp_helpers from another checkout too (an older commit), as ddp_helpers@<DIR's name>
    --contenders ...     ddp_helpers-fork too: the package's ranks forked from the kernel as accelerate's are
    --server-imports N   instead: the forkserver's preloads module by module, CPU seconds, the garbage
                         collector on and off alternated in N fresh interpreters
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "benchmarks")

COMMON_SETUP = """\
from ddp_helpers.data import load_data, normalize
_data = load_data("mnist-5k")  # the same 4,000 + 1,000 digits for every contender
X, Y = _data.train_normalized(), _data.train_labels
XT, YT = normalize(_data.test_images), _data.test_labels
"""

SETUP = {
    "ddp_helpers": """\
import ddp_helpers
ddp_helpers.warm_up()  # the notebooks' set-up cell: first, so the server imports torch beside this kernel
_t_warm = time.time()
import torch
from ddp_helpers import TrainConfig, run_training
_t_torch = time.time()
""" + COMMON_SETUP,
    "ddp_helpers-fork": """\
import ddp_helpers
import torch
from ddp_helpers import TrainConfig, run_training
_t_torch = time.time()
""" + COMMON_SETUP,
    "lightning": """\
import torch
import lightning as L
_t_torch = time.time()
""" + COMMON_SETUP,
    "accelerate": """\
import torch
from accelerate import notebook_launcher
_t_torch = time.time()
""" + COMMON_SETUP,
}

# What each contender's call runs (defined in the set-up cell's second half, not timed apart: a cell's defs).
DEFS = {
    "ddp_helpers": """\
def job():
    return run_training(TrainConfig(dataset="mnist-5k"), progress=False)
""",
    "ddp_helpers-fork": """\
def job():
    return run_training(TrainConfig(dataset="mnist-5k"), progress=False, start_method="fork")
""",
    "lightning": """\
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))
    def training_step(self, batch, i):
        x, y = batch
        return F.cross_entropy(self.net(x), y)
    def test_step(self, batch, i):
        x, y = batch
        self.log("acc", (self.net(x).argmax(1) == y).float().mean(), sync_dist=True)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

def job():
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_notebook", max_epochs=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    model = Net()
    trainer.fit(model, DataLoader(TensorDataset(X, Y), batch_size=64, shuffle=True))
    return trainer.test(model, DataLoader(TensorDataset(XT, YT), batch_size=500), verbose=False)
""",
    "accelerate": """\
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

def train():
    from accelerate import Accelerator
    torch.set_num_threads(1)  # 2 ranks on the machine's cores, as the other two set it
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    train_dl = DataLoader(TensorDataset(X, Y), batch_size=64, shuffle=True)
    test_dl = DataLoader(TensorDataset(XT, YT), batch_size=500)
    model, opt, train_dl, test_dl = acc.prepare(model, opt, train_dl, test_dl)
    for x, y in train_dl:
        opt.zero_grad()
        acc.backward(F.cross_entropy(model(x), y))
        opt.step()
    correct = torch.zeros(())
    with torch.no_grad():
        for x, y in test_dl:
            correct += acc.gather_for_metrics((model(x).argmax(1) == y).sum()).sum()
    if acc.is_main_process:
        print(f"accuracy {correct.item() / len(YT):.4f}")

def job():
    return notebook_launcher(train, num_processes=2)
""",
}

SETUP_CLOCK = "import time\n_t_setup = time.time()\n_cpu0 = time.process_time()\n"
SETUP_CPU = "_setup_cpu = time.process_time() - _cpu0  # the kernel's CPU seconds in its set-up cell\n"
FIRST = """\
_t_first = time.time()
_first = job()
_t_first_end = time.time()
"""
WARM = "job()\n"
REPORT = """\
import json as _json
_clock = {}
if __import__("os").path.exists(%(clock)r):
    with open(%(clock)r) as _fh:
        _clock = _json.load(_fh)
_out = {"t_setup": _t_setup, "t_torch": _t_torch, "t_first": _t_first, "t_first_end": _t_first_end,
        "t_warm": globals().get("_t_warm"), "server_ready": _clock.get("ready"), "server_start": _clock.get("start"),
        "server_cpu": _clock.get("cpu"), "server_collections": _clock.get("collections"), "setup_cpu": _setup_cpu}
if hasattr(_first, "startup_s"):
    _out.update(startup=_first.startup_s, loop=_first.loop_time_s, wall=_first.wall_time_s)
print("REPORT " + _json.dumps(_out))
"""

# --server-imports: the forkserver's preload list imported in a fresh interpreter, each module's CPU seconds, with
# the garbage collector on (as before issue 62) and off (server_preload.preload now), then the freeze.
SERVER_IMPORTS = """\
import gc, json, sys, time
from ddp_helpers.ranks.server_preload import MODULES
collector_on = sys.argv[1] == "on"
if not collector_on:
    gc.disable()
took, c0 = {}, time.process_time()
for name in ("torch",) + MODULES:
    __import__(name)
    took[name], c0 = time.process_time() - c0, time.process_time()
if collector_on:
    gc.collect()
gc.freeze()
took["collect and freeze"] = time.process_time() - c0
took["collections"] = sum(s["collections"] for s in gc.get_stats())
print(json.dumps(took))
"""

CONTENDERS = tuple(SETUP)
DEFAULT = ("ddp_helpers", "lightning", "accelerate")  # ddp_helpers-fork: the package's ranks forked from the kernel,
# as accelerate's are (no warm_up(), no server): measured to weigh that way for the first call, not a default
MODULE_OF = {"ddp_helpers": "ddp_helpers", "ddp_helpers-fork": "ddp_helpers", "lightning": "lightning",
             "accelerate": "accelerate"}


def _kernel_spec_dir(python: str) -> str:
    """A kernelspec folder whose one kernel runs `python` (the peers' venv need not be registered anywhere)."""
    folder = tempfile.mkdtemp(prefix="first_call_peers-")
    os.makedirs(os.path.join(folder, "bench"))
    with open(os.path.join(folder, "bench", "kernel.json"), "w") as fh:
        json.dump({"argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                   "display_name": "first-call bench", "language": "python"}, fh)
    return folder


def _execute(kc, code: str, timeout: float) -> tuple:
    """Run code in the kernel: (seconds from the request to the reply, the text it printed)."""
    printed = []

    def hook(msg) -> None:
        if msg["msg_type"] == "stream":
            printed.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            printed.append("\n".join(msg["content"]["traceback"]))

    t0 = time.monotonic()
    reply = kc.execute_interactive(code, timeout=timeout, output_hook=hook)
    took = time.monotonic() - t0
    if reply["content"]["status"] != "ok":
        raise RuntimeError("a cell failed:\n" + "".join(printed)[-4000:])
    return took, "".join(printed)


def run_once(name: str, spec_dir: str, warm_calls: int, trees: dict) -> dict:
    """One fresh kernel: the contender's set-up cell, its first call and warm_calls more; seconds per phase."""
    tree = trees.get(name, ROOT)  # ddp_helpers@NAME: the package of another checkout (--also-tree)
    name = name.split("@")[0]
    from jupyter_client.kernelspec import KernelSpecManager
    from jupyter_client.manager import KernelManager

    clock = os.path.join(spec_dir, f"clock-{name}-{time.time_ns()}.json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tree, BENCH]), "DDP_HELPERS_PROGRESS": "0",
           "FIRST_CALL_CLOCK": clock, "DDP_HELPERS_PRELOAD": "_server_clock"}
    km = KernelManager(kernel_name="bench", kernel_spec_manager=KernelSpecManager(kernel_dirs=[spec_dir]))
    t0 = time.monotonic()
    # cwd: the tree too (a kernel puts its folder on sys.path, ahead of PYTHONPATH, and the server inherits it)
    km.start_kernel(env=env, cwd=tree, stderr=subprocess.DEVNULL)  # its notices; a failing cell's traceback comes back
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        got = {"kernel": time.monotonic() - t0}
        got["setup"], _ = _execute(kc, SETUP_CLOCK + SETUP[name] + SETUP_CPU, 300)
        _execute(kc, DEFS[name], 60)
        got["first"], _ = _execute(kc, FIRST, 300)
        got["warm"] = statistics.median(_execute(kc, WARM, 300)[0] for _ in range(warm_calls))
        _, printed = _execute(kc, REPORT % {"clock": clock}, 60)
        report = json.loads(printed.split("REPORT ", 1)[1].splitlines()[0])
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    got["setup_torch"] = report["t_torch"] - report["t_setup"]  # the set-up cell up to its imports' end
    got["setup_cpu"] = report["setup_cpu"]
    if report.get("server_ready"):
        got["server_start"] = report["server_start"] - report["t_setup"]  # from the set-up cell's start
        got["server_ready"] = report["server_ready"] - report["t_setup"]
        got["server_cpu"] = report["server_cpu"]
        got["server_collections"] = report["server_collections"]
        got["wait"] = max(report["server_ready"], report["t_first"]) - report["t_first"]
    if "startup" in report:
        got["startup"], got["loop"] = report["startup"], report["loop"]
        got["rest"] = (report["t_first_end"] - report["t_first"]) - report["startup"] - report["loop"]
    return got


def server_imports(rounds: int, python: str, markdown: bool) -> None:
    """The server's preloads, module by module, collector on and off alternated in fresh interpreters: CPU s."""
    runs = {"on": [], "off": []}
    env = {**os.environ, "PYTHONPATH": ROOT}
    for _ in range(rounds):
        for mode in runs:
            out = subprocess.run([python, "-c", SERVER_IMPORTS, mode], capture_output=True, text=True, env=env,
                                 check=True)
            runs[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    names = list(runs["on"][0])
    print(f"\nthe server's preloads, CPU s (medians of {rounds}; load {_load()})")
    if markdown:
        print("| module | collector on | collector off |\n|---|---|---|")
    for n in names + ["total"]:
        on, off = ([sum(v for k, v in r.items() if k != "collections") if n == "total" else r[n] for r in runs[m]]
                   for m in ("on", "off"))
        fmt = "{:.0f}" if n == "collections" else "{:.3f}"
        cells = (fmt.format(statistics.median(on)), fmt.format(statistics.median(off)))
        print(f"| {n} | {cells[0]} | {cells[1]} |" if markdown else f"  {n:28s} {cells[0]:>8s} {cells[1]:>8s}")


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?"


def _available(names, python: str) -> list:
    """The contenders whose package `python` can import (checked without importing: find_spec in that
    interpreter)."""
    code = "import importlib.util, sys; print(' '.join(m for m in sys.argv[1:] if importlib.util.find_spec(m)))"
    out = subprocess.run([python, "-c", code, *[MODULE_OF[n] for n in names]], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT}, check=True)
    found = set(out.stdout.split())
    return [n for n in names if MODULE_OF[n] in found]


def main(argv=None) -> int:
    """Rounds of every contender in a fresh kernel each, the order rotated; the medians printed."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=6, help="rounds; each runs every contender once (default 6)")
    p.add_argument("--warm-calls", type=int, default=3, help="calls after the first, per kernel (default 3)")
    p.add_argument("--contenders", default=",".join(DEFAULT),
                   help=f"comma-separated, from {', '.join(CONTENDERS)} (default: {','.join(DEFAULT)})")
    p.add_argument("--python", default=sys.executable, help="the kernels' interpreter (default: this one)")
    p.add_argument("--also-tree", action="append", default=[], metavar="DIR",
                   help="another checkout of the package (a git worktree of an older commit): ddp_helpers from it "
                        "runs too, as the contender ddp_helpers@<DIR's name>")
    p.add_argument("--server-imports", type=int, default=0, metavar="N",
                   help="instead: the forkserver's preloads module by module, collector on and off, N rounds")
    p.add_argument("--markdown", action="store_true", help="Markdown tables")
    args = p.parse_args(argv)
    if args.server_imports:
        server_imports(args.server_imports, args.python, args.markdown)
        return 0
    if args.rounds < 1 or args.warm_calls < 1:
        p.error("--rounds and --warm-calls must be at least 1")
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown or not names:
        p.error(f"--contenders: unknown {', '.join(unknown) or '(none given)'}; choose from {', '.join(CONTENDERS)}")
    for t in args.also_tree:
        if not os.path.isfile(os.path.join(t, "ddp_helpers", "__init__.py")):
            p.error(f"--also-tree {t}: no ddp_helpers package in it")
    trees = {f"ddp_helpers@{os.path.basename(os.path.abspath(t))}": os.path.abspath(t) for t in args.also_tree}
    if importlib.util.find_spec("jupyter_client") is None:
        p.error("jupyter_client is not installed here: pip install jupyter_client ipykernel")
    present = _available(names, args.python)
    for n in names:
        if n not in present:
            print(f"{n}: left out, {args.python} can't import {MODULE_OF[n]} "
                  f"(pip install -r benchmarks/requirements-peers.txt)")
    present += list(trees)
    if not present:
        return 1
    spec_dir = _kernel_spec_dir(args.python)
    runs = {n: [] for n in present}
    print(f"load average at the start: {_load()}; {len(present)} contenders x {args.rounds} rounds, "
          f"{args.warm_calls} warm calls each", flush=True)
    try:
        for rnd in range(args.rounds):
            order = present[rnd % len(present):] + present[:rnd % len(present)]
            for n in order:
                got = run_once(n, spec_dir, args.warm_calls, trees)
                runs[n].append(got)
                print(f"round {rnd + 1} {n:16s} kernel {got['kernel']:.2f}  set-up {got['setup']:.2f}  "
                      f"first {got['first']:.2f}  warm {got['warm']:.3f}  (load {_load()})", flush=True)
    finally:
        shutil.rmtree(spec_dir, ignore_errors=True)
    _print_tables(runs, args.rounds, args.markdown)
    print(f"load average at the end: {_load()}")
    return 0


def _median(rows: list, key: str) -> float:
    values = [r[key] for r in rows if key in r]
    return statistics.median(values) if values else float("nan")


def _print_tables(runs: dict, rounds: int, markdown: bool) -> None:
    print(f"\nmedians of {rounds} rounds, s (client-side: a cell's request to its reply)")
    cols = ("kernel", "setup", "first", "setup+first", "warm")
    heads = ("kernel start", "set-up cell", "first call", "set-up + first call", "warm call")
    for rows in runs.values():
        for r in rows:
            r["setup+first"] = r["setup"] + r["first"]
    if markdown:
        print("| contender | " + " | ".join(heads) + " |\n" + "|---" * (len(heads) + 1) + "|")
        for n, rows in runs.items():
            print(f"| {n} | " + " | ".join(f"{_median(rows, c):.2f}" if c != "warm" else f"{_median(rows, c):.3f}"
                                           for c in cols) + " |")
    else:
        for n, rows in runs.items():
            print(f"{n:16s} " + "  ".join(f"{h} {_median(rows, c):.3f}" for h, c in zip(heads, cols)))
    phases = {"setup_torch": "set-up cell: its imports' end", "setup_cpu": "set-up cell: the kernel's CPU time",
              "server_start": "server started (from the set-up's start)",
              "server_ready": "server's preloads done (idem)",
              "server_cpu": "server's CPU time by then",
              "server_collections": "server's garbage collections by then (count)",
              "wait": "first call: waiting for the server",
              "startup": "first call: start-up (the wait included)", "loop": "first call: loop",
              "rest": "first call: the rest"}
    for n, rows in runs.items():
        shown = [k for k in phases if any(k in r for r in rows)]
        if "startup" not in shown:
            continue
        print(f"\n{n}, the set-up's and first call's phases (medians, s; the kernel's and the server's clocks)")
        if markdown:
            print("| phase | s |\n|---|---|")
        for k in shown:
            value = _median(rows, k)
            print(f"| {phases[k]} | {value:.3f} |" if markdown else f"  {phases[k]:42s} {value:.3f}")
    for n, rows in runs.items():
        print(f"{n} set-up + first call by round: " + " / ".join(f"{r['setup+first']:.2f}" for r in rows))


if __name__ == "__main__":
    sys.exit(main())
