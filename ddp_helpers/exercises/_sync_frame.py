"""The frame both checks of a hand-built gradient synchronization run in (notebook 0's two classes, notebook 3b's
bucketed_sync): in each rank, the learner's code made on two copies of the model (as a notebook makes it again when
its training cell runs again), then ITERATIONS backward passes as a training loop runs them (zero_grad, forward,
backward, finish()), on the first copy, the second, the first again; in the parent, a run on 2 ranks and on 3.

While the learner's code runs, the frame records every all_reduce (what the check's classify calls its tensor,
where it started, asynchronous, where it was waited for: see _watch), every other collective, the hooks registered
and which one is running (see _sync_watch), and after each finish() the gradients, the weights the code changed, the
values read before a wait(), the works still held and the state every object shares. A check says only what is its
own (SyncRun's methods that raise): how the learner's code is made on a model, what its finish() is, what each
all_reduce's tensor is, the batches, this rank's own gradients, and what more it records.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F

from ._harness import check_on_2_and_3_ranks, call_student, error_report
from ._sync_watch import held_handles, late_bound, shared_containers, watch_hooks
from ._watch import sentinel_read, watch_all_reduce, watch_collectives

ITERATIONS = 3
OBJECTS = (0, 1, 0)  # the copy of the model each backward runs on: the second copy's backward between the first's
HARDCODED_FIX = "divide by dist.get_world_size(), not a fixed number."

Grads = List[Optional[np.ndarray]]


def params_of(model: torch.nn.Module) -> List[torch.nn.Parameter]:
    """The model's parameters, in model.parameters() order (the indices every record uses)."""
    return list(model.parameters())


def snapshot(params: List[torch.Tensor]) -> List[torch.Tensor]:
    """A copy of every parameter's values, to see later whether the learner's code changed them."""
    return [p.detach().clone() for p in params]


def changed_params(before: List[torch.Tensor], params: List[torch.Tensor]) -> List[int]:
    """The parameters whose values differ from the snapshot: the learner's code wrote to p.data."""
    return [i for i, (b, p) in enumerate(zip(before, params)) if not torch.equal(b, p.detach())]


def grads(model: torch.nn.Module) -> Grads:
    """Each parameter's p.grad as a flat float64 array (None where there is none)."""
    return [None if p.grad is None else p.grad.detach().reshape(-1).double().numpy().copy()
            for p in model.parameters()]


def hook_mistake(hooks: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """In a rank, right after the learner registered its hooks: a call report for a mistake seen already."""
    held = late_bound(hooks)
    if held is not None:
        return {"status": "mistake", "mistake": "late_binding",
                "hint": f"all your {len(hooks)} hooks use parameter {held} (the loop's last one), whichever "
                        "parameter called them: a lambda made in a loop, `lambda _: f(p)`, looks p up when it "
                        "runs, after the loop has ended (late binding). Use the parameter the hook is called "
                        "with (`lambda q: f(q)`, or the method itself), or bind p now (`lambda _, p=p: f(p)`)."}
    if any(h["on"] == "data" for h in hooks):
        return {"status": "mistake", "mistake": "hook_on_data",
                "hint": "you registered a hook on p.data (or p.detach()), a tensor that shares p's values but "
                        "has no gradient: autograd never calls it. Register the hook on the parameter p itself."}
    return None


def backward_error(e: BaseException, student_fn: Any, running: Dict[str, Any]) -> Dict[str, Any]:
    """An error out of forward or backward: the learner's, shown as torch wrote it, with the hook that returned a
    value (autograd raises without a frame of the learner's) and where it ran."""
    report = error_report(e, student_fn)
    report["phase"] = running["phase"]
    returned = running.get("returned")
    if returned is not None:
        report["returned"] = returned[:2]
        report["where"] = report["where"] or returned[2]
    return report


class SyncRun:
    """One rank's run of the learner's synchronization on `models` (two copies of one model); a check defines the
    methods that raise NotImplementedError. running: where the run is ("phase": "setup", "forward", "backward",
    "finish", "step" or "after"; "object": the copy now running; "hook": the parameter whose hook runs)."""

    def __init__(self, student: Any, models: List[torch.nn.Module], rank: int):
        self.student, self.models, self.rank = student, models, rank
        self.running: Dict[str, Any] = {"phase": "setup", "object": 0, "hook": None}
        self.records: Dict[str, List[Dict[str, Any]]] = {}

    # ------------------------------------------------------------------------------------ what a check says
    def make(self, model: torch.nn.Module) -> Dict[str, Any]:
        """The learner's code made on one model, as call_student reports it (its "value": what was made)."""
        raise NotImplementedError

    def finish_of(self, made: Any) -> Any:
        """The finish() the training loop calls on what make made (not callable: the learner's mistake)."""
        raise NotImplementedError

    def classify(self, t: torch.Tensor) -> Tuple[str, Optional[int]]:
        """What an all_reduce's tensor is: a kind, and an index."""
        raise NotImplementedError

    def batch(self, it: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """This rank's inputs and labels in backward it."""
        raise NotImplementedError

    def own_grads(self, it: int, x: torch.Tensor, y: torch.Tensor) -> Grads:
        """This rank's own gradients of backward it's batch, with no synchronization: the reference."""
        raise NotImplementedError

    def watch_more(self, stack: contextlib.ExitStack) -> Dict[str, List[Dict[str, Any]]]:
        """More records to keep, by name (each backward's share of them is noted by index too)."""
        return {}

    def before_backward(self) -> None:
        """Called before each backward pass."""

    def after_finish(self, k: int, result: Dict[str, Any]) -> None:
        """Called after each finish() that returned (k: the copy of the model; result: what the pass left)."""

    # ---------------------------------------------------------------------------------------------- the frame
    def phase(self) -> str:
        """Where the run is now."""
        return self.running["phase"]

    def note(self) -> Dict[str, Any]:
        """What each collective's record also holds: the copy of the model running, and the hook running."""
        return {"object": self.running["object"], "in_hook": self.running.get("hook")}

    def run(self, **out: Any) -> Dict[str, Any]:
        """Make the learner's code on every copy, then the backward passes (OBJECTS); the records, for the parent,
        besides `out`."""
        out.update(iterations=[], shared_before=shared_containers(self.student))
        with contextlib.ExitStack() as stack:
            self.records = {
                "reduced": stack.enter_context(watch_all_reduce(self.student, self.classify, deferred=True,
                                                                phase=self.phase, note=self.note)),
                "collectives": stack.enter_context(watch_collectives(
                    self.student, on_call=lambda record: record.update(phase=self.phase(), **self.note()))),
                **self.watch_more(stack)}
            made = self._make_all(out)
            for it, k in enumerate(OBJECTS if out["call"]["status"] == "ok" else ()):
                self.running["object"] = k
                first = {key: len(records) for key, records in self.records.items()}
                result = self._backward(k, made[k], it)
                result.update(object=k, **{key: list(range(first[key], len(records)))
                                           for key, records in self.records.items()})
                out["iterations"].append(result)
                if result["call"]["status"] != "ok":
                    out["call"] = result["call"]
                    break
        for handle in self.running["handles"]:  # the learner's global hooks end with the check
            handle.remove()
        out.update(self.records, n_params=len(params_of(self.models[0])))
        return out

    def _make_all(self, out: Dict[str, Any]) -> List[Any]:
        """The learner's code made on each copy; out["call"] says how it went, out["hooks"] what each registered."""
        made: List[Any] = []
        out["hooks"], out["call"] = [], {"status": "ok"}
        for k, model in enumerate(self.models):
            self.running["object"] = k
            others = [p for m in self.models if m is not model for p in params_of(m)]
            with watch_hooks(params_of(model), self.running, self.student, foreign=others) as hooks:
                call = self.make(model)
            out["hooks"].append(hooks)
            value = call.pop("value", None)
            if call["status"] == "ok" and not callable(self.finish_of(value)):
                call = {"status": "no_finish", "type": type(value).__name__}
            # a hook on p.data is refused as it is registered: the mistake, not torch's error, is the hint
            out["call"] = hook_mistake(hooks) or call
            if out["call"]["status"] != "ok":
                break
            made.append(value)
        return made

    def _backward(self, k: int, made: Any, it: int) -> Dict[str, Any]:
        """zero_grad, forward, backward (the learner's hooks), finish(), on copy k: what came out."""
        x, y = self.batch(it)
        result: Dict[str, Any] = {"local": self.own_grads(it, x, y)}
        self.before_backward()
        model = self.models[k]
        params = params_of(model)
        model.zero_grad(set_to_none=True)
        before = snapshot(params)
        self.running.pop("returned", None)
        try:
            self.running["phase"] = "forward"
            loss = F.cross_entropy(model(x), y)
            self.running["phase"] = "backward"
            loss.backward()  # the learner's hooks run in here
        except Exception as e:  # noqa: BLE001 - an error in the learner's hook becomes a hint
            return {**result, "call": backward_error(e, self.student, self.running)}
        shared_mid = shared_containers(self.student)
        self.running["phase"] = "finish"
        call = call_student(self.finish_of(made))
        call.pop("value", None)
        self.running["phase"] = "after"
        result.update(call=call, after=grads(model), changed=changed_params(before, params),
                      sentinel=[i for i, p in enumerate(params) if sentinel_read(p.grad)], held=held_handles(made),
                      shared=[shared_mid, shared_containers(self.student)])
        self.after_finish(k, result)
        return result


def check_sync(in_rank: Callable, diagnose: Callable, student: Any, world_size: Optional[int],
               hardcoded: Sequence[str]) -> Tuple[Tuple[int, ...], List[Dict[str, Any]]]:
    """Run the check on 2 and on 3 ranks (or on world_size); the sizes run and the last run's records, which the
    PASS line reads. hardcoded: the mistakes on 3 ranks that mean a number of ranks written into the code."""
    last: Dict[str, Any] = {}

    def judged(outs: List[Dict[str, Any]], size: int) -> Any:
        last["outs"] = outs
        return diagnose(outs, size)

    sizes = check_on_2_and_3_ranks(in_rank, judged, student, world_size, hardcoded=(hardcoded, HARDCODED_FIX))
    return sizes, last["outs"]
