"""torchrun's environment contract: the variables a rank reads, set the same way for the ranks launch() starts,
and read from SLURM's where torchrun's are absent (a task of `srun`: ranks/slurm.py)."""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from typing import Dict, Mapping, MutableMapping, Optional

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
    from .slurm import SlurmTask

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
    run_dir: str  # where each rank leaves its log, its report and its rows (ranks/outbox.py)
    backend: str
    timeout_s: float
    threads: int
    bind_cores: Optional[bool]
    init_group: bool
