"""Training settings (TrainConfig) and the checks that reject bad ones before any process starts."""
from __future__ import annotations

import dataclasses
import glob
import math
import os
import socket
from dataclasses import dataclass
from typing import Any, Optional, Tuple

from ..ranks.procs import binding_plan, cpu_budget

BACKENDS = ("auto", "gloo", "nccl")
DATASETS = ("mnist", "fashion-mnist", "mnist-5k")
PIPELINES = ("default", "seed")
COMM_HOOKS = ("allreduce", "fp16")
FAULT_KINDS = ("raise", "kill", "hang")
RESUME_LATEST = "latest"  # resume_from's value for "the newest checkpoint in checkpoint_dir, if there is one"


class ConfigError(ValueError):
    """A setting is out of range; the message names the setting, the value and what is accepted."""


@dataclass(frozen=True)
class TrainConfig:
    """Everything one DDP training run needs; defaults reproduce Listing 7.2 (minus its flaws)."""

    world_size: int = 2  # processes (ranks) to start; the listing uses one per GPU, here 2 by default
    backend: str = "auto"  # "auto": nccl when CUDA has >= world_size GPUs, else gloo on CPU
    dataset: str = "mnist"  # offline, "mnist" falls back to "mnist-5k", but only at the default data_root
    data_root: str = "~/.pytorch/MNIST_data/"  # the listing's path; torchvision's layout under it
    batch_size: int = 64  # per rank, so the global batch is batch_size * world_size
    lr: float = 0.01  # SGD learning rate, as in the listing
    momentum: float = 0.0  # 0 = the listing's plain SGD; >0 gives the optimizer state to checkpoint
    epochs: int = 1  # full passes over each rank's shard
    max_steps: Optional[int] = None  # stop after this many optimizer steps (None = all epochs)
    seed: int = 0  # model init and the sampler's shuffle; same seed -> identical run
    pipeline: str = "default"  # "default": shared pre-decoded tensors; "seed": the listing's DataLoader path
    accumulation_steps: int = 1  # micro-batches per optimizer step; all but the last skip the all-reduce (no_sync)
    comm_hook: str = "allreduce"  # "allreduce" (exact mean) or "fp16" (compressed: half the bytes, rounded)
    telemetry: bool = True  # record per-step losses, norms, fingerprints (off = the bare loop)
    capture_grad_steps: Tuple[int, ...] = (0,)  # steps whose full local and synced gradients are kept
    threads_per_rank: Optional[int] = None  # torch threads per CPU rank (None = usable CPUs // world_size)
    bind_cores: Optional[bool] = None  # give each CPU rank's training thread its own cores (None = if enough, no quota)
    master_addr: str = "127.0.0.1"  # where the rendezvous store listens; loopback keeps it private
    master_port: int = 0  # 0 = let the OS pick a free port at launch (no fixed-port collisions)
    timeout_s: float = 60.0  # collective timeout: a dead peer turns into an error, not a hang
    checkpoint_dir: Optional[str] = None  # rank 0 writes checkpoints here (None = no checkpoints)
    checkpoint_every: int = 0  # also checkpoint every N steps (0 = only at the end of the run)
    resume_from: Optional[str] = None  # checkpoint file to continue from, exactly ("latest": checkpoint_dir's newest)
    num_workers: int = 2  # DataLoader workers per rank, used by the "seed" pipeline only
    fault_rank: Optional[int] = None  # fault injection for lessons and tests: which rank fails
    fault_step: int = 0  # ... at which step
    fault_kind: str = "raise"  # ... how: "raise" an exception, "kill" itself (SIGKILL), "hang"

    def replace(self, **changes: Any) -> "TrainConfig":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """Plain JSON-able dict of the settings."""
        d = dataclasses.asdict(self)
        d["capture_grad_steps"] = list(self.capture_grad_steps)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TrainConfig":
        """Inverse of to_dict; unknown keys are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ConfigError(f"unknown TrainConfig field(s) {unknown}; known: {sorted(known)}")
        d = dict(d)
        if "capture_grad_steps" in d and d["capture_grad_steps"] is not None:
            d["capture_grad_steps"] = tuple(d["capture_grad_steps"])
        return cls(**d)


def _bad(name: str, value: Any, accepted: str) -> ConfigError:
    return ConfigError(f"TrainConfig.{name}={value!r} is not accepted: {accepted}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def check_types(cfg: TrainConfig) -> None:
    """Reject values of the wrong type or range (no machine facts needed)."""
    if not _is_int(cfg.world_size) or cfg.world_size < 1:
        raise _bad("world_size", cfg.world_size, "an int >= 1, e.g. world_size=2")
    if cfg.backend not in BACKENDS:
        raise _bad("backend", cfg.backend, f"one of {BACKENDS}")
    if cfg.dataset not in DATASETS:
        raise _bad("dataset", cfg.dataset, f"one of {DATASETS}")
    if not isinstance(cfg.data_root, (str, os.PathLike)) or not str(cfg.data_root):
        raise _bad("data_root", cfg.data_root, "a non-empty path string")
    if not _is_int(cfg.batch_size) or not 1 <= cfg.batch_size <= 65536:
        raise _bad("batch_size", cfg.batch_size, "an int from 1 to 65536, e.g. 64")
    if not _is_num(cfg.lr) or not 0 < cfg.lr <= 10:
        raise _bad("lr", cfg.lr, "a finite number with 0 < lr <= 10, e.g. 0.01")
    if not _is_num(cfg.momentum) or not 0 <= cfg.momentum < 1:
        raise _bad("momentum", cfg.momentum, "a number with 0 <= momentum < 1")
    if not _is_int(cfg.epochs) or not 1 <= cfg.epochs <= 1000:
        raise _bad("epochs", cfg.epochs, "an int from 1 to 1000")
    if cfg.max_steps is not None and (not _is_int(cfg.max_steps) or cfg.max_steps < 1):
        raise _bad("max_steps", cfg.max_steps, "None (whole epochs) or an int >= 1")
    if not _is_int(cfg.seed) or cfg.seed < 0:
        raise _bad("seed", cfg.seed, "an int >= 0")
    if cfg.pipeline not in PIPELINES:
        raise _bad("pipeline", cfg.pipeline, f"one of {PIPELINES}")
    if not _is_int(cfg.accumulation_steps) or not 1 <= cfg.accumulation_steps <= 1024:
        raise _bad("accumulation_steps", cfg.accumulation_steps, "an int from 1 to 1024 (1 = no accumulation)")
    if cfg.comm_hook not in COMM_HOOKS:
        raise _bad("comm_hook", cfg.comm_hook, f"one of {COMM_HOOKS}")
    if not isinstance(cfg.telemetry, bool):
        raise _bad("telemetry", cfg.telemetry, "True or False")
    if not isinstance(cfg.capture_grad_steps, tuple) or not all(
        _is_int(s) and s >= 0 for s in cfg.capture_grad_steps
    ):
        raise _bad("capture_grad_steps", cfg.capture_grad_steps, "a tuple of step numbers >= 0, e.g. (0,)")
    if cfg.threads_per_rank is not None and (not _is_int(cfg.threads_per_rank) or cfg.threads_per_rank < 1):
        raise _bad("threads_per_rank", cfg.threads_per_rank, "None (automatic) or an int >= 1")
    if cfg.bind_cores is not None and not isinstance(cfg.bind_cores, bool):
        raise _bad("bind_cores", cfg.bind_cores, "None (bind when every rank can have its own cores), True or False")
    if not _is_int(cfg.master_port) or not 0 <= cfg.master_port <= 65535:
        raise _bad("master_port", cfg.master_port, "0 (pick a free port) or a port number 1-65535")
    if not isinstance(cfg.master_addr, str) or not cfg.master_addr:
        raise _bad("master_addr", cfg.master_addr, "a host name or IP address such as '127.0.0.1'")
    if not _is_num(cfg.timeout_s) or not 1 <= cfg.timeout_s <= 86400:
        raise _bad("timeout_s", cfg.timeout_s, "seconds, from 1 to 86400")
    if not _is_int(cfg.checkpoint_every) or cfg.checkpoint_every < 0:
        raise _bad("checkpoint_every", cfg.checkpoint_every, "an int >= 0 (0 = only at the end)")
    if cfg.checkpoint_every and cfg.checkpoint_dir is None:
        raise _bad("checkpoint_every", cfg.checkpoint_every, "needs checkpoint_dir set as well")
    if cfg.resume_from == RESUME_LATEST and cfg.checkpoint_dir is None:
        raise _bad("resume_from", cfg.resume_from, "'latest' is the newest ckpt-*.pt in checkpoint_dir, so it needs "
                                                   "checkpoint_dir set as well (or give a checkpoint file)")
    if not _is_int(cfg.num_workers) or not 0 <= cfg.num_workers <= 64:
        raise _bad("num_workers", cfg.num_workers, "an int from 0 to 64")
    if cfg.fault_rank is not None and (not _is_int(cfg.fault_rank) or not 0 <= cfg.fault_rank < cfg.world_size):
        raise _bad("fault_rank", cfg.fault_rank, f"None or a rank from 0 to {cfg.world_size - 1}")
    if not _is_int(cfg.fault_step) or cfg.fault_step < 0:
        raise _bad("fault_step", cfg.fault_step, "an int >= 0")
    if cfg.fault_kind not in FAULT_KINDS:
        raise _bad("fault_kind", cfg.fault_kind, f"one of {FAULT_KINDS}")


def resolve_backend(backend: str, world_size: int) -> str:
    """'auto' -> nccl when CUDA has at least world_size GPUs, else gloo; checks that nccl can place the ranks."""
    import torch

    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if n_gpus >= world_size else "gloo"
    if backend == "nccl":
        if n_gpus == 0:
            raise _bad("backend", "nccl", "nccl needs CUDA GPUs and none is visible; use backend='gloo' (CPU) or 'auto'")
        if world_size > n_gpus:
            raise ConfigError(
                f"TrainConfig.world_size={world_size} is not accepted with backend='nccl': only {n_gpus} GPU(s) are "
                f"visible and nccl needs one GPU per rank (two ranks on one GPU are refused); use world_size<={n_gpus}, "
                "or backend='gloo'"
            )
    return backend


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS reports free on host right now (another program may still take it before it is used)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_address(host: str, port: int, host_setting: str = "TrainConfig.master_addr={}",
                  port_setting: str = "TrainConfig.master_port={}") -> None:
    """Reject a host that doesn't resolve, or an explicit port already in use (named as the caller spells them).

    The settings are templates with {} where the value goes, e.g. "launch(port={})".
    """

    def bad(setting: str, value: Any, accepted: str) -> ConfigError:
        return ConfigError(f"{setting.format(repr(value))} is not accepted: {accepted}")

    try:
        infos = socket.getaddrinfo(host, None, socket.AF_INET)
    except (socket.gaierror, UnicodeError) as e:
        raise bad(host_setting, host, f"a resolvable host such as '127.0.0.1' ({e})") from None
    addr = infos[0][4][0]
    if port == 0:
        return
    fix = port_setting.rsplit(".", 1)[-1].format(0)  # "master_port=0" or "launch(port=0)"
    if port < 1024 and os.geteuid() != 0:
        raise bad(port_setting, port, f"a port >= 1024 (lower ones need root), or {fix} for a free one")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((addr, port))
        except OSError as e:
            raise bad(port_setting, port, f"a free port; {host}:{port} can't be bound ({e.strerror}). Use {fix} "
                                          "to let the OS choose one") from None


def validate(cfg: TrainConfig, local_world_size: Optional[int] = None, check_port: bool = True) -> str:
    """Run every check that can be made before launching; return the resolved backend.

    Under torchrun, local_world_size is the ranks on this node (they share its GPUs and cores) and
    check_port=False: torchrun owns the rendezvous port.
    """
    if not isinstance(cfg, TrainConfig):
        raise ConfigError(f"expected a TrainConfig, got {type(cfg).__name__}; build one with TrainConfig(...)")
    check_types(cfg)
    check_resume_path(cfg.resume_from)
    local = local_world_size or cfg.world_size
    backend = resolve_backend(cfg.backend, local)
    try:
        binding_plan(local, cfg.threads_per_rank or default_threads(local), backend, cfg.bind_cores)
    except ValueError as e:
        raise _bad("bind_cores", cfg.bind_cores, f"None (bind when possible) or False here: {e}") from None
    if check_port:
        check_address(cfg.master_addr, cfg.master_port)
    if cfg.checkpoint_dir is not None:
        check_writable_dir("checkpoint_dir", str(cfg.checkpoint_dir))
    return backend


def check_resume_path(resume_from: Optional[str]) -> None:
    """Refuse a resume_from that is not a file this user can read: a folder (naming its latest checkpoint), nothing
    at all, or a file without read permission. Stdlib only: the command line checks it before torch loads."""
    if resume_from is None or resume_from == RESUME_LATEST:  # "latest" is resolved when the job starts
        return
    path = os.path.expanduser(str(resume_from))
    if os.path.isdir(path):
        found = sorted(glob.glob(os.path.join(glob.escape(path), "ckpt-*.pt")))
        pick = (f"give one of its ckpt-*.pt files, e.g. the latest {found[-1]!r}" if found  # zero-padded: by step
                else "it holds no ckpt-*.pt: give a checkpoint file that a run with checkpoint_dir wrote")
        raise _bad("resume_from", resume_from, f"it is a directory, not a checkpoint file; {pick}")
    try:
        os.stat(path)
        why = None if os.path.isfile(path) else "is not a regular file"
    except FileNotFoundError:
        why = "doesn't exist"
    except OSError as e:  # e.g. a folder on the way this user can't enter: not "missing"
        why = f"can't be reached ({e.strerror or e})"
    if why:
        raise _bad("resume_from", resume_from, f"an existing checkpoint file (ckpt-*.pt written by a run); {path!r} "
                                               f"{why}")
    try:
        with open(path, "rb"):  # opened here, not by torch.load: an unreadable file is named as one
            pass
    except OSError as e:
        raise ConfigError(f"TrainConfig.resume_from={resume_from!r} is not accepted: this user can't read the file "
                          f"({e.strerror or e}); make it readable for this user (chmod a+r {path}), run as its owner, "
                          "or set resume_from=None to start over") from None


def check_writable_dir(name: str, path: str) -> None:
    """Refuse a path whose nearest existing folder this user can't write (named as TrainConfig.<name>)."""
    path = os.path.expanduser(path)
    probe = path
    while not os.path.exists(probe):  # the nearest existing parent must be writable to create it
        parent = os.path.dirname(probe.rstrip(os.sep)) or "."
        if parent == probe:
            break
        probe = parent
    if os.path.exists(probe) and not os.path.isdir(probe):  # a file in the way: "not writable" would mislead
        raise _bad(name, path, f"a directory this user can write ({probe!r} is a file, not a folder); choose "
                               "another path")
    if not os.path.isdir(probe) or not os.access(probe, os.W_OK | os.X_OK):
        raise _bad(name, path, f"a directory this user can write ({probe!r} is not writable); choose another path")


def default_threads(world_size: int) -> int:
    """Torch threads per CPU rank so that the ranks together don't oversubscribe the cores (or the CPU quota)."""
    return max(1, cpu_budget() // world_size)


__all__ = ["TrainConfig", "ConfigError", "validate", "resolve_backend", "default_threads", "check_writable_dir",
           "RESUME_LATEST"]
