"""Training settings: TrainConfig, declared as one table, and the checks that refuse bad ones before any process starts.

Each field of TrainConfig is one row of the table: its default, what it accepts (a check and the words that
say it) and its help. The type checks (check_types, which every TrainConfig runs on itself when it is made), the
command line's flags (cli/train.py) and its words (cli/words.py) are all read from these rows, so a new setting is
one line here. Standard library only at import: the command line checks a run before torch is imported.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Tuple

from ..common.errors import ConfigError, refused
from ..common.errors import setting as named_setting
from ..common.files import check_readable_file, check_writable_dir
from ..data.catalog import DATASETS, DEFAULT_DATA_ROOT

if TYPE_CHECKING:
    from ..ranks.checks import LaunchPlan, RankSizes

BACKENDS = ("auto", "gloo", "nccl")
PIPELINES = ("default", "seed")
COMM_HOOKS = ("allreduce", "fp16")
FAULT_KINDS = ("raise", "kill", "hang")
RESUME_LATEST = "latest"  # resume_from's value for "the newest checkpoint in checkpoint_dir, if there is one"
MAX_SEED = 2**63 - 1  # torch's seeds are < 2**64, and DistributedSampler seeds with seed + epoch
MAX_TABLE_BYTES = 2**30  # one rank's telemetry tables, at most (files in the temp dir, mapped: engine/job.py)

Check = Callable[[Any], bool]


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def ints(lo: int, hi: float = math.inf) -> Check:
    """An int from lo to hi."""
    return lambda v: _int(v) and lo <= v <= hi


def nums(lo: float, hi: float, lo_open: bool = False, hi_open: bool = False) -> Check:
    """A finite number between lo and hi (open ends excluded)."""
    def check(v: Any) -> bool:
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
            return False
        return (lo < v if lo_open else lo <= v) and (v < hi if hi_open else v <= hi)
    return check


def one_of(*choices: Any) -> Check:
    """One of the choices."""
    return lambda v: isinstance(v, str) and v in choices


def optional(check: Check) -> Check:
    """None, or what check accepts."""
    return lambda v: v is None or check(v)


def boolean(v: Any) -> bool:
    """True or False (not 0 or 1)."""
    return isinstance(v, bool)


def path_text(v: Any) -> bool:
    """A non-empty path."""
    return isinstance(v, (str, os.PathLike)) and bool(str(v))


def text(v: Any) -> bool:
    """A non-empty string."""
    return isinstance(v, str) and bool(v)


def step_tuple(v: Any) -> bool:
    """A tuple of step numbers >= 0."""
    return isinstance(v, tuple) and all(_int(s) and s >= 0 for s in v)


def setting(default: Any, check: Check, accepted: str, help: str) -> Any:
    """One row of the table: a dataclass field with its check, the words for what it accepts, and its help."""
    return dataclasses.field(default=default, metadata={"check": check, "accepted": accepted, "help": help})


@dataclass(frozen=True, kw_only=True)  # TrainConfig(1, 2, 3) would set fields by their order: names only
class TrainConfig:
    """Everything one DDP training run needs; defaults reproduce Listing 7.2 (minus its flaws). Keyword
    arguments only: TrainConfig(world_size=2, epochs=1). A value it can't hold is refused when it is made
    (replace() and from_dict() included), naming the setting and what is accepted."""

    world_size: int = setting(2, ints(1), "an int >= 1, e.g. world_size=2",
                              "processes (ranks) to start; the listing uses one per GPU")
    backend: str = setting("auto", one_of(*BACKENDS), f"one of {BACKENDS}",
                           "auto: nccl when CUDA has >= world_size GPUs, else gloo on CPU")
    dataset: str = setting("mnist", one_of(*DATASETS), f"one of {DATASETS}",
                           "offline, mnist falls back to mnist-5k, but only at the default data_root")
    data_root: str = setting(DEFAULT_DATA_ROOT, path_text, "a non-empty path string",
                             "the listing's folder; torchvision's layout under it")
    batch_size: int = setting(64, ints(1, 65536), "an int from 1 to 65536, e.g. 64",
                              "per rank: the global batch is batch_size * world_size")
    lr: float = setting(0.01, nums(0, 10, lo_open=True), "a finite number with 0 < lr <= 10, e.g. 0.01",
                        "SGD learning rate, as in the listing")
    momentum: float = setting(0.0, nums(0, 1, hi_open=True), "a number with 0 <= momentum < 1",
                              "0 = the listing's plain SGD; > 0 gives the optimizer a state to checkpoint")
    epochs: int = setting(1, ints(1, 1000), "an int from 1 to 1000", "full passes over each rank's shard")
    max_steps: Optional[int] = setting(None, optional(ints(1)), "None (whole epochs) or an int >= 1",
                                       "stop after this many optimizer steps (None: all epochs)")
    seed: int = setting(0, ints(0, MAX_SEED), "an int from 0 to 2**63 - 1 (torch's seeds are < 2**64, and the "
                        "sampler adds the epoch)", "model init and the sampler's shuffle: same seed, same run")
    pipeline: str = setting("default", one_of(*PIPELINES), f"one of {PIPELINES}",
                            "default: shared pre-decoded tensors; seed: the listing's DataLoader path")
    accumulation_steps: int = setting(1, ints(1, 1024), "an int from 1 to 1024 (1 = no accumulation)",
                                      "micro-batches per optimizer step; all but the last skip the all-reduce")
    comm_hook: str = setting("allreduce", one_of(*COMM_HOOKS), f"one of {COMM_HOOKS}",
                             "allreduce (exact mean) or fp16 (compressed: half the bytes, rounded)")
    telemetry: bool = setting(True, boolean, "True or False", "record per-step losses, norms, fingerprints")
    capture_grad_steps: Tuple[int, ...] = setting((0,), step_tuple, "a tuple of step numbers >= 0, e.g. (0,)",
                                                  "steps whose full local and synced gradients are kept")
    threads_per_rank: Optional[int] = setting(None, optional(ints(1)), "None (automatic) or an int >= 1",
                                              "torch threads per CPU rank (None: usable CPUs // ranks)")
    bind_cores: Optional[bool] = setting(None, optional(boolean),
                                         "None (bind when every rank can have its own cores), True or False",
                                         "give each CPU rank's training thread cores of its own")
    master_addr: str = setting("127.0.0.1", text, "a host name or IP address such as '127.0.0.1'",
                               "where the rendezvous store listens; loopback keeps it private")
    master_port: int = setting(0, ints(0, 65535), "0 (pick a free port) or a port number 1-65535",
                               "0: the OS picks a free port at launch (no fixed-port collisions)")
    timeout_s: float = setting(60.0, nums(1, 86400), "seconds, from 1 to 86400",
                               "collective timeout: a dead peer turns into an error, not a hang")
    checkpoint_dir: Optional[str] = setting(None, optional(path_text), "None or a folder path",
                                            "rank 0 writes checkpoints here (None: no checkpoints)")
    checkpoint_every: int = setting(0, ints(0), "an int >= 0 (0 = only at the end)",
                                    "also checkpoint every N steps (0: only at the end of the run)")
    checkpoint_keep: int = setting(0, ints(0), "an int >= 0 (0 = keep every checkpoint)",
                                   "keep only the newest N checkpoints in checkpoint_dir (0: keep all)")
    resume_from: Optional[str] = setting(None, optional(path_text), "None, 'latest' or a checkpoint file",
                                         "checkpoint file to continue from exactly (latest: checkpoint_dir's newest)")
    num_workers: int = setting(2, ints(0, 64), "an int from 0 to 64",
                               "DataLoader workers per rank, used by the seed pipeline only")
    fault_rank: Optional[int] = setting(None, optional(ints(0)), "None or a rank number",
                                        "fault injection for lessons and tests: which rank fails")
    fault_step: int = setting(0, ints(0), "an int >= 0", "... at which step")
    fault_kind: str = setting("raise", one_of(*FAULT_KINDS), f"one of {FAULT_KINDS}",
                              "... how: raise an exception, kill itself (SIGKILL), hang")

    def __new__(cls, *args: Any, **kwargs: Any) -> "TrainConfig":
        if args:  # the dataclass's own TypeError names no field: say how to spell it
            raise ConfigError(f"TrainConfig{args!r} is not accepted: settings are given by name, e.g. "
                              "TrainConfig(world_size=2, epochs=1) (help(TrainConfig) lists them)")
        return super().__new__(cls)

    def __post_init__(self) -> None:
        check_types(self)  # checked where it is made: every TrainConfig in existence holds accepted values

    def replace(self, **changes: Any) -> "TrainConfig":
        """A copy with some fields changed (an unknown name is refused, with the known ones)."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ConfigError(f"unknown TrainConfig setting(s) {unknown}; known: "
                              f"{sorted(f.name for f in dataclasses.fields(self))}")
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
        if d.get("capture_grad_steps") is not None:
            d["capture_grad_steps"] = tuple(d["capture_grad_steps"])
        return cls(**d)


# Rules between settings: (setting, is it refused for this config?, what is accepted).
RULES: Tuple[Tuple[str, Callable[[TrainConfig], bool], Callable[[TrainConfig], str]], ...] = (
    ("checkpoint_every", lambda c: bool(c.checkpoint_every) and c.checkpoint_dir is None,
     lambda c: f"needs {named_setting('checkpoint_dir')} set as well"),
    ("checkpoint_keep", lambda c: bool(c.checkpoint_keep) and c.checkpoint_dir is None,
     lambda c: f"needs {named_setting('checkpoint_dir')} set as well"),
    ("resume_from", lambda c: c.resume_from == RESUME_LATEST and c.checkpoint_dir is None,
     lambda c: f"'latest' is the newest ckpt-*.pt in {named_setting('checkpoint_dir')}, so it needs "
               f"{named_setting('checkpoint_dir')} set as well (or give a checkpoint file)"),
    ("fault_rank", lambda c: c.fault_rank is not None and c.fault_rank >= c.world_size,
     lambda c: f"None or a rank from 0 to {c.world_size - 1}"),
)


def bad(name: str, value: Any, accepted: str) -> ConfigError:
    """The error for one refused setting: its name, its value, what is accepted."""
    return refused(name, value, accepted)


def check_types(cfg: TrainConfig) -> None:
    """Refuse values of the wrong type or range, and settings that contradict each other (no machine facts)."""
    for f in dataclasses.fields(TrainConfig):
        value = getattr(cfg, f.name)
        if not f.metadata["check"](value):
            raise bad(f.name, value, f.metadata["accepted"])
    for name, is_refused, accepted in RULES:
        if is_refused(cfg):
            raise bad(name, getattr(cfg, name), accepted(cfg))


def check_resume_path(resume_from: Optional[str]) -> None:
    """Refuse a resume_from that is not a checkpoint file this user can read ('latest' is resolved later)."""
    if resume_from is None or resume_from == RESUME_LATEST:
        return
    check_readable_file("resume_from", resume_from, "an existing checkpoint file (ckpt-*.pt written by a run)",
                        pattern="ckpt-*.pt", kind="checkpoint file",
                        fix=f", or {named_setting('resume_from', None, lead='set ')} to start over",
                        empty=f"a checkpoint file that a run with {named_setting('checkpoint_dir')} wrote")


def check_before_torch(cfg: TrainConfig, local_world_size: Optional[int] = None) -> "RankSizes":
    """A run's checks that need no torch, each made once: the resume file, checkpoint_dir, and the ranks and
    threads this machine can run (ranks/checks.py; their sizes returned). The command line makes them before torch
    loads. Under torchrun, local_world_size is this node's ranks, which already run: the room left for processes
    no longer has to hold them."""
    from ..ranks.checks import RankSizes
    from ..ranks.env import under_torchrun

    check_resume_path(cfg.resume_from)
    if cfg.checkpoint_dir is not None:
        check_writable_dir("checkpoint_dir", str(cfg.checkpoint_dir))
    return RankSizes.checked(local_world_size or cfg.world_size, cfg.threads_per_rank, owner="TrainConfig",
                             room=not under_torchrun())


def plan_launch(cfg: TrainConfig, sizes: "Optional[RankSizes]" = None, start_method: str = "auto",
                **rest: Any) -> "LaunchPlan":
    """The launch of cfg's ranks, checked before any process starts (ranks/checks.LaunchPlan.checked: the start
    method, the backend and its GPUs, the core binding, master_addr and master_port); sizes: check_before_torch's
    if made already (the command line's), else made here; rest: the plan's run_dir, on_poll, quiet..."""
    from ..ranks.checks import LaunchPlan

    return LaunchPlan.checked(sizes or check_before_torch(cfg), cfg.backend, start_method, cfg.master_addr,
                              cfg.master_port, cfg.timeout_s, cfg.bind_cores, names=("master_addr", "master_port"),
                              **rest)


def validate(cfg: TrainConfig, start_method: str = "auto") -> str:
    """Run every check that can be made before launching (run_training makes the same ones); the resolved backend."""
    if not isinstance(cfg, TrainConfig):
        raise ConfigError(f"expected a TrainConfig, got {type(cfg).__name__}; build one with TrainConfig(...)")
    return plan_launch(cfg, start_method=start_method).backend


__all__ = ["TrainConfig", "ConfigError", "validate", "check_types", "check_resume_path", "check_before_torch",
           "plan_launch", "RESUME_LATEST"]
