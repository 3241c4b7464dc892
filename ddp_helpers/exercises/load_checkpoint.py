"""Notebook 11's exercise, load_checkpoint(path, device): every rank loads the checkpoint rank 0 is writing, after
it is written, with every tensor on the rank's own device.

The race is made to go wrong every time a learner's code allows it: `path` already holds an older checkpoint, and
rank 0 writes the new one only once every other rank has either loaded something or entered a collective (or
after LATE_WRITE_S). The file is written as a GPU job's rank 0 writes it, its storages tagged "cuda:0", so a load
without map_location fails on a CPU-only machine (and lands on cuda:0 on a GPU one). The `meta` device, which
holds no data, stands in for another rank's GPU: a map_location fixed to "cpu" can't put tensors there.
"""
from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

import torch

from ..engine.model import fingerprint
from ..lesson.loading import saved_as_if_on
from ._harness import Verdict, call_student, exercise, fail, run_ranks, student_outcomes
from ._reference import checkpoint_optimizer, reference_model
from ._watch import patched, watch_collectives

OLD_STEP, NEW_STEP = 10, 20  # the checkpoint already at `path`, and the one rank 0 writes during the check
FILE_NAME = "checkpoint.pt"
START_WAIT_S = 20.0  # rank 0 waits this long at most for the other ranks' processes to start (a busy machine)
LATE_WRITE_S = 3.0  # then writes at the latest this long after (under the 8 s a peer's collective waits for it)
WORLD_SIZE = 2
SAVED_ON = "cuda:0"
CUDA_ERROR = "deserialize object on a CUDA device"  # torch.load's error for a cuda storage without a GPU

NUDGES = {
    "no_barrier": "a rank loaded an older checkpoint than the one rank 0 was writing: what makes a rank wait "
                  "until rank 0 has finished writing?",
    "barrier_after_load": "a rank loaded an older checkpoint than the one rank 0 was writing: look at the order "
                          "of the lines in your function.",
    "stale_file": "a rank loaded an older checkpoint than the one rank 0 had written: what did it load from?",
    "no_map_location": "torch.load put the tensors back where the saving job had them: look at torch.load's "
                       "arguments.",
    "unmapped_location": "your map_location left some of the tensors where the saving job had them.",
    "fixed_device": "the tensors did not land on the device your function was given.",
    "no_return": "look at what your function gives back.",
    "format": "return the checkpoint itself, as torch.load gives it back.",
    "wrong_weights": "the weights you returned are not the ones in the checkpoint.",
}


def checkpoint(step: int) -> Dict[str, Any]:
    """The checkpoint of `step`: a model's state_dict and its SGD state (momentum buffers), the same every time."""
    model = reference_model(step)
    opt = checkpoint_optimizer(model)
    for p in model.parameters():
        p.grad = torch.full_like(p, 0.01 * step)  # element-wise only: bitwise the same in every process
    opt.step()
    return {"step": step, "model": model.state_dict(), "optimizer": opt.state_dict()}


def write(path: str, step: int) -> None:
    """Save checkpoint(step) at `path` the way a GPU job's rank 0 does (storages tagged cuda:0), atomically."""
    with saved_as_if_on(SAVED_ON):
        torch.save(checkpoint(step), f"{path}.tmp")
    os.replace(f"{path}.tmp", path)


def _tensors(obj: Any) -> List[torch.Tensor]:
    """Every tensor in a nested dict/list/tuple."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _report(value: Any) -> Dict[str, Any]:
    """What a rank's call returned: its step, the devices of its tensors, its model's fingerprint (real devices)."""
    if value is None:
        return {"status": "ok", "kind": "none"}
    if not isinstance(value, dict) or "step" not in value or not isinstance(value.get("model"), dict):
        return {"status": "ok", "kind": type(value).__name__, "keys": sorted(map(str, value))[:5]
                if isinstance(value, dict) else None}
    devices = sorted({str(t.device) for t in _tensors(value)})
    model = list(value["model"].values())
    real = model and all(t.device.type not in ("meta",) for t in model)
    return {"status": "ok", "kind": "checkpoint", "step": value["step"], "devices": devices,
            "fingerprint": fingerprint([t.cpu() for t in model]) if real else None}


def _wait_for(paths: List[str], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not all(os.path.exists(p) for p in paths) and time.monotonic() < deadline:
        time.sleep(0.005)


def _late_write(folder: str, world_size: int) -> None:
    """Rank 0: write the new checkpoint once every other rank has started, then looked or is waiting."""
    _wait_for([os.path.join(folder, f"started-{r}") for r in range(1, world_size)], START_WAIT_S)
    _wait_for([os.path.join(folder, f"looked-{r}") for r in range(1, world_size)], LATE_WRITE_S)
    write(os.path.join(folder, FILE_NAME), NEW_STEP)
    open(os.path.join(folder, "written"), "w").close()


def _in_rank(rank: int, world_size: int, student_fn: Callable, folder: str) -> Dict[str, Any]:
    """In each rank: the learner's load of the late-written file (on cpu), then of a written one (on meta)."""
    race = os.path.join(folder, "race")
    events: List[Dict[str, Any]] = []  # the learner's collectives and loads, in order, each with its case
    case = ["race"]
    open(os.path.join(race, f"started-{rank}"), "a").close()

    def looked(record: Optional[Dict[str, Any]] = None) -> None:  # this rank loaded or waits: rank 0 may write
        if record is not None:
            record["case"] = case[0]
        open(os.path.join(race, f"looked-{rank}"), "a").close()

    def wrap_load(real: Callable) -> Callable:
        def load(f: Any, map_location: Any = None, *args: Any, **kwargs: Any) -> Any:
            events.append({"kind": "load", "case": case[0], "map_location": _shown(map_location),
                           "written": os.path.exists(os.path.join(race, "written"))})
            try:
                return real(f, map_location, *args, **kwargs)
            finally:
                looked()
        return load

    # One list for both: the order of the loads and the collectives is what the verdict reads.
    with watch_collectives(student_fn, on_call=looked, records=events), patched(student_fn, torch, "load", wrap_load):
        if rank == 0:
            _late_write(race, world_size)
        out: Dict[str, Any] = {"events": events}
        for key, args in (("race", (os.path.join(race, FILE_NAME), torch.device("cpu"))),
                          ("meta", (os.path.join(folder, "meta", FILE_NAME), torch.device("meta")))):
            case[0] = key
            call = call_student(student_fn, *args)
            looked()  # done, or failed (a blank raises at once): rank 0 needn't wait for this rank any longer
            out[key] = _report(call.pop("value")) if call["status"] == "ok" else call
            if key == "meta" and _function_cannot_reach_meta(call, events):
                out[key] = {"status": "ok", "kind": "untestable"}
            if out[key]["status"] != "ok":
                out["call"] = out[key]
                return out
        out["call"] = {"status": "ok"}
    return out


def _function_cannot_reach_meta(call: Dict[str, Any], events: List[Dict[str, Any]]) -> bool:
    """True when a map_location function failed only because a storage can't be moved to meta (torch's
    `storage.to(device="meta")` raises: docs/maintainers.md, "Version notes"): it is tried on the cpu case only."""
    loads = [e for e in events if e["kind"] == "load" and e["case"] == "meta"]
    return (call["status"] == "error" and "device module is not loaded" in call["message"]
            and bool(loads) and loads[-1]["map_location"] == "a function")


def _shown(map_location: Any) -> str:
    """map_location as the hint names it: None, 'cpu', a function, a dict."""
    if map_location is None:
        return "None"
    if callable(map_location) and not isinstance(map_location, torch.device):
        return "a function"
    return repr(str(map_location)) if isinstance(map_location, torch.device) else repr(map_location)


def _race_events(events: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The events of the first call (the late-written checkpoint)."""
    return [e for e in events if e.get("case") == "race"]


def _map_location_verdict(outs: List[Optional[Dict[str, Any]]]) -> Optional[Verdict]:
    """The verdict for a torch.load that failed on the file's cuda:0 tags (no GPU here), else None."""
    for r, o in enumerate(outs):
        if o is None or o["call"]["status"] != "error" or CUDA_ERROR not in o["call"]["message"]:
            continue
        loads = [e for e in o["events"] if e["kind"] == "load"]
        given = loads[-1]["map_location"] if loads else "None"
        if given == "None":
            return fail("no_map_location", f"torch.load failed on rank {r}: the checkpoint was written by a GPU "
                                           f"job's rank 0, so its tensors are tagged {SAVED_ON!r}, and without "
                                           "map_location torch.load puts them back there (here there is no GPU; on "
                                           "a GPU machine every rank would load onto GPU 0). Pass "
                                           "map_location=device.")
        return fail("unmapped_location", f"torch.load failed on rank {r}: your map_location ({given}) left the "
                                         f"storages tagged {SAVED_ON!r} on {SAVED_ON}. Map every storage to the "
                                         "rank's device: map_location=device does.")
    return None


def _stale_verdict(r: int, events: List[Dict[str, Any]]) -> Verdict:
    """The verdict for rank r having loaded the old checkpoint: no barrier before its load, or one after it."""
    race = _race_events(events)
    first_load = next((i for i, e in enumerate(race) if e["kind"] == "load"), None)
    if first_load is None:
        return fail("stale_file", f"rank {r} returned the old checkpoint (step {OLD_STEP}), not the one rank 0 wrote "
                                  f"(step {NEW_STEP}), without calling torch.load: load from `path`, after the "
                                  "barrier.")
    if race[first_load]["written"]:  # the new file was there: what was loaded was read, or opened, earlier
        return fail("stale_file", f"rank {r} got the old checkpoint (step {OLD_STEP}) although rank 0 had written "
                                  f"step {NEW_STEP} before this rank's torch.load: did it load a file opened, or a "
                                  "copy made, before waiting? Load from `path` itself, after the barrier.")
    waits = [e["op"] for e in race[first_load:] if e["kind"] != "load"]
    if waits and not any(e["kind"] != "load" for e in race[:first_load]):
        return fail("barrier_after_load", f"rank {r} loaded the old checkpoint (step {OLD_STEP}) instead of the "
                                          f"one rank 0 was writing (step {NEW_STEP}): your dist.{waits[0]}() comes "
                                          "after torch.load, so it waits too late. Wait first, then load.")
    return fail("no_barrier", f"rank {r} called torch.load before rank 0 had finished writing and got the old "
                              f"checkpoint still at `path` (step {OLD_STEP}, not {NEW_STEP}): no error, just stale "
                              "weights, optimizer state and step. Make every rank wait for rank 0's write before "
                              "loading: dist.barrier() first (rank 0 reaches it only after writing).")


def _check_race(outs: List[Dict[str, Any]]) -> None:
    """Raise the verdict for the first problem of the late-written checkpoint's load (on cpu)."""
    old, new = fingerprint(checkpoint(OLD_STEP)["model"].values()), fingerprint(checkpoint(NEW_STEP)["model"].values())
    for r, o in enumerate(outs):
        got = o["race"]
        if got["kind"] == "none":
            raise fail("no_return", f"your function returned None on rank {r}: return the checkpoint torch.load "
                                    "gives back.")
        if got["kind"] != "checkpoint":
            keys = f" with the keys {got['keys']}" if got.get("keys") else ""
            raise fail("format", f"rank {r} returned a {got['kind']}{keys}: return the checkpoint dict itself "
                                 "('step', 'model', 'optimizer'), as torch.load gives it back.")
        if got["step"] == OLD_STEP or got["fingerprint"] == old:
            raise _stale_verdict(r, o["events"])
        if got["devices"] != ["cpu"]:
            loads = [e for e in _race_events(o["events"]) if e["kind"] == "load"]
            if loads and loads[0]["map_location"] == "None":
                raise fail("no_map_location", f"rank {r}'s tensors came back on {', '.join(got['devices'])}, the "
                                              "device the saving job had them on: without map_location torch.load "
                                              "puts them back there. Pass map_location=device.")
            raise fail("fixed_device", f"rank {r}'s tensors came back on {', '.join(got['devices'])}, not on the "
                                       "device it was given (cpu).")
        if got["step"] != NEW_STEP or got["fingerprint"] != new:
            raise fail("wrong_weights", f"rank {r} returned step {got['step']!r} with weights that are not the "
                                        "checkpoint's: return what torch.load gives back, unchanged.")


def _check_device(outs: List[Dict[str, Any]]) -> None:
    """Raise the verdict when the second load's tensors are not on the device given (meta)."""
    for r, o in enumerate(outs):
        got = o["meta"]
        if got["kind"] != "checkpoint" or got["devices"] == ["meta"]:  # "untestable": a function, tried on cpu
            continue
        loads = [e for e in o["events"] if e["kind"] == "load" and e["case"] == "meta"]
        given = f" (map_location was {loads[0]['map_location']})" if loads else ""
        raise fail("fixed_device", f"called with device=meta, rank {r} got its tensors on "
                                   f"{', '.join(got['devices'])}{given}: on a GPU rank the device is "
                                   "cuda:<local rank>, so map to the `device` argument, not to a fixed device.")


@exercise("load_checkpoint", NUDGES)
def check_load_checkpoint(student_fn: Callable, world_size: Optional[int] = None) -> str:
    """Notebook 11: load_checkpoint(path, device): wait for rank 0's write, then load onto `device`, on every rank."""
    size = world_size or WORLD_SIZE
    with tempfile.TemporaryDirectory(prefix="ddp-exercise-") as folder:
        for sub in ("race", "meta"):
            os.makedirs(os.path.join(folder, sub))
        write(os.path.join(folder, "race", FILE_NAME), OLD_STEP)  # an earlier run's checkpoint, still there
        write(os.path.join(folder, "meta", FILE_NAME), NEW_STEP)
        outs = run_ranks(_in_rank, size, (student_fn, folder))
    verdict = _map_location_verdict(outs)
    if verdict is not None:
        raise verdict
    student_outcomes(outs)
    _check_race(outs)
    _check_device(outs)
    on = ("cpu; your map_location function could not be tried on the meta device, which storages can't be moved "
          "to" if any(o["meta"]["kind"] == "untestable" for o in outs) else "cpu, and meta")
    return (f"every rank of {size} waited for rank 0's late write and loaded step {NEW_STEP}, its tensors on the "
            f"device it was given ({on}).")
