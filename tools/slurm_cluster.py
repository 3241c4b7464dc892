"""A SLURM test cluster on this machine: munge, slurmctld and two slurmd nodes, each in a network namespace.

What a cluster user has, on one machine: two nodes (`n1`, `n2`) with their own address, hostname and TMPDIR, a
controller (`ctl`) on an address of its own, one shared file system (this machine's: the repository and /tmp),
and Debian's `slurm-wlm` 22.05 and `munge`. Root only (it makes network namespaces and a bridge).

By hand (from the repository root):

    sudo python tools/slurm_cluster.py start     # idempotent: a running cluster is kept; prints its state folder
    python tools/slurm_cluster.py status         # exit 0 when the controller answers and both nodes are up
    eval "$(python tools/slurm_cluster.py env)"  # SLURM_CONF, so sbatch, srun, squeue, scancel, sinfo reach it
    sbatch -N2 --ntasks-per-node=1 examples/slurm/train.sbatch
    python tools/slurm_cluster.py stop           # every process of the cluster ended, namespaces and bridge removed
                                                 # (refused while a test session uses it, unless --force)

From Python (tests/slurm/conftest.py's session fixture does this): `cluster = SlurmCluster(); cluster.start()`,
then `cluster.run(["sbatch", ...])` (or any command with `env=cluster.env()`), `cluster.sbatch(script, *flags,
args=...)`,
`cluster.wait_job(job_id)`, `cluster.node_tmpdir("n1")`, `cluster.stop()`. `unavailable()` says why it can't run
here (not root, no slurm, no network namespaces), or None.

How it is built, and why (facts that cost time to find):
- Debian's slurmd has no multiple-slurmd build: one network namespace per node (`<name>-n1`, `<name>-n2`) and one
  for the controller (in the root namespace slurmctld would bind the address its hostname resolves to, 127.0.0.1).
  A bridge in the root namespace joins them (10.x.y.0/24, private, only these hosts), so clients here reach it.
- `ip netns exec` mounts a fresh /sys, where slurmd 22.05 finds no cgroup mounts and refuses to start: each daemon
  enters its namespace with `nsenter --net=/run/netns/NAME` and `unshare --uts --mount`, sets its hostname and
  binds a hosts file naming ctl, n1 and n2 over /etc/hosts.
- No default route in the namespaces: a name that isn't in the hosts file fails at once instead of waiting on DNS.
- munge with a key and socket of its own (`AuthInfo=socket=...`), not the machine's /etc/munge.
- `SlurmdParameters=config_overrides`: the nodes report the CPUs slurm.conf gives them, not this machine's.
- Two fake GPUs per node (`Gres=gpu:2`; gres.conf, `AutoDetect=off`, names two character devices with /dev/null's
  numbers: slurmd refuses a regular file there), so a step's `--gpus-per-task=1` or `--gpus-per-node=2` sets each
  task's CUDA_VISIBLE_DEVICES as on a GPU cluster (SLURM_STEP_GPUS too, per task). No CUDA sees them.
- A TaskProlog gives each node's tasks its own TMPDIR (`<state>/<node>/tmp`), as on separate machines.
- Short timeouts (KillWait=2 between scancel's SIGTERM and SIGKILL; a lost node noticed within SlurmdTimeout).
- stop ends every process living in the cluster's namespaces (jobs' tasks too, found by their namespace), then
  the daemons in the root namespace (munged), by id; then the namespaces and the bridge.

Set DDP_HELPERS_SLURM_NAME to run a second cluster beside the first (another name, subnet and state folder).
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import zlib
from typing import Dict, List, Optional, Sequence

NODES = ("n1", "n2")
NODE_CPUS = 4  # more than this machine's cores: concurrent test jobs share a node, as slurm's oversubscription would
NODE_GPUS = 2  # fake ones (gres.conf): enough for SLURM to set CUDA_VISIBLE_DEVICES per task as on a GPU node
START_TIMEOUT_S = 20.0
DAEMONS = ("slurmctld", "slurmd", "munged")
NEEDED = ("slurmctld", "slurmd", "munged", "sbatch", "srun", "scontrol", "ip", "nsenter", "unshare")


class Unavailable(RuntimeError):
    """This machine can't run the test cluster (not root, no slurm, no network namespaces): a reason to skip."""


def _name() -> str:
    return os.environ.get("DDP_HELPERS_SLURM_NAME", "ddps")


def unavailable() -> Optional[str]:
    """Why the test cluster can't run on this machine, or None."""
    if not sys.platform.startswith("linux"):
        return "the SLURM test cluster needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the SLURM test cluster needs root (network namespaces, a bridge, slurmd)"
    missing = [c for c in NEEDED if shutil.which(c, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") is None]
    if missing:
        return f"the SLURM test cluster needs {', '.join(missing)} (apt-get install slurm-wlm munge iproute2 util-linux)"
    return None


def _which(cmd: str) -> str:
    return shutil.which(cmd, path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin") or cmd


class SlurmCluster:
    """The test cluster named DDP_HELPERS_SLURM_NAME (default ddps): its files, addresses and processes."""

    def __init__(self, name: Optional[str] = None, state_dir: Optional[str] = None):
        self.name = name or _name()
        self.state = state_dir or os.path.join(tempfile.gettempdir(), f"ddp-helpers-slurm-{self.name}")
        third = 16 + zlib.crc32(self.name.encode()) % 200  # a subnet per cluster name, inside 10.231.0.0/16
        self.subnet = f"10.231.{third}"
        self.bridge = f"{self.name}-br"[:15]
        self.addrs = {"host": f"{self.subnet}.1", "ctl": f"{self.subnet}.2",
                      **{n: f"{self.subnet}.{11 + i}" for i, n in enumerate(NODES)}}
        self.conf = os.path.join(self.state, "slurm.conf")
        self.munge_socket = os.path.join(self.state, "munge", "munge.socket")

    # ---- what clients use
    def env(self, base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        """An environment whose sbatch, srun, squeue, scancel and scontrol talk to this cluster."""
        env = dict(os.environ if base is None else base)
        env["SLURM_CONF"] = self.conf
        for k in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and k != "SLURM_CONF"]:
            del env[k]  # an allocation's own variables would send srun to a job of another cluster
        return env

    def run(self, cmd: Sequence[str], timeout: float = 30, check: bool = True, **kw) -> subprocess.CompletedProcess:
        """Run a slurm client command (sbatch, srun, squeue, ...) against this cluster; its output as text."""
        kw.setdefault("env", self.env())
        return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout, check=check, **kw)

    def sbatch(self, script: str, *flags: str, args: Sequence[str] = (), cwd: Optional[str] = None,
               env: Optional[Dict[str, str]] = None) -> str:
        """Submit a batch script (a path) with sbatch's flags and the script's own args; its job id."""
        out = self.run(["sbatch", "--parsable", *flags, script, *args], cwd=cwd, env=self.env(env))
        return out.stdout.strip().split(";")[0]

    def job_state(self, job_id: str) -> str:
        """The job's state as scontrol says it (PENDING, RUNNING, COMPLETED, FAILED, CANCELLED, ...)."""
        out = self.run(["scontrol", "-o", "show", "job", job_id], check=False)
        for field in out.stdout.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "UNKNOWN"

    def wait_job(self, job_id: str, timeout: float = 60.0, poll_s: float = 0.2) -> str:
        """Wait until the job has ended; its final state. A job still running at timeout is cancelled first."""
        deadline = time.monotonic() + timeout
        ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                 "DEADLINE", "PREEMPTED")  # not UNKNOWN: scontrol not answering in time on a loaded machine
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in ended:
                return state
            time.sleep(poll_s)
        self.run(["scancel", job_id], check=False)
        raise TimeoutError(f"SLURM job {job_id} still {self.job_state(job_id)} after {timeout:.0f} s (cancelled)")

    def node_tmpdir(self, node: str) -> str:
        """The TMPDIR of the tasks on node (the TaskProlog sets it)."""
        return os.path.join(self.state, node, "tmp")

    def logs(self) -> str:
        """The daemons' logs' last lines, for a failure's message."""
        parts = []
        for f in ["ctl/slurmctld.log", *(f"{n}/slurmd.log" for n in NODES), "munge/munged.log"]:
            path = os.path.join(self.state, f)
            if os.path.exists(path):
                with open(path, errors="replace") as fh:
                    parts.append(f"--- {f}\n" + "".join(fh.readlines()[-20:]))
        return "\n".join(parts)

    # ---- who uses it
    def lock_path(self, which: str) -> str:
        """`start` (held while a session starts or stops it) or `users` (held shared by each session using it)."""
        return f"{self.state.rstrip('/')}.{which}.lock"

    def in_use(self) -> bool:
        """True while a test session holds the cluster (tests/slurm/conftest.py's shared lock)."""
        import fcntl

        try:
            fd = os.open(self.lock_path("users"), os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except OSError:
            return True
        finally:
            os.close(fd)

    # ---- the cluster's life
    def status(self) -> bool:
        """True when the controller answers and both nodes are up (idle, mixed or allocated)."""
        if not os.path.exists(self.conf) or not os.path.exists(self._netns("ctl")):
            return False
        try:
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], timeout=5, check=False)
        except subprocess.TimeoutExpired:
            return False
        states = dict(line.split() for line in out.stdout.splitlines() if len(line.split()) == 2)
        return out.returncode == 0 and all(states.get(n, "").rstrip("*~#") in ("idle", "mixed", "allocated",
                                                                                "completing") for n in NODES)

    def start(self) -> float:
        """Start the cluster unless it runs; the seconds it took. Raises RuntimeError with the logs if it can't."""
        why = unavailable()
        if why:
            raise Unavailable(why)
        t0 = time.monotonic()
        if self.status():
            return time.monotonic() - t0
        if self.in_use():  # a test session holds it: not answering now (a loaded machine) is no reason to restart
            raise RuntimeError(f"{self.name} is in use by a test session but did not answer: see {self.state}'s "
                               "logs; 'stop --force' ends it")
        self.stop()  # whatever a killed run left
        self._write_files()
        try:
            self._network()
        except Unavailable:
            self.stop()
            raise
        self._start_munge()
        self._daemon("ctl", [_which("slurmctld"), "-f", self.conf, "-i"])
        for node in NODES:
            self._daemon(node, [_which("slurmd"), "-f", self.conf, "-N", node])
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.status():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the SLURM test cluster did not come up in {START_TIMEOUT_S:.0f} s\n{self.logs()}")
            time.sleep(0.05)
        return time.monotonic() - t0

    def stop(self) -> float:
        """End every process of the cluster, remove its namespaces and bridge; the seconds it took. Idempotent."""
        t0 = time.monotonic()
        pids = self._pids()
        daemons = {p for p in pids if os.path.basename(_cmdline(p).split(" ")[0]).rstrip(":") in DAEMONS}
        # the daemons end on SIGTERM at once; slurmstepd ignores it, and a job's tasks have nothing to keep here
        for sig, wait_s, targets in ((None, 1.0, pids), (signal.SIGKILL, 1.0, pids)):
            for pid in targets:
                try:
                    os.kill(pid, sig or (signal.SIGTERM if pid in daemons else signal.SIGKILL))
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait_s
            while pids and time.monotonic() < deadline:
                pids = [p for p in pids if _alive(p)]
                time.sleep(0.02)
        for ns in ("ctl", *NODES):
            subprocess.run([_which("ip"), "netns", "del", self._ns(ns)], capture_output=True, timeout=10)
        subprocess.run([_which("ip"), "link", "del", self.bridge], capture_output=True, timeout=10)
        return time.monotonic() - t0

    # ---- inside
    def _ns(self, host: str) -> str:
        return f"{self.name}-{host}"

    def _netns(self, host: str) -> str:
        return f"/run/netns/{self._ns(host)}"

    def _pids(self) -> List[int]:
        """Every process in the cluster's network namespaces, and munged (by its pid file)."""
        inodes = set()
        for host in ("ctl", *NODES):
            try:
                inodes.add(os.stat(self._netns(host)).st_ino)
            except OSError:
                pass
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    if os.stat(f"/proc/{entry}/ns/net").st_ino in inodes:
                        pids.append(int(entry))
                except OSError:
                    pass
        munged = _read_pid(os.path.join(self.state, "munge", "munged.pid"))
        if munged and "munged" in _cmdline(munged):  # not a pid reused since by another program
            pids.append(munged)
        return [p for p in pids if p != os.getpid()]

    def _write_files(self) -> None:
        if os.path.islink(self.state):  # planted in the shared temp dir: root must not write through it
            os.unlink(self.state)
        shutil.rmtree(self.state, ignore_errors=True)
        os.mkdir(self.state, 0o755)  # fails if anything took the name meanwhile; jobs and clients read slurm.conf
        for sub in ("ctl", "munge"):
            os.mkdir(os.path.join(self.state, sub), 0o700)
        for node in NODES:  # its TMPDIR inside, open to a job of any user; its spool root's alone
            os.mkdir(os.path.join(self.state, node), 0o755)
        for node in NODES:
            os.mkdir(self.node_tmpdir(node))
            os.chmod(self.node_tmpdir(node), 0o1777)  # a temp dir, as /tmp is
            os.mkdir(os.path.join(self.state, node, "spool"), 0o700)
        key = os.path.join(self.state, "munge", "munge.key")
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o400)
        os.write(fd, os.urandom(1024))
        os.close(fd)
        with open(os.path.join(self.state, "hosts"), "w") as f:
            f.write("127.0.0.1 localhost\n" + "".join(f"{self.addrs[h]} {h}\n" for h in ("ctl", *NODES)))
        prolog = os.path.join(self.state, "task_prolog.sh")
        with open(prolog, "w") as f:  # a TaskProlog's "export NAME=value" lines set the task's environment
            f.write(f"#!/bin/sh\necho \"export TMPDIR={self.state}/$(hostname)/tmp\"\n")
        os.chmod(prolog, 0o755)
        with open(self.conf, "w") as f:
            f.write(self._slurm_conf(prolog))
        for i in range(NODE_GPUS):  # a fake GPU: a character device with /dev/null's numbers (nothing opens it)
            os.mknod(os.path.join(self.state, f"gpu{i}"), 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        with open(os.path.join(self.state, "gres.conf"), "w") as f:
            f.write(f"AutoDetect=off\nName=gpu File={self.state}/gpu[0-{NODE_GPUS - 1}]\n")
        with open(os.path.join(self.state, "cgroup.conf"), "w") as f:
            f.write("CgroupPlugin=autodetect\nIgnoreSystemd=yes\n")

    def _slurm_conf(self, prolog: str) -> str:
        s = self.state
        nodes = "".join(f"NodeName={n} NodeAddr={self.addrs[n]} CPUs={NODE_CPUS} RealMemory=2000 Gres=gpu:{NODE_GPUS} State=UNKNOWN\n"
                        for n in NODES)
        return f"""ClusterName=ddphelpers
GresTypes=gpu
SlurmctldHost=ctl({self.addrs['ctl']})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
StateSaveLocation={s}/ctl
SlurmdSpoolDir={s}/%n/spool
SlurmctldPidFile={s}/ctl/slurmctld.pid
SlurmdPidFile={s}/%n/slurmd.pid
SlurmctldLogFile={s}/ctl/slurmctld.log
SlurmdLogFile={s}/%n/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/pgid
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/builtin
SchedulerParameters=batch_sched_delay=0
MailProg=/bin/true
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
TaskProlog={prolog}
ReturnToService=2
SlurmctldTimeout=10
SlurmdTimeout=10
MessageTimeout=5
TCPTimeout=2
KillWait=2
UnkillableStepTimeout=10
InactiveLimit=0
MinJobAge=300
Waittime=0
{nodes}PartitionName=debug Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""

    def _network(self) -> None:
        ip = _which("ip")

        def run(*args: str) -> None:
            out = subprocess.run([ip, *args], capture_output=True, text=True, timeout=10)
            if out.returncode:  # no CAP_NET_ADMIN / CAP_SYS_ADMIN (a container), no bridge module
                raise Unavailable(f"can't make the test cluster's network here: ip {' '.join(args)}: "
                                  f"{out.stderr.strip()}")

        run("link", "add", self.bridge, "type", "bridge")
        run("addr", "add", f"{self.addrs['host']}/24", "dev", self.bridge)
        run("link", "set", self.bridge, "up")
        for host in ("ctl", *NODES):
            ns, outside = self._ns(host), f"{self.name}-{host}-v"[:15]
            run("netns", "add", ns)
            run("link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", ns)
            run("link", "set", outside, "master", self.bridge)
            run("link", "set", outside, "up")
            run("-n", ns, "addr", "add", f"{self.addrs[host]}/24", "dev", "eth0")
            run("-n", ns, "link", "set", "eth0", "up")
            run("-n", ns, "link", "set", "lo", "up")  # and no default route: unknown names fail at once

    def _start_munge(self) -> None:
        d = os.path.join(self.state, "munge")
        cmd = [_which("munged"), "--force", f"--socket={self.munge_socket}", f"--key-file={d}/munge.key",
               f"--pid-file={d}/munged.pid", f"--log-file={d}/munged.log", f"--seed-file={d}/munged.seed"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20)  # forks into the background
        if out.returncode:
            raise RuntimeError(f"munged did not start: {out.stderr.strip()}")

    def _daemon(self, host: str, cmd: List[str]) -> None:
        """Start a slurm daemon (it forks into the background) in host's network, hostname and hosts file."""
        inner = f"hostname {host} && mount --bind {self.state}/hosts /etc/hosts && exec \"$@\""
        full = [_which("nsenter"), f"--net={self._netns(host)}", _which("unshare"), "--uts", "--mount",
                "sh", "-c", inner, "sh", *cmd]
        env = self.env()
        env.pop("TMPDIR", None)
        out = subprocess.run(full, capture_output=True, text=True, timeout=20, env=env, cwd=self.state)
        if out.returncode:
            raise RuntimeError(f"{os.path.basename(cmd[0])} on {host} did not start: {out.stderr.strip()}\n"
                               f"{self.logs()}")


def _read_pid(path: str) -> Optional[int]:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def main(argv: Optional[List[str]] = None) -> int:
    """start | stop | status | env."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("action", choices=("start", "stop", "status", "env"))
    p.add_argument("--force", action="store_true", help="stop even while a test session uses the cluster")
    args = p.parse_args(argv)
    cluster = SlurmCluster()
    if args.action == "env":
        print(f"export SLURM_CONF={cluster.conf}")
        return 0
    if args.action == "status":
        up = cluster.status()
        print(f"{cluster.name}: {'up' if up else 'down'} ({cluster.state})")
        return 0 if up else 1
    if args.action == "stop":
        if cluster.in_use() and not args.force:
            print(f"{cluster.name} is in use by a test session: not stopped (--force stops it anyway; "
                  "DDP_HELPERS_SLURM_NAME=other starts a cluster of your own)", file=sys.stderr)
            return 1
        print(f"stopped in {cluster.stop():.2f} s")
        return 0
    try:
        took = cluster.start()
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"up in {took:.2f} s: {cluster.state} (SLURM_CONF={cluster.conf})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
