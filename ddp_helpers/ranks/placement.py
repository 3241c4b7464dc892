"""Where the ranks will run, checked before any starts: the rendezvous address, the backend and its devices,
threads per rank and core binding. Probes of this machine (its network, GPUs and cores); torch only when asked
about GPUs."""
from __future__ import annotations

import math
import os
import socket
from typing import Optional, Tuple

from ..common.errors import ConfigError, refused, setting
from .cores import binding_plan, cpu_budget


def resolve_backend(backend: str, world_size: int) -> str:
    """'auto' -> nccl when CUDA has at least world_size GPUs, else gloo; checks that nccl can place the ranks."""
    if backend == "gloo":
        return backend  # nothing to ask torch: a launcher without torch imported stays so
    import torch

    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if n_gpus >= world_size else "gloo"
    if backend == "nccl":
        if n_gpus == 0:
            raise refused("backend", "nccl", f"nccl needs CUDA GPUs and none is visible; use "
                                             f"{setting('backend', 'gloo')} (CPU) or 'auto'")
        if world_size > n_gpus:
            raise ConfigError(
                f"{setting('world_size', world_size, owner='TrainConfig')} is not accepted with "
                f"{setting('backend', 'nccl')}: only {n_gpus} GPU(s) are visible and nccl needs one GPU per rank (two "
                f"ranks on one GPU are refused); use {setting('world_size')}<={n_gpus}, or "
                f"{setting('backend', 'gloo')}")
    return backend


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free on host right now (another program may still take it before it is used)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


WILDCARDS = ("0.0.0.0", "::", "")  # "every interface": a store there is reachable from the whole network


def check_address(host: str, port: int, owner: str = "TrainConfig",
                  names: Tuple[str, str] = ("master_addr", "master_port")) -> None:
    """Refuse a host that doesn't resolve, is a wildcard or isn't this machine's (the launch serves the store
    there itself), or an explicit port already in use; named as the caller spells them (owner, names)."""
    host_name, port_name = names
    if host in WILDCARDS:
        raise refused(host_name, host, "an address of this machine that the ranks reach, such as '127.0.0.1' (a "
                      "wildcard address would listen on every interface, open to the network)", owner)
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET)
    except (socket.gaierror, UnicodeError) as e:
        raise refused(host_name, host, f"a resolvable host such as '127.0.0.1' ({e})", owner) from None
    addr = infos[0][4][0]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, 0))
        except OSError as e:
            raise refused(host_name, host, f"an address of this machine ({addr} is not: {e.strerror}); the launch "
                          "serves the rendezvous itself, so it listens here: use '127.0.0.1' for one machine (several "
                          "machines start with torchrun)", owner) from None
    if port == 0:
        return
    fix = setting(port_name, 0, owner=owner if owner.endswith("()") else "")  # master_port=0 or launch(port=0)
    if port < 1024 and hasattr(os, "geteuid") and os.geteuid() != 0:
        raise refused(port_name, port, f"a port >= 1024 (lower ones need root), or {fix} for a free one", owner)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, port))
        except OSError as e:
            raise refused(port_name, port, f"a free port; {host}:{port} can't be bound ({e.strerror}). Use {fix} "
                          "to let the OS choose one (see notebook 13, "
                          "#2-the-server-socket-has-failed-to-listen-address-already-in-use)", owner) from None


def check_timeout(timeout_s: float, owner: str = "TrainConfig") -> None:
    """Refuse a collective timeout that is not a finite number of seconds from 1 to a day."""
    ok = isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool) and math.isfinite(timeout_s)
    if not ok or not 1 <= timeout_s <= 86400:
        raise refused("timeout_s", timeout_s, "seconds, a number from 1 to 86400 (e.g. 60): how long a collective "
                      "waits for a peer before it fails", owner)


def default_threads(world_size: int) -> int:
    """Torch threads per CPU rank so that the ranks together don't oversubscribe the cores (or the CPU quota)."""
    return max(1, cpu_budget() // world_size)


def check_binding(world_size: int, threads: int, backend: str, bind_cores: Optional[bool],
                  owner: str = "TrainConfig") -> None:
    """Refuse bind_cores=True where the ranks can't each have cores of their own (the plan says why)."""
    try:
        binding_plan(world_size, threads, backend, bind_cores)  # each rank makes the same plan for itself
    except ValueError as e:
        raise refused("bind_cores", bind_cores, f"None (bind when possible) or False here: {e}", owner) from None
