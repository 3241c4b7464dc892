"""Where a torchrun or SLURM job's ranks run, and who stopped it: each rank's host, interface and address (one
line per node at start, and in result.json), the job and attempt a run folder and a partial result belong to,
and the scheduler named when it stopped the job (scancel, a time limit, preemption)."""
from __future__ import annotations

import os
import socket
import subprocess
from typing import Any, Dict, List, Mapping, Optional

# Job states in which SLURM's SIGTERM is the scheduler ending the job, not srun or torchrun's agent stopping a
# step after a peer failed (scontrol show job's JobState, job_state_string in slurm's
# src/common/slurm_protocol_defs.c). While the steps are being signalled, a cancelled or timed-out job reads
# COMPLETING (the flag wins over its base state: seen on the test cluster with scancel).
_STOPPED = ("COMPLETING", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "DEADLINE", "BOOT_FAIL", "REQUEUED", "FAILED",
            "OUT_OF_MEMORY", "SUSPENDED")


def attempt_counts(environ: Mapping[str, str] = os.environ) -> tuple:
    """(SLURM requeues, torchrun restarts) of this job so far: SLURM_RESTART_COUNT, TORCHELASTIC_RESTART_COUNT."""
    return int(environ.get("SLURM_RESTART_COUNT") or 0), int(environ.get("TORCHELASTIC_RESTART_COUNT") or 0)


def attempt_label(environ: Mapping[str, str] = os.environ) -> str:
    """This attempt's name: the torchrun restart ('2'), the SLURM requeue ('1'), or both ('1.2')."""
    requeues, restarts = attempt_counts(environ)
    return f"{requeues}.{restarts}" if requeues and restarts else str(requeues or restarts)


def attempts_named(environ: Mapping[str, str] = os.environ) -> bool:
    """Can this attempt be followed or preceded by another of the same job (so its files carry its name)?"""
    requeues, restarts = attempt_counts(environ)
    return int(environ.get("TORCHELASTIC_MAX_RESTARTS") or 0) > 0 or requeues > 0 or restarts > 0


def slurm_job(environ: Mapping[str, str] = os.environ) -> Dict[str, str]:
    """SLURM's names for this job (empty outside SLURM): its id, step, requeue count and node list."""
    keys = {"job_id": "SLURM_JOB_ID", "step_id": "SLURM_STEP_ID", "restart_count": "SLURM_RESTART_COUNT",
            "nodelist": "SLURM_JOB_NODELIST"}
    return {k: environ[v] for k, v in keys.items() if environ.get(v)}


def job_key(master_addr: str, master_port: int, environ: Mapping[str, str] = os.environ) -> str:
    """What names one job's run folders and partial results: torchrun's run id, the rendezvous endpoint, and
    SLURM's job and step where set (two steps of one allocation may reuse an endpoint one after the other)."""
    parts = [environ.get("TORCHELASTIC_RUN_ID", ""), master_addr, str(master_port)]
    slurm = slurm_job(environ)
    if slurm.get("job_id"):
        parts.append(f"j{slurm['job_id']}.{slurm.get('step_id', '')}")
    return "".join(c if c.isalnum() or c in "-._" else "_" for c in "-".join(parts))


def this_place(master_addr: str, master_port: int) -> Dict[str, Any]:
    """This process's host, and the interface and address it reaches the rendezvous host with."""
    from ..ranks.rank import interface_towards

    family = socket.AF_INET6 if ":" in master_addr else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((master_addr, master_port or 9))  # UDP: no packet is sent, the kernel only picks the route
            address = s.getsockname()[0]
        interface = os.environ.get("GLOO_SOCKET_IFNAME") or interface_towards(master_addr, master_port)
    except (OSError, RuntimeError):
        address, interface = "", ""
    return {"host": socket.gethostname(), "interface": interface, "address": address, "pid": os.getpid()}


def gather_places(rank: int, master_addr: str, master_port: int) -> List[Dict[str, Any]]:
    """Every rank's place (this_place), on every rank: a collective, so the group must exist."""
    import torch.distributed as dist

    places: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(places, dict(this_place(master_addr, master_port), rank=rank))
    return places


def node_line(places: List[Dict[str, Any]], host: str, rendezvous: str) -> str:
    """One line for the node `host`: its ranks, their interface and address, and where they met."""
    mine = [p for p in places if p.get("host") == host]
    where = sorted({f"{p.get('interface') or '?'} {p.get('address') or '?'}" for p in mine})
    return (f"node {host}: ranks {[p['rank'] for p in mine]} of {len(places)} on {', '.join(where)}; "
            f"rendezvous {rendezvous}")


def provenance(places: List[Dict[str, Any]], rendezvous: str, job: str,
               environ: Mapping[str, str] = os.environ) -> Dict[str, Any]:
    """What result.json records about where the job ran."""
    return {"launcher": "torchrun" if environ.get("TORCHELASTIC_RUN_ID") else "slurm" if environ.get("SLURM_JOB_ID")
            else "environment", "rendezvous": rendezvous, "job": job, "attempt": attempt_label(environ),
            "slurm": slurm_job(environ), "ranks": places}


def place_text(place: Optional[Dict[str, Any]]) -> str:
    """' (on host, address on interface)' for a rank whose place is known, else ''."""
    if not place or not place.get("host"):
        return ""
    return f" (on {place['host']}, {place.get('address') or '?'} on {place.get('interface') or '?'})"


def slurm_state(job_id: str, timeout_s: float = 3.0) -> Optional[str]:
    """The job's state as the scheduler has it now (scontrol show job), or None where it can't be asked."""
    try:
        out = subprocess.run(["scontrol", "-o", "show", "job", job_id], capture_output=True, text=True,
                             timeout=timeout_s).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for word in out.split():
        if word.startswith("JobState="):
            return word.split("=", 1)[1]
    return None


def scheduler_stop(environ: Mapping[str, str] = os.environ) -> Optional[str]:
    """Why SLURM stopped this job, when a SIGTERM came from it (scancel, a time limit, preemption, a failed
    node), else None. Under SLURM a SIGTERM is the scheduler's once the job has left RUNNING; a rank outside
    torchrun's agent gets SIGTERM from nothing else, so there an unreadable state is taken as the scheduler's."""
    job = environ.get("SLURM_JOB_ID")
    if not job:
        return None
    state = slurm_state(job)
    stopped = state is not None and state.startswith(_STOPPED)
    if not stopped and (state is not None or environ.get("TORCHELASTIC_RUN_ID")):
        return None
    return (f"the scheduler stopped the job: SLURM job {job} is {state or 'no longer running'} (scancel, a time "
            "limit, preemption, a failed node, or its batch script ended), and SLURM sent SIGTERM to every rank")
