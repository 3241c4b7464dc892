"""What the checks of a hand-built gradient synchronization share (notebook 0's two steps, notebook 3b's buckets):
the mistakes read from how hooks were registered, from what happened to an asynchronous all_reduce's tensor
before its wait(), and from the parameters and gradients after finish().

Inside a rank the checks record (see _watch: watch_hooks, the deferred watch_all_reduce, sentinel_read); the
verdicts here are made in the parent from those records, so each names what the learner's code did.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from ._harness import Verdict, fail
from ._watch import late_bound

HOOK_FIX = ("register self.ready (or your hook) with p.register_post_accumulate_grad_hook(...), which calls it with "
            "p once p.grad holds this backward's gradient")


def params_of(model: torch.nn.Module) -> List[torch.nn.Parameter]:
    """The model's parameters, in model.parameters() order (the indices every record uses)."""
    return list(model.parameters())


def snapshot(params: List[torch.Tensor]) -> List[torch.Tensor]:
    """A copy of every parameter's values, to see later whether the learner's code changed them."""
    return [p.detach().clone() for p in params]


def changed_params(before: List[torch.Tensor], params: List[torch.Tensor]) -> List[int]:
    """The parameters whose values differ from the snapshot: the learner's code wrote to p.data."""
    return [i for i, (b, p) in enumerate(zip(before, params)) if not torch.equal(b, p.detach())]


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


def registration_verdict(hooks: List[Dict[str, Any]]) -> Optional[Verdict]:
    """The verdict for hooks registered with register_hook on the parameters, and no post-accumulate hook."""
    kinds = {h["kind"] for h in hooks if isinstance(h["on"], int)}
    if kinds == {"tensor"}:
        return fail("tensor_hook", "you registered your hooks with p.register_hook(...), which calls them with "
                                   "the incoming gradient, before autograd has written it into p.grad: that "
                                   f"tensor is not p, and p.grad is not ready yet. Instead, {HOOK_FIX}.")
    return None


def flight_verdict(reduced: List[Dict[str, Any]], filled: str) -> Optional[Verdict]:
    """The verdict for a tensor changed between all_reduce(..., async_op=True) and its wait().

    filled: the mistake code for real values written into it meanwhile ("sent_before_full" for a bucket).
    """
    states = {r.get("in_flight") for r in reduced}
    if "filled" in states and filled == "sent_before_full":
        n = sum(r.get("in_flight") == "filled" for r in reduced)
        return fail("sent_before_full", f"{n} bucket(s) were sent before they were full: gradients were copied "
                                        "into the flat buffer after its all_reduce had started, so they were "
                                        "never part of the sum. Send a bucket when its last gradient is in, "
                                        "not before.")
    if states & {"scaled", "filled"}:
        return fail("changed_in_flight", "your code changed a tensor while its all_reduce was still running "
                                         "(after all_reduce(..., async_op=True), before wait()): e.g. a division "
                                         "before wait(). Until wait() returns the tensor belongs to the "
                                         "collective; divide before you send it, or after wait().")
    return None


def read_verdict(sentinel: List[int]) -> Optional[Verdict]:
    """The verdict for gradients read from an all_reduce's tensor before its wait() (sentinel: those params)."""
    if sentinel:
        return fail("read_before_wait", f"{len(sentinel)} gradient(s) were read from an all_reduce's tensor "
                                        "before its wait() (e.g. the flat buffer copied into p.grad, then "
                                        "wait()): until wait() returns, that tensor does not hold the sum yet. "
                                        "Call wait() first, then read the result.")
    return None


def data_verdict(changed: List[int]) -> Optional[Verdict]:
    """The verdict for parameters whose values the learner's code changed (writing to p.data)."""
    if changed:
        which = f"parameter {changed[0]}" if len(changed) == 1 else f"{len(changed)} parameters"
        return fail("wrote_p_data", f"after finish() the values of {which} had changed: your code wrote into "
                                    "p.data (the weights), not p.grad. Leave the weights to the optimizer and put "
                                    "the averaged gradient into p.grad.")
    return None


def timing_verdict(reduced: List[Dict[str, Any]], iterations: List[Dict[str, Any]], per_iteration: List[List[int]],
                   filled: str) -> Tuple[Optional[Verdict], int]:
    """The first backward's verdict on reads and writes before wait() and on p.data, else a later one's, with the
    backward it came from (a problem only after the first backward comes from state kept from it)."""
    for it, (result, indices) in enumerate(zip(iterations, per_iteration)):
        verdict = first_verdict(flight_verdict([reduced[k] for k in indices], filled),
                                read_verdict(result["sentinel"]), data_verdict(result["changed"]))
        if verdict is not None:
            return verdict, it
    return None, 0


def first_verdict(*verdicts: Optional[Verdict]) -> Optional[Verdict]:
    """The first verdict that is not None."""
    return next((v for v in verdicts if v is not None), None)
