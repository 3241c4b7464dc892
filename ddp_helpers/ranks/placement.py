"""Where the ranks will run, checked before any starts: the rendezvous address, the backend and its devices,
threads per rank and core binding. Probes of this machine (its network, GPUs and cores); torch only when asked
about GPUs."""
from __future__ import annotations

import math
import os
import socket
from typing import Any, Optional

from ..common.errors import ConfigError
from .cores import binding_plan, cpu_budget


def _bad(setting: str, value: Any, accepted: str) -> ConfigError:
    """setting is a template with {} where the value goes, e.g. "launch(port={})" or "TrainConfig.master_port={}"."""
    return ConfigError(f"{setting.format(repr(value))} is not accepted: {accepted}")


def resolve_backend(backend: str, world_size: int) -> str:
    """'auto' -> nccl when CUDA has at least world_size GPUs, else gloo; checks that nccl can place the ranks."""
    import torch

    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if n_gpus >= world_size else "gloo"
    if backend == "nccl":
        if n_gpus == 0:
            raise _bad("TrainConfig.backend={}", "nccl", "nccl needs CUDA GPUs and none is visible; use "
                                                          "backend='gloo' (CPU) or 'auto'")
        if world_size > n_gpus:
            raise ConfigError(
                f"TrainConfig.world_size={world_size} is not accepted with backend='nccl': only {n_gpus} GPU(s) are "
                f"visible and nccl needs one GPU per rank (two ranks on one GPU are refused); use world_size<={n_gpus}, "
                "or backend='gloo'")
    return backend


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free on host right now (another program may still take it before it is used)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


WILDCARDS = ("0.0.0.0", "::", "")  # "every interface": a store there is reachable from the whole network


def check_address(host: str, port: int, host_setting: str = "TrainConfig.master_addr={}",
                  port_setting: str = "TrainConfig.master_port={}") -> None:
    """Refuse a host that doesn't resolve, is a wildcard or isn't this machine's (the launch serves the store
    there itself), or an explicit port already in use; named as the caller spells them."""
    if host in WILDCARDS:
        raise _bad(host_setting, host, "an address of this machine that the ranks reach, such as '127.0.0.1' (a "
                                       "wildcard address would listen on every interface, open to the network)")
    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET)
    except (socket.gaierror, UnicodeError) as e:
        raise _bad(host_setting, host, f"a resolvable host such as '127.0.0.1' ({e})") from None
    addr = infos[0][4][0]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, 0))
        except OSError as e:
            raise _bad(host_setting, host, f"an address of this machine ({addr} is not: {e.strerror}); the launch "
                                           "serves the rendezvous itself, so it listens here: use '127.0.0.1' for "
                                           "one machine (several machines start with torchrun)") from None
    if port == 0:
        return
    fix = port_setting.rsplit(".", 1)[-1].format(0)  # "master_port=0" or "launch(port=0)"
    if port < 1024 and hasattr(os, "geteuid") and os.geteuid() != 0:
        raise _bad(port_setting, port, f"a port >= 1024 (lower ones need root), or {fix} for a free one")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, port))
        except OSError as e:
            raise _bad(port_setting, port, f"a free port; {host}:{port} can't be bound ({e.strerror}). Use {fix} "
                                           "to let the OS choose one") from None


def check_timeout(timeout_s: float, setting: str = "TrainConfig.timeout_s={}") -> None:
    """Refuse a collective timeout that is not a finite number of seconds from 1 to a day."""
    ok = isinstance(timeout_s, (int, float)) and not isinstance(timeout_s, bool) and math.isfinite(timeout_s)
    if not ok or not 1 <= timeout_s <= 86400:
        raise _bad(setting, timeout_s, "seconds, a number from 1 to 86400 (e.g. 60): how long a collective waits "
                                       "for a peer before it fails")


def default_threads(world_size: int) -> int:
    """Torch threads per CPU rank so that the ranks together don't oversubscribe the cores (or the CPU quota)."""
    return max(1, cpu_budget() // world_size)


def check_binding(world_size: int, threads: int, backend: str, bind_cores: Optional[bool],
                  setting: str = "TrainConfig.bind_cores={}") -> None:
    """Refuse bind_cores=True where the ranks can't each have cores of their own (the plan says why)."""
    try:
        binding_plan(world_size, threads, backend, bind_cores)  # each rank makes the same plan for itself
    except ValueError as e:
        raise _bad(setting, bind_cores, f"None (bind when possible) or False here: {e}") from None
