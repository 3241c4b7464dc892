"""Rank-0 checkpoints written atomically and loadable with torch.load(weights_only=True); exact resumes.

A checkpoint holds the step, the model and optimizer state (identical on every rank, so rank 0's copy serves
all) and every rank's random generator states (different on every rank: each draws its own dropout masks).
Those are gathered to rank 0 with all_gather_object when a checkpoint is due, so one file still describes the
whole job: no per-rank files that could go missing or come from different steps, and a resume checks one file.
"""
from __future__ import annotations

import errno
import glob
import io
import os
import pickle
import re
import shutil
import zipfile
from typing import Any, Dict, List, Optional, Union

import torch
import torch.distributed as dist

from .config import RESUME_LATEST, ConfigError, TrainConfig, check_resume_path
from ..common.errors import refused, setting
from ..common.files import free_text
from ..common.trusted import OutputFolder
from .model import build_model, build_optimizer
from .rng import check_rng_entry, rng_state, set_rng_state

FORMAT = "ddp_helpers.checkpoint/2"  # /1 had no "rng": refused for resume (its generators would start afresh)

# Anything that changes the sampler order or the update rule would make a "resumed" run a different one.
RESUME_MUST_MATCH = ("world_size", "batch_size", "dataset", "seed", "pipeline", "accumulation_steps", "lr",
                     "momentum")


def checkpoint_path(directory: str, step: int) -> str:
    """File name for the checkpoint taken after `step` optimizer steps."""
    return os.path.join(os.path.expanduser(directory), f"ckpt-{step:07d}.pt")


def save_checkpoint(directory: Union[str, OutputFolder], step: int, model_state: Dict[str, torch.Tensor],
                    optim_state: Dict[str, Any], config: Dict[str, Any],
                    rng: Optional[List[Dict[str, Any]]] = None) -> str:
    """Write a checkpoint via a temporary file and a rename, so a crash never leaves a half-written one.

    The folder is opened (made where missing) through a path whose every folder is judged from the root
    (common/trusted.py), and the file is created and renamed relative to it: a folder another user could change
    is refused by name, and one swapped for a link after the check is never written into.
    rng: every rank's generator states, rank by rank (rng.rng_state() of each); None leaves them out.
    """
    if not isinstance(directory, OutputFolder):
        with open_checkpoint_dir(directory) as folder:
            return save_checkpoint(folder, step, model_state, optim_state, config, rng)
    payload = {"step": step, "model": {k: v.detach().cpu() for k, v in model_state.items()},
               "optimizer": _to_cpu(optim_state), "config": config, "format": FORMAT}
    if rng is not None:
        payload["rng"] = _to_cpu(rng)
    # Serialized in memory first, then written as plain bytes: a full disk then fails as OSError(ENOSPC),
    # which is said clearly (torch's zip writer reports it as "unexpected pos ...").
    buf = io.BytesIO()
    torch.save(payload, buf)
    name = os.path.basename(checkpoint_path(directory.path, step))
    try:
        return directory.write(name, lambda fh: fh.write(buf.getbuffer()))
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise OSError(errno.ENOSPC, f"no space left on the device to write {name} in {directory.path} "
                                        f"({free_text(directory.real)}); free some space or write to another "
                                        "folder") from e
        raise


def open_checkpoint_dir(directory: str) -> OutputFolder:
    """checkpoint_dir opened for writing (made where missing), or PermissionError naming the setting, the
    folder on its way another user could change, its owner and the fix."""
    return OutputFolder(directory, f"TrainConfig.checkpoint_dir={directory!r}")


class CheckpointError(OSError):
    """The run's last checkpoint could not be written (`missed` says why); the training itself finished, and
    .result holds it."""

    def __init__(self, missed: str, result: Any = None, holder: str = "this error's .result"):
        self.missed, self.result = missed, result
        super().__init__(self.said(holder))

    def said(self, holder: str) -> str:
        """The message naming `holder` as where the run's result is (the command line's result.json, say)."""
        if self.result is None:
            return self.missed
        return f"{self.missed}; the training finished, and {holder} holds its result"


def save_if_due(cfg: TrainConfig, rank: int, step: int, end: int, model: torch.nn.Module,
                optimizer: torch.optim.Optimizer, device: Optional[torch.device] = None) -> Optional[str]:
    """After `step` steps: rank 0 saves when checkpoints are on and it is the run's end or a checkpoint_every,
    then drops all but the newest cfg.checkpoint_keep (0 keeps all).

    Every rank must call it after every step: when a checkpoint is due, all ranks send rank 0 their generator
    states (a collective), then rank 0 alone writes.
    """
    if cfg.checkpoint_dir is None:
        return None
    if step != end and not (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
        return None  # the same answer on every rank, so either all of them gather below or none does
    states = gather_rng_states(device)
    if rank != 0:
        return None  # rank 0 alone writes: all replicas are identical, so one copy is enough (and no write races)
    folder = None
    try:
        folder = open_checkpoint_dir(cfg.checkpoint_dir)  # one folder, judged once, for the save and the pruning
        path = save_checkpoint(folder, step, model.state_dict(), optimizer.state_dict(), cfg.to_dict(), rng=states)
    except OSError as e:
        if folder is not None:
            folder.close()
        if step == end:  # the training is done: the caller keeps its result, and says the checkpoint is missing
            raise CheckpointError(f"the final checkpoint (step {step}) could not be written: {e}") from e
        raise
    with folder:
        if cfg.checkpoint_keep:
            drop_older(folder, cfg.checkpoint_keep)
    return path


def _by_step(directory: str) -> List[tuple]:
    files = glob.glob(os.path.join(os.path.expanduser(directory), "ckpt-*.pt"))
    return sorted((int(m.group(1)), f) for f in files if (m := re.search(r"ckpt-(\d+)\.pt$", f)))


def drop_older(directory: Union[str, OutputFolder], keep: int) -> List[str]:
    """Remove all but the `keep` checkpoints with the highest steps in directory; the files removed.

    Only regular files in the folder as opened are removed (relative to its descriptor): a link named like a
    checkpoint is left alone, and so is whatever a folder swapped in after the opening holds."""
    if not isinstance(directory, OutputFolder):
        with open_checkpoint_dir(directory) as folder:
            return drop_older(folder, keep)
    found = sorted((int(m.group(1)), n) for n in directory.names() if (m := re.fullmatch(r"ckpt-(\d+)\.pt", n)))
    return [os.path.join(directory.path, n) for _, n in found[:-keep] if directory.remove_file(n)]


def checkpoint_bytes(n_params: int, momentum: bool, world_size: int) -> int:
    """One checkpoint's size, from above: the weights, the momentum buffers, every rank's generator states and
    torch.save's framing, plus 10% (the sizes it was checked against: docs/benchmarks.md)."""
    return int(1.1 * (4 * n_params * (2 if momentum else 1) + 16_500 * world_size + 4_096))


def check_checkpoint_room(cfg: TrainConfig, first: int, end: int, n_params: int) -> None:
    """Refuse, before training, a checkpoint_dir whose file system can't hold the checkpoints this run keeps."""
    from ..common.files import nearest_existing

    if cfg.checkpoint_dir is None or end <= first:
        return
    due = {end} | (set(range(-(-(first + 1) // cfg.checkpoint_every) * cfg.checkpoint_every, end + 1,
                             cfg.checkpoint_every)) if cfg.checkpoint_every else set())
    # Rotating, the newest is written before the oldest goes: one more than kept, at the peak.
    count = min(len(due), cfg.checkpoint_keep + 1) if cfg.checkpoint_keep else len(due)
    need = count * checkpoint_bytes(n_params, cfg.momentum > 0, cfg.world_size)
    folder = nearest_existing(os.path.expanduser(str(cfg.checkpoint_dir)))
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return
    if free < need:
        raise refused("checkpoint_dir", cfg.checkpoint_dir, f"{folder} has {free:,} bytes free and this run writes "
                      f"{count} checkpoint(s) of up to {need // count:,} bytes; free some space there, choose another "
                      f"folder, or keep fewer ({setting('checkpoint_keep', 1)}, or fewer with "
                      f"{setting('checkpoint_every')})")


def gather_rng_states(device: Optional[torch.device] = None) -> List[Dict[str, Any]]:
    """Every rank's rng_state(), indexed by rank (a collective: all ranks call it)."""
    states: List[Optional[Dict[str, Any]]] = [None] * dist.get_world_size()
    # all_gather_object, not gather_object: the one object collective every backend has long supported; the
    # states are small (docs/benchmarks.md), so sending them to every rank costs nothing worth saving.
    dist.all_gather_object(states, rng_state(device))
    return states  # type: ignore[return-value]


def _to_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x


def load_checkpoint(path: str, map_location: Optional[torch.device] = None) -> Dict[str, Any]:
    """Load a checkpoint safely (weights_only=True: tensors and plain containers, no arbitrary code)."""
    return torch.load(os.path.expanduser(path), map_location=map_location or "cpu", weights_only=True)


def check_resume(cfg: TrainConfig) -> int:
    """The step cfg.resume_from continues after (0 without one); refuses unreadable or mismatched checkpoints."""
    if cfg.resume_from is None:
        return 0
    ckpt = _read_for_resume(cfg)
    step = _check_layout(cfg, ckpt)
    optimizer = _check_model_and_optimizer(cfg, ckpt)
    saved = ckpt.get("config")
    if not isinstance(saved, dict):  # without it nothing says the run had these settings: no exact resume
        raise refuse_resume(cfg, f"its 'config' is {'missing' if saved is None else 'a ' + type(saved).__name__}, so "
                                 f"nothing says the run had this one's {', '.join(RESUME_MUST_MATCH)}")
    for key in RESUME_MUST_MATCH:
        if key in saved and saved[key] != getattr(cfg, key):
            raise ConfigError(f"{setting(key, getattr(cfg, key), owner='TrainConfig')} differs from the checkpoint's "
                              f"{saved[key]!r} ({cfg.resume_from}); an exact resume needs the same {setting(key)}")
    _check_optimizer_settings(cfg, optimizer)  # after the config's: a config that differs is named as such
    _check_rng(cfg, ckpt)
    if ckpt.get("format") != FORMAT:
        raise refuse_resume(cfg, f"its format is {ckpt.get('format')!r}, not {FORMAT!r}: an older version wrote it "
                                 "without every rank's generator states, so a resume would draw other random numbers "
                                 "than the run it continues")
    return step


def _check_rng(cfg: TrainConfig, ckpt: Dict[str, Any]) -> None:
    """Saved generator states, if any, are one well-formed rng_state() per rank of this run."""
    rng = ckpt.get("rng")
    if rng is None:
        return  # format /1: this package's model draws no random numbers after the sampler, so it still resumes
    if not isinstance(rng, list) or len(rng) != cfg.world_size:
        what = f"{len(rng)} ranks" if isinstance(rng, list) else f"a {type(rng).__name__}"
        raise refuse_resume(cfg, f"its 'rng' holds the generator states of {what}, this run has "
                                 f"{setting('world_size', cfg.world_size)}")
    for r, state in enumerate(rng):
        problem = check_rng_entry(state)
        if problem:
            raise refuse_resume(cfg, f"its 'rng' entry for rank {r} {problem}")


def refuse_resume(cfg: TrainConfig, what: str) -> ConfigError:
    """The error for a resume_from that can't be resumed: what is wrong, then the fix."""
    return refused("resume_from", cfg.resume_from, f"{what}. Resume from a ckpt-*.pt that a run with "
                   f"{setting('checkpoint_dir')} wrote, or {setting('resume_from', None, lead='set ')} to start over")


def _read_for_resume(cfg: TrainConfig) -> Any:
    """The checkpoint's contents, or a ConfigError saying why the file can't be read (never torch's own text).

    Its path was checked before (config.check_resume_path): a readable file.
    """
    path = os.path.expanduser(str(cfg.resume_from))
    size = os.path.getsize(path)
    if size == 0:
        raise refuse_resume(cfg, "the file is empty (0 bytes)")
    try:
        return load_checkpoint(path)
    except Exception as e:  # noqa: BLE001 - torch.load fails with OSError, RuntimeError, EOFError, KeyError...
        # torch's own text may suggest weights_only=False, which would let the file run code: never pass it on.
        is_zip = zipfile.is_zipfile(path)
        if isinstance(e, pickle.UnpicklingError) and is_zip and "Weights only load failed" in str(e):
            raise refuse_resume(cfg, "the file holds Python objects other than tensors and plain containers, "
                                     "which are not loaded (unpickling them could run code)") from None
        if is_zip or _looks_truncated(path):
            raise refuse_resume(cfg, f"the file ({size} bytes) is truncated or corrupted: torch.load can't read "
                                     f"it ({type(e).__name__})") from None
        raise refuse_resume(cfg, f"the file ({size} bytes) is not a checkpoint written by torch.save") from None


def _looks_truncated(path: str) -> bool:
    """Does the file start like torch.save's zip archive? Cut short, such a file loses the directory at its end."""
    with open(path, "rb") as fh:
        return fh.read(4) == b"PK\x03\x04"


def _check_layout(cfg: TrainConfig, ckpt: Any) -> int:
    """The checkpoint is a dict with an int 'step' and dicts 'model' and 'optimizer'; returns the step."""
    if not isinstance(ckpt, dict):
        raise refuse_resume(cfg, f"the file holds a {type(ckpt).__name__}, not a checkpoint (a dict with 'step', "
                                 "'model' and 'optimizer')")
    if "step" not in ckpt and ckpt and all(isinstance(v, torch.Tensor) for v in ckpt.values()):
        raise refuse_resume(cfg, f"the file holds a bare state_dict (model weights {sorted(ckpt)[:4]}), without the "
                                 "step and the optimizer state an exact resume needs")
    for key in ("step", "model", "optimizer"):
        if key not in ckpt:
            raise refuse_resume(cfg, f"the checkpoint has no {key!r} (its keys: {sorted(map(str, ckpt))})")
    step = ckpt["step"]
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise refuse_resume(cfg, f"the checkpoint's 'step' is {step!r}, not a step count (an int >= 0)")
    for key in ("model", "optimizer"):
        if not isinstance(ckpt[key], dict):
            raise refuse_resume(cfg, f"the checkpoint's {key!r} is a {type(ckpt[key]).__name__}, not a state_dict")
    return step


def _check_model_and_optimizer(cfg: TrainConfig, ckpt: Dict[str, Any]) -> torch.optim.Optimizer:
    """The saved weights fit build_model(cfg.seed) key for key and shape for shape; the optimizer state loads."""
    model = build_model(cfg.seed)
    want, got = model.state_dict(), ckpt["model"]
    if set(got) != set(want):
        raise refuse_resume(cfg, f"its model has the weights {sorted(map(str, got))}, this model (Flatten -> "
                                 f"Linear(784, 10)) has {sorted(want)}: it was saved from another model")
    for name, t in want.items():
        saved = got[name]
        if not isinstance(saved, torch.Tensor) or saved.shape != t.shape:
            shape = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
            raise refuse_resume(cfg, f"its model's {name!r} has shape {shape}, this model's has {tuple(t.shape)}: "
                                     "it was saved from another model")
    bad = [name for name in want if not torch.isfinite(got[name]).all()]
    if bad:  # a diverged run's weights: training on would only give NaN losses
        raise refuse_resume(cfg, f"its model's {bad[0]!r} holds NaN or infinite values (the run it saved had "
                                 "diverged)")
    optimizer = build_optimizer(model, cfg)
    try:
        optimizer.load_state_dict(ckpt["optimizer"])  # what resume() will do in every rank, tried once here
    except Exception as e:  # noqa: BLE001 - a malformed state fails with KeyError, ValueError, TypeError...
        raise refuse_resume(cfg, f"its 'optimizer' can't be loaded into this model's SGD optimizer "
                                 f"({type(e).__name__}: {e})") from None
    for p in model.parameters():
        buf = optimizer.state.get(p, {}).get("momentum_buffer")
        if buf is not None and (not isinstance(buf, torch.Tensor) or buf.shape != p.shape):
            raise refuse_resume(cfg, "its optimizer's momentum buffers don't match this model's parameter shapes")
        if buf is not None and not torch.isfinite(buf).all():
            raise refuse_resume(cfg, "its optimizer's momentum buffers hold NaN or infinite values")
    return optimizer


def _check_optimizer_settings(cfg: TrainConfig, optimizer: torch.optim.Optimizer) -> None:
    """The settings load_state_dict puts back into the optimizer (its param_groups' own lr, momentum...) are this
    run's: a checkpoint whose config says lr 0.01 but whose optimizer holds 5.0 would resume at 5.0."""
    want = {"lr": cfg.lr, "momentum": cfg.momentum, "dampening": 0, "weight_decay": 0, "nesterov": False}
    for i, group in enumerate(optimizer.param_groups):
        for key, value in want.items():
            if key in group and group[key] != value:
                raise refuse_resume(cfg, f"its optimizer state holds param_groups[{i}][{key!r}]={group[key]!r}, and this "
                                         f"run's is {value!r}: load_state_dict would put the checkpoint's back, so the "
                                         "run would go on with it")


def resume(path: Optional[str], model: torch.nn.Module, optimizer: torch.optim.Optimizer,
           device: torch.device, rank: int = 0) -> int:
    """Load the model, optimizer and this rank's generator states saved at `path` (None: nothing); its step.

    A checkpoint without generator states (format /1) leaves this rank's generators as they are.
    """
    if path is None:
        return 0
    ckpt = load_checkpoint(path, device)
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    if ckpt.get("rng") is not None:
        set_rng_state(ckpt["rng"][rank], device)  # the streams continue where the saving rank's stopped
    return int(ckpt["step"])


def latest_checkpoint(directory: str) -> Optional[str]:
    """The checkpoint with the highest step in `directory`, or None."""
    steps = _by_step(directory)
    return steps[-1][1] if steps else None


def resolve_resume(cfg: TrainConfig) -> TrainConfig:
    """cfg with resume_from="latest" replaced by checkpoint_dir's newest ckpt-*.pt, or by None if it holds none.

    Every attempt of a torchrun job (--max-restarts) runs the same command: with resume_from="latest" the first
    attempt starts at step 0 and each restart continues from the last checkpoint the previous attempts wrote.
    """
    if cfg.resume_from != RESUME_LATEST:
        return cfg
    found = latest_checkpoint(str(cfg.checkpoint_dir))  # TrainConfig refuses "latest" without checkpoint_dir
    if found is not None:
        check_resume_path(found)  # the file this made: checked here, as the one a user names is where it is made
    return cfg.replace(resume_from=found)
