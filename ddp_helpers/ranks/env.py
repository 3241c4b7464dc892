"""A rank's environment from its launcher: torchrun's contract, the variables a rank reads, set the same way for
the ranks launch() starts, and read from SLURM's where torchrun's are absent (a task of `srun`).

SLURM's environment as a way into a rank: under `srun -N2 --ntasks-per-node=1 python -m ddp_helpers.train`, each
task is a rank: SLURM_PROCID is its rank, SLURM_NTASKS the world size, SLURM_LOCALID its rank on the node, the
node's entry of SLURM_STEP_TASKS_PER_NODE (or SLURM_TASKS_PER_NODE, SLURM_NTASKS_PER_NODE; compressed as
`2(x3),1`) the ranks on its node, the first host of the step's node list (`node[1-3,5]`, expanded) the rendezvous
address, and a port derived from the job id (`rendezvous_port`: the sbatch template in examples/slurm/ computes
the same). A batch script (no SLURM_STEP_ID) and a one-task step are not ranks: there the command line starts its
ranks itself. And which GPU a rank drives (`GpuLayout`): the one rule for every way into a rank.
Standard library only (torch when GPUs are counted).
"""
from __future__ import annotations

import importlib
import os
import re
from dataclasses import dataclass
from typing import Dict, List, Mapping, MutableMapping, Optional, Tuple

from ..common.errors import ConfigError, refused, setting

REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")  # LOCAL_RANK, LOCAL_WORLD_SIZE: one node if unset


@dataclass(frozen=True)
class RankEnv:
    """Who this process is in the job, as torchrun tells it."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> "RankEnv":
        """Read the variables (torchrun's, else an srun task's); a missing one is named, with the ways to set it."""
        if not under_torchrun(environ):
            environ = {**environ, **scheduler_env(environ)}
        missing = [k for k in REQUIRED if k not in environ]
        if missing:
            raise RuntimeError(f"{', '.join(missing)} not set: start this process with torchrun, as one of "
                               "several tasks of srun, or with ddp_helpers.launch, which sets torchrun's variables "
                               "for every rank")
        rank, world_size = int(environ["RANK"]), int(environ["WORLD_SIZE"])
        return cls(rank, int(environ.get("LOCAL_RANK", rank)), world_size,
                   int(environ.get("LOCAL_WORLD_SIZE", world_size)), environ["MASTER_ADDR"], int(environ["MASTER_PORT"]))


def under_torchrun(environ: Mapping[str, str] = os.environ) -> bool:
    """True in a process started with torchrun's variables (by torchrun, or a scheduler that sets the same)."""
    return all(k in environ for k in REQUIRED)


def scheduler_env(environ: Mapping[str, str] = os.environ) -> Dict[str, str]:
    """torchrun's variables as SLURM tells them to a task of an srun step of several tasks; {} elsewhere (outside
    SLURM, in a batch script, in a one-task step, where the command line starts its ranks itself)."""
    task = SlurmTask.from_environ(environ)
    if task is None or task.world_size < 2:
        return {}
    return task.torchrun_env(environ)


def adopt_scheduler_env(environ: MutableMapping[str, str] = os.environ) -> bool:
    """Set torchrun's variables from SLURM's where torchrun's are absent, so that everything after (the command
    line's checks, env:// in init_process_group) sees one contract; torchrun's win where both are set (torchrun
    inside an allocation). True when it set them."""
    if under_torchrun(environ):
        return False
    found = scheduler_env(environ)
    environ.update(found)
    return bool(found)


def launched_env(world_size: int, host: str, port: int, run_id: str, threads: int,
                 environ: Mapping[str, str] = os.environ) -> Dict[str, str]:
    """What torchrun's agent sets alike for every worker on a single node (local_elastic_agent.py,
    _start_workers; rank_env adds each rank's own).

    TORCHELASTIC_USE_AGENT_STORE with MASTER_ADDR:MASTER_PORT tells init_process_group that a store already
    serves there (our parent's, as torchrun's agent's does), so every rank joins it as a client
    (torch.distributed.rendezvous._create_c10d_store). OMP_NUM_THREADS, unless set, is the ranks' share of the
    cores (torchrun's run.py sets 1 for more than one process per node; each rank also sets torch's own count).
    """
    return {
        "ROLE_NAME": "default", "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": host, "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        "OMP_NUM_THREADS": environ.get("OMP_NUM_THREADS", str(threads)),
    }


def gate_agent_store_flag() -> None:
    """Honour TORCHELASTIC_USE_AGENT_STORE (launched_env) only at MASTER_ADDR:MASTER_PORT, as newer torch does.

    A newer rendezvous._create_c10d_store asks _agent_store_serves(hostname, port) (since which release:
    docs/maintainers.md, "Version notes"); before it, the flag made
    every endpoint a client-only store, so a rank's own init_process_group("tcp://host:other_port") waited for a
    server nobody starts (notebook 01's launch(init_group=False) cell). Called in a rank before an fn's own init.
    """
    # the module: torch.distributed's own name `rendezvous` is a function; a rank has torch loaded already
    rendezvous = importlib.import_module("torch.distributed.rendezvous")

    if hasattr(rendezvous, "_agent_store_serves") or getattr(rendezvous, "_ddp_helpers_gated", False):
        return
    create = rendezvous._create_c10d_store

    def gated(hostname, port, *args, **kwargs):
        if (os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")) == (hostname, str(port)):
            return create(hostname, port, *args, **kwargs)
        flag = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
        try:
            return create(hostname, port, *args, **kwargs)
        finally:
            if flag is not None:
                os.environ["TORCHELASTIC_USE_AGENT_STORE"] = flag

    rendezvous._create_c10d_store, rendezvous._ddp_helpers_gated = gated, True


def rank_env(rank: int) -> Dict[str, str]:
    """What torchrun's agent sets for one worker of a single node: its ranks (global, local, in its role; the
    node is group 0)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank), "GROUP_RANK": "0"}


@dataclass(frozen=True)
class RankSpec:
    """What launch() tells every rank besides its function (stdlib only: a spawned rank unpickles it before its
    parent watch runs, so importing torch here would leave a rank alive seconds after a killed parent)."""

    environ: Dict[str, str]  # the launcher's environment when it launched (the ranks start from it)
    env: Dict[str, str]  # torchrun's variables shared by every rank (rank_env adds each rank's own)
    run_dir: str  # where each rank leaves its log, its report and its rows (ranks/folders.py)
    backend: str
    timeout_s: float
    threads: int
    bind_cores: Optional[bool]
    init_group: bool


# --- SLURM's variables read as torchrun's ---

PORT_BASE, PORT_SPAN = 15000, 17000  # ports 15000-31999: above the usual services, below Linux's ephemeral range
_HOST_ITEM = re.compile(r"([^\[\]]*)\[([^\[\]]+)\](.*)")
_TASKS_ITEM = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def expand_hostlist(text: str) -> List[str]:
    """SLURM's compressed host list expanded, in order: `node[1-3,5]` -> node1 node2 node3 node5, `a[01-02],b3`
    -> a01 a02 b3 (a range keeps its lower bound's zero padding); several brackets multiply (`r[1-2]n[1-2]`)."""
    hosts: List[str] = []
    for item in _split_outside_brackets(text):
        hosts.extend(_expand_item(item, text))
    if not hosts:
        raise ValueError(f"empty SLURM host list {text!r}")
    return hosts


def _split_outside_brackets(text: str) -> List[str]:
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if depth not in (0, 1):
            raise ValueError(f"unbalanced brackets in SLURM host list {text!r}")
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"unbalanced brackets in SLURM host list {text!r}")
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def _expand_item(item: str, whole: str) -> List[str]:
    m = _HOST_ITEM.fullmatch(item)
    if m is None:
        if "[" in item or "]" in item:
            raise ValueError(f"can't read {item!r} in SLURM host list {whole!r}")
        return [item]
    prefix, ranges, rest = m.groups()
    tails = _expand_item(rest, whole) if rest else [""]
    heads = []
    for part in ranges.split(","):
        low, dash, high = part.strip().partition("-")
        if not low.isdigit() or (dash and not high.isdigit()) or (dash and int(high) < int(low)):
            raise ValueError(f"can't read the range {part!r} in SLURM host list {whole!r}")
        heads += [f"{prefix}{n:0{len(low)}d}" for n in range(int(low), int(high or low) + 1)]
    return [head + tail for head in heads for tail in tails]


def expand_tasks_per_node(text: str) -> List[int]:
    """SLURM's tasks-per-node list expanded: `2(x3),1` -> [2, 2, 2, 1]."""
    counts: List[int] = []
    for item in text.split(","):
        m = _TASKS_ITEM.fullmatch(item.strip())
        if m is None:
            raise ValueError(f"can't read {item!r} in SLURM's tasks per node {text!r} (expected N or N(xK))")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def rendezvous_port(job_id: str) -> int:
    """The rendezvous port of a job: PORT_BASE + job id mod PORT_SPAN, the same on every node without talking
    (two steps of one job running at once would need MASTER_PORT set apart)."""
    return PORT_BASE + int(job_id) % PORT_SPAN


@dataclass(frozen=True)
class SlurmJob:
    """Which SLURM job, step and attempt this process belongs to (set in a batch script and in every task)."""

    job_id: str
    step_id: Optional[str]  # None in the batch script itself
    restart_count: int  # how many times SLURM requeued the job: 0 in its first run

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Optional["SlurmJob"]:
        """The job this process runs in, or None outside SLURM."""
        job_id = environ.get("SLURM_JOB_ID") or environ.get("SLURM_JOBID")
        if not job_id:
            return None
        step = environ.get("SLURM_STEP_ID") or environ.get("SLURM_STEPID")
        return cls(job_id, step, _int(environ, "SLURM_RESTART_COUNT", "0"))


@dataclass(frozen=True)
class SlurmTask:
    """One task of an srun step, as SLURM describes it."""

    job: SlurmJob
    rank: int  # SLURM_PROCID
    world_size: int  # the step's tasks
    local_rank: int  # SLURM_LOCALID
    node_rank: int  # SLURM_NODEID
    tasks_per_node: Tuple[int, ...]
    hosts: Tuple[str, ...]  # the step's nodes, expanded

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Optional["SlurmTask"]:
        """This process's task, or None outside an srun step (a batch script has no SLURM_STEP_ID)."""
        job = SlurmJob.from_environ(environ)
        if job is None or job.step_id is None or "SLURM_PROCID" not in environ:
            return None
        nodelist = _first(environ, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        per_node = _first(environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
        world = _first(environ, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
        try:
            counts = tuple(expand_tasks_per_node(per_node)) if per_node else ()
            hosts = tuple(expand_hostlist(nodelist)) if nodelist else ()
        except ValueError as e:
            raise ValueError(f"{e}: SLURM's variables can't say this task's rank") from None
        world_size = int(world) if world and world.isdigit() else (sum(counts) or 1)
        return cls(job, _int(environ, "SLURM_PROCID"), world_size, _int(environ, "SLURM_LOCALID", "0"),
                   _int(environ, "SLURM_NODEID", "0"), counts, hosts)

    @property
    def local_world_size(self) -> int:
        """The step's tasks on this task's node."""
        if not self.tasks_per_node:
            return 1
        return self.tasks_per_node[min(self.node_rank, len(self.tasks_per_node) - 1)]

    def torchrun_env(self, environ: Mapping[str, str]) -> Dict[str, str]:
        """torchrun's variables for this task; MASTER_ADDR and MASTER_PORT already set are kept (a user's choice)."""
        addr = environ.get("MASTER_ADDR") or (self.hosts[0] if self.hosts else None)
        if not addr:
            raise ValueError("SLURM_JOB_NODELIST not set: set MASTER_ADDR to the host of rank 0")
        port = environ.get("MASTER_PORT") or str(rendezvous_port(self.job.job_id))
        return {"RANK": str(self.rank), "LOCAL_RANK": str(self.local_rank), "WORLD_SIZE": str(self.world_size),
                "LOCAL_WORLD_SIZE": str(self.local_world_size), "GROUP_RANK": str(self.node_rank),
                "MASTER_ADDR": addr, "MASTER_PORT": port}


def _first(environ: Mapping[str, str], *names: str) -> Optional[str]:
    return next((environ[n] for n in names if environ.get(n)), None)


def _int(environ: Mapping[str, str], name: str, default: Optional[str] = None) -> int:
    text = environ.get(name, default)
    try:
        return int(text)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name}={text!r} is not a number: SLURM's variables can't say this task's rank") from None


# ---------------------------------------------------------------- which GPU a rank drives
# The one rule for every way into a rank (launch(), run_training, torchrun, srun's and submitit's tasks). A rank
# finds its GPU among those it sees (CUDA_VISIBLE_DEVICES decides which, numbered from 0). Every rank of a node
# sees the node's GPUs (launch(), torchrun's workers, srun --gpus-per-node=N): local rank i takes cuda:i, as
# torch's launch utility documents ("from GPU 0 to GPU (nproc_per_node - 1)"). SLURM shows each task GPUs of its
# own (--gpus-per-task=1, --gpu-bind=single:1): cuda:0 in every task, while LOCAL_RANK counts on (cuda:<LOCAL_RANK>
# would be "invalid device ordinal"). The ranks one process starts inherit its view, so one GPU there is one GPU
# shared; a layout that leaves some rank no GPU of its own is refused with the settings that fix it.


def visible_gpus() -> int:
    """The GPUs this process sees (0 without CUDA)."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def own_views(environ: Mapping[str, str] = os.environ) -> bool:
    """True in a task SLURM started as a rank of its own (srun's, submitit's), whose GPUs may be its own; False
    under torchrun's agent or launch(), whose ranks share their starter's view (both set TORCHELASTIC_RUN_ID)."""
    return "TORCHELASTIC_RUN_ID" not in environ and SlurmTask.from_environ(environ) is not None


@dataclass(frozen=True)
class GpuLayout:
    """What a node's ranks see of its GPUs: how many each sees, how many ranks, and whether each has its own view."""

    visible: int  # GPUs this process sees
    local_world_size: int  # ranks on this node
    own_views: bool = False  # each rank sees GPUs of its own (SLURM's tasks), not its starter's
    node_gpus: Optional[int] = None  # SLURM_GPUS_ON_NODE: the GPUs the step holds on this node (SLURM's tasks)
    devices: Optional[str] = None  # CUDA_VISIBLE_DEVICES as set (None: unset)

    @classmethod
    def of_rank(cls, environ: Mapping[str, str] = os.environ, rank: int = 0) -> "GpuLayout":
        """This rank's layout, from torchrun's variables (an srun task's read as them: ranks/env.py)."""
        if under_torchrun(environ) and "LOCAL_WORLD_SIZE" in environ:
            ranks = int(environ["LOCAL_WORLD_SIZE"])
        else:
            task = SlurmTask.from_environ(environ)
            ranks = task.local_world_size if task is not None else int(environ.get("WORLD_SIZE", rank + 1))
        own = own_views(environ)
        held = environ.get("SLURM_GPUS_ON_NODE", "")
        return cls(visible_gpus(), ranks, own, int(held) if own and held.isdigit() else None,
                   environ.get("CUDA_VISIBLE_DEVICES"))

    @property
    def listed(self) -> Optional[int]:
        """How many devices CUDA_VISIBLE_DEVICES names (None: unset)."""
        return None if self.devices is None else len([d for d in self.devices.split(",") if d.strip()])

    @property
    def own_gpus(self) -> bool:
        """Each rank sees GPUs of its own: SLURM's tasks, each shown what CUDA_VISIBLE_DEVICES lists, the step
        holding that many on the node for every task (--gres=gpu:1 for two tasks shows both the same GPU 0; no
        SLURM_GPUS_ON_NODE: the step holds none; under MIG a process sees one of the instances listed)."""
        return (self.own_views and self.visible >= 1 and self.listed == self.visible and self.node_gpus is not None
                and self.node_gpus >= self.visible * self.local_world_size)

    @property
    def fits(self) -> bool:
        """Every rank of the node has a GPU of its own."""
        return self.own_gpus or self.visible >= self.local_world_size

    def index(self, local_rank: int, owner: str = "TrainConfig") -> int:
        """The GPU (cuda:<index>) of the rank numbered local_rank on its node; ConfigError where it has none."""
        if self.own_gpus:
            return 0  # SLURM showed this task GPUs of its own: the first is cuda:0 inside it
        if self.visible >= self.local_world_size:
            return local_rank  # every rank sees the node's GPUs: the i-th rank takes the i-th
        raise self.refusal(owner)

    def refusal(self, owner: str = "TrainConfig") -> ConfigError:
        """backend='nccl' refused for this layout, with what to ask instead."""
        n, ranks = self.visible, self.local_world_size
        if n == 0:
            return refused("backend", "nccl", f"nccl needs CUDA GPUs and none is visible; use "
                                              f"{setting('backend', 'gloo')} (CPU) or 'auto'", owner)
        shown = f" (CUDA_VISIBLE_DEVICES={self.devices!r})" if self.devices is not None else ""
        if self.own_views:
            how = (f"this node's {ranks} ranks (SLURM's tasks, LOCAL_WORLD_SIZE={ranks}) {self._task_view(shown)}. "
                   f"Ask SLURM for --gpus-per-node={ranks} (every task sees the node's GPUs; a rank takes "
                   "cuda:<local rank>) or --gpus-per-task=1 (each task sees its own GPU as cuda:0)")
        else:
            how = (f"this node's {ranks} ranks (LOCAL_WORLD_SIZE={ranks}) share the {n} GPU(s) they all see{shown}, "
                   "as torchrun's workers inherit its view: give the task that runs torchrun the node's GPUs "
                   f"(SLURM: --gpus-per-node={ranks}, not --gpus-per-task=1) or start {n} rank(s) per node "
                   f"(torchrun --nproc-per-node={n})")
        return ConfigError(f"{setting('backend', 'nccl', owner=owner)} is not accepted: nccl needs one GPU per rank, "
                           f"and {how}; or use {setting('backend', 'gloo')} (CPU)")

    def _task_view(self, shown: str) -> str:
        """What SLURM's tasks see that leaves some of them no GPU of their own."""
        n = self.visible
        if self.listed is not None and self.listed != n:
            return (f"each see {n} of the {self.listed} devices CUDA_VISIBLE_DEVICES lists{shown} (under MIG a "
                    "process sees one instance), so no task can tell which is its own")
        if self.node_gpus is None:
            return (f"each see {n} GPU(s){shown} that SLURM did not give the step (no SLURM_GPUS_ON_NODE), "
                    "so they may all be the same")
        return (f"share the {self.node_gpus} GPU(s) the step holds on it (SLURM_GPUS_ON_NODE={self.node_gpus}), "
                f"each seeing {n}{shown}")


def rank_gpu(rank: int, environ: Mapping[str, str] = os.environ) -> int:
    """This rank's GPU index (cuda:<index>), by GpuLayout's rule, from its environment (LOCAL_RANK, else rank)."""
    return GpuLayout.of_rank(environ, rank).index(int(environ.get("LOCAL_RANK", rank)))
