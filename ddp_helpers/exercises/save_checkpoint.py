"""Exercise 7, save_checkpoint(ddp_model, optimizer, step, path): rank 0 only, atomic, no 'module.' prefix."""
from __future__ import annotations

import os
import tempfile
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from ..engine.model import build_model
from ._harness import Verdict, call_student, exercise, fail, run_ranks, student_outcomes, swap_globals
from ._reference import GRAD_BATCH, checkpoint_optimizer, rank_batch, reference_model

STEP = 5  # the step number the learner's function is given and must save
FILE_NAME = "checkpoint.pt"
WORLD_SIZE = 2

NUDGES = {
    "every_rank_writes": "more than one rank wrote the checkpoint: how many copies of identical weights are "
                         "needed?",
    "not_rank0": "a rank other than the usual one wrote the checkpoint.",
    "no_file": "there is no checkpoint at `path` after your function.",
    "not_atomic": "think about a crash in the middle of writing: what would be left at `path`?",
    "copied_not_moved": "think about a crash in the middle of putting the file at `path`.",
    "temp_left": "something else is left in the checkpoint's folder.",
    "not_weights_only": "the file can't be loaded safely: what kinds of objects did you save?",
    "format": "the saved dictionary is not quite what the exercise asks for.",
    "module_prefix": "a plain, unwrapped model can't load the saved weights: compare the names of their keys.",
    "stale_weights": "the saved weights are not the model's current ones.",
}


def _in_rank(rank: int, world_size: int, student_fn: Callable, path: str) -> Dict[str, Any]:
    """In each rank: one training step, then the learner's save with torch.save and os.replace/rename watched."""
    model = build_model(seed=0)
    ddp = DDP(model)
    optimizer = checkpoint_optimizer(ddp)
    x, y = rank_batch(rank, 0, GRAD_BATCH)
    F.cross_entropy(ddp(x), y).backward()
    optimizer.step()
    saves: List[str] = []
    moves: List[Tuple[str, str]] = []
    real_save, real_replace, real_rename = torch.save, os.replace, os.rename

    def watched_save(obj: Any, f: Any, *a: Any, **k: Any) -> Any:
        saves.append(os.path.abspath(os.fspath(f)) if isinstance(f, (str, os.PathLike)) else "<file object>")
        return real_save(obj, f, *a, **k)

    def watched_move(real: Callable) -> Callable:
        def move(src: Any, dst: Any, *a: Any, **k: Any) -> Any:
            moves.append((os.path.abspath(os.fspath(src)), os.path.abspath(os.fspath(dst))))
            return real(src, dst, *a, **k)
        return move

    # A forked rank: these patches never reach the notebook. Path.replace/rename and shutil.move go through os.
    torch.save = watched_save
    os.replace, os.rename = watched_move(real_replace), watched_move(real_rename)
    for orig, new in ((real_save, watched_save), (real_replace, os.replace), (real_rename, os.rename)):
        swap_globals(student_fn, orig, new)
    call = call_student(student_fn, ddp, optimizer, STEP, path)
    call.pop("value", None)
    torch.save, os.replace, os.rename = real_save, real_replace, real_rename
    params = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"call": call, "saves": saves, "moves": moves, "params": params}


def _check_writing(outs: Sequence[Dict[str, Any]], folder: str, path: str) -> None:
    """Raise the verdict for the first problem in who wrote the file and how (rank 0 only, through a move)."""
    writers = [r for r, o in enumerate(outs) if o["saves"]]
    if writers and writers != [0]:
        others = [r for r in writers if r != 0]
        if 0 in writers:
            raise fail("every_rank_writes", f"rank {others[0]} wrote a checkpoint too: the replicas are "
                                            "identical, so only rank 0 should save (`if dist.get_rank() == 0:`); "
                                            "several writers race on the same file.")
        raise fail("not_rank0", f"rank {others[0]} wrote the checkpoint: let rank 0 do it "
                                "(`if dist.get_rank() == 0:`).")
    target = os.path.abspath(path)
    saves, moves = outs[0]["saves"], outs[0]["moves"]
    if not os.path.exists(path):
        raise _no_file(saves, moves)
    if target in saves or (not moves and "<file object>" in saves):
        raise fail("not_atomic", "rank 0 wrote straight to the final path: a crash mid-write leaves a broken "
                                 "checkpoint. Save to a temporary file next to it, then os.replace(tmp, path).")
    if not any(dst == target for _, dst in moves):
        named = next((os.path.basename(s) for s in saves if s != "<file object>"), "a temporary file")
        raise fail("copied_not_moved", f"rank 0 saved {named} and then copied it to `path`: a copy writes `path` "
                                       "piece by piece, so a crash during it leaves a broken checkpoint. Move the "
                                       "file into place with os.replace(tmp, path), which is atomic.")
    leftovers = sorted(set(os.listdir(folder)) - {FILE_NAME})
    if leftovers:
        raise fail("temp_left", f"{len(leftovers)} extra file(s) left next to the checkpoint "
                                f"({', '.join(leftovers[:3])}): write one temporary file and move that one into "
                                "place; remove anything else you write there.")


def _no_file(saves: Sequence[str], moves: Sequence[Tuple[str, str]]) -> Verdict:
    """The verdict for no file at `path`: rank 0 saved nothing, or saved and never moved it there."""
    if not saves:
        return fail("no_file", "there is no file at `path` after your function, and rank 0 never called "
                               "torch.save: save with torch.save(..., tmp) on rank 0, then os.replace(tmp, path).")
    named = os.path.basename(saves[0]) if saves[0] != "<file object>" else "an open file"
    if moves:
        return fail("no_file", f"there is no file at `path` after your function: rank 0 saved {named} and moved it "
                               f"to {os.path.basename(moves[-1][1])}, not to `path`.")
    return fail("no_file", f"there is no file at `path` after your function: rank 0 saved {named} but never moved "
                           "it to `path` (os.replace(tmp, path) does, atomically).")


def _load(path: str) -> Any:
    """The saved checkpoint, loaded as a plain model would load it: weights_only=True."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # noqa: BLE001 - any refusal means objects were pickled
        raise fail("not_weights_only", "torch.load(path, weights_only=True) refuses the file: save state_dict()s "
                                       "(tensors), not the model or optimizer objects.") from None


def _check_contents(ckpt: Any, params: Dict[str, torch.Tensor]) -> None:
    """Raise the verdict for the first problem of the saved dict: its keys, the model's names, weights, optimizer."""
    if not isinstance(ckpt, dict) or not {"step", "model", "optimizer"} <= set(ckpt):
        keys = sorted(ckpt) if isinstance(ckpt, dict) else type(ckpt).__name__
        raise fail("format", f"save a dict with the keys 'step', 'model' and 'optimizer' (got {keys}).")
    state = ckpt["model"]
    if not isinstance(state, dict) or not state:
        raise fail("format", "ckpt['model'] should be the model's state_dict().")
    if any(str(k).startswith("module.") for k in state):
        raise fail("module_prefix", "the model's keys start with 'module.' (the DDP wrapper's names), so a plain "
                                    "model can't load them: save ddp_model.module.state_dict().")
    fresh = reference_model(1)
    try:
        fresh.load_state_dict(state)
    except (RuntimeError, TypeError, KeyError) as e:
        raise fail("format", f"ckpt['model'] does not load into the model: {str(e).splitlines()[0]}") from None
    if any(not torch.equal(fresh.state_dict()[k], v) for k, v in params.items()):
        raise fail("stale_weights", "the saved weights are not the model's current weights.")
    if ckpt["step"] != STEP:
        raise fail("format", f"ckpt['step'] is {ckpt['step']!r}, expected the step argument ({STEP}).")
    opt = checkpoint_optimizer(fresh)
    try:
        opt.load_state_dict(ckpt["optimizer"])
    except Exception as e:  # noqa: BLE001
        raise fail("format", f"ckpt['optimizer'] does not load into an SGD optimizer ({type(e).__name__}): save "
                             "optimizer.state_dict().") from None
    if not opt.state_dict()["state"]:
        raise fail("format", "ckpt['optimizer'] has no state (momentum buffers): save optimizer.state_dict().")


@exercise("save_checkpoint", NUDGES)
def check_save_checkpoint(student_fn: Callable, world_size: Optional[int] = None) -> str:
    """Exercise 7: save_checkpoint(ddp_model, optimizer, step, path): rank 0 only, atomic, no 'module.' prefix."""
    with tempfile.TemporaryDirectory(prefix="ddp-exercise-") as folder:
        path = os.path.join(folder, FILE_NAME)
        outs = run_ranks(_in_rank, world_size or WORLD_SIZE, (student_fn, path))
        student_outcomes(outs)
        _check_writing(outs, folder, path)
        ckpt = _load(path)
    _check_contents(ckpt, outs[0]["params"])
    return ("only rank 0 wrote, through a temporary file and os.replace, and the file loads with weights_only=True "
            "into a plain (unwrapped) model and optimizer.")
