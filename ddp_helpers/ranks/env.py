"""torchrun's environment contract: the variables a rank reads, set the same way for the ranks launch() starts."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, Mapping, Optional

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
        """Read the variables; a missing one is named, with the two ways to set it."""
        missing = [k for k in REQUIRED if k not in environ]
        if missing:
            raise RuntimeError(f"{', '.join(missing)} not set: start this process with torchrun, or with "
                               "ddp_helpers.launch, which sets torchrun's variables for every rank")
        rank, world_size = int(environ["RANK"]), int(environ["WORLD_SIZE"])
        return cls(rank, int(environ.get("LOCAL_RANK", rank)), world_size,
                   int(environ.get("LOCAL_WORLD_SIZE", world_size)), environ["MASTER_ADDR"], int(environ["MASTER_PORT"]))


def under_torchrun(environ: Mapping[str, str] = os.environ) -> bool:
    """True in a process started with torchrun's variables (by torchrun, or a scheduler that sets the same)."""
    return all(k in environ for k in REQUIRED)


def launched_env(rank: int, world_size: int, host: str, port: int, run_id: str) -> Dict[str, str]:
    """What torchrun's agent sets for a worker on a single node (local_elastic_agent.py, _start_workers).

    TORCHELASTIC_USE_AGENT_STORE with MASTER_ADDR:MASTER_PORT tells init_process_group that a store already
    serves there (our parent's, as torchrun's agent's does), so every rank joins it as a client
    (torch.distributed.rendezvous._create_c10d_store).
    """
    return {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
        "ROLE_NAME": "default", "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
        "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": host, "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }


@dataclass(frozen=True)
class RankSpec:
    """What launch() tells every rank besides its function (stdlib only: a spawned rank unpickles it before its
    parent watch runs, so importing torch here would leave a rank alive seconds after a killed parent)."""

    env: Dict[str, str]  # torchrun's variables, but RANK and LOCAL_RANK (set per rank)
    log_dir: str
    backend: str
    timeout_s: float
    threads: int
    bind_cores: Optional[bool]
    init_group: bool
