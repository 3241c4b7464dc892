"""What the checks of a hand-built gradient synchronization share (notebook 0's two steps, notebook 3b's buckets):
the mistakes read from how hooks were registered, from what happened to an asynchronous all_reduce's tensor
before its wait(), and from the parameters and gradients after finish().

Inside a rank the checks record (see _watch: watch_hooks, the deferred watch_all_reduce, sentinel_read); the
verdicts here are made in the parent from those records, so each names what the learner's code did.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

import torch

from ._compare import close
from ._harness import Verdict, error_report, fail
from ._sync_watch import late_bound

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


# What a collective other than all_reduce does, said where it was used instead of all_reduce.
WHAT = {"broadcast": "copies one rank's tensor (src) to every rank, and sums nothing",
        "broadcast_object_list": "copies one rank's objects (src) to every rank, and sums nothing",
        "reduce": "sums into one rank's tensor only (dst)",
        "all_gather": "hands every rank a list of every rank's tensor, and sums nothing",
        "all_gather_into_tensor": "hands every rank every rank's tensor, side by side, and sums nothing",
        "all_gather_object": "hands every rank a list of every rank's object, and sums nothing",
        "gather": "collects every rank's tensor on one rank only (dst)",
        "scatter": "hands each rank one piece of one rank's list",
        "reduce_scatter": "leaves on each rank the sum of one piece only",
        "reduce_scatter_tensor": "leaves on each rank the sum of one piece only",
        "all_to_all": "swaps pieces between the ranks, and sums nothing",
        "all_to_all_single": "swaps pieces between the ranks, and sums nothing",
        "barrier": "only waits until every rank has reached it; it sends no gradient",
        "monitored_barrier": "only waits until every rank has reached it; it sends no gradient"}


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def other_collective_verdict(name: str, after: List[List[Any]], local: List[List[Any]]) -> Verdict:
    """The verdict for a collective used where all_reduce belongs: what it does, and what every rank held.

    after, local: per rank, each parameter's gradient after finish() and this rank's own one."""
    world_size = len(local)
    mean = [sum(np.asarray(local[r][i]) for r in range(world_size)) / world_size for i in range(len(local[0]))]

    def holding(want: Callable[[int], Any]) -> List[int]:
        return [r for r in range(world_size)
                if all(g is not None and close(g, want(i)) for i, g in enumerate(after[r]))]

    seen = " After it no rank held the mean."
    for who, want in (("rank 0's own gradient", lambda i: local[0][i]),
                      ("rank 0's own gradient divided by the world size", lambda i: local[0][i] / world_size)):
        if len(holding(want)) == world_size:
            seen = f" After it every rank held {who}, not the mean."
            break
    else:
        right = holding(lambda i: mean[i]) or holding(lambda i: mean[i] * world_size)
        if right:
            seen = f" After it only {_ranks(right)} held the sum (or the mean); the others did not."
    return fail("not_all_reduce", f"no all_reduce was called: you called dist.{name}, which "
                                  f"{WHAT.get(name, 'is not an all_reduce')}.{seen} all_reduce leaves the sum on "
                                  "every rank; then divide by the world size.")


def returned_verdict(calls: List[Dict[str, Any]]) -> Optional[Verdict]:
    """The verdict for a post-accumulate-grad hook that returned a value: torch's error, as torch wrote it, and
    the hook, where it is."""
    for r, c in enumerate(calls):
        if c.get("returned"):
            kind, name = c["returned"]
            return fail("hook_returned", f"backward stopped on rank {r} with {c['type']}: {c['message']} Your hook "
                                         f"`{name}`{c['where']} returned a {kind}: autograd calls a post-accumulate-"
                                         "grad hook for what it does, and takes no value back. Keep what it makes "
                                         "(e.g. in a list) and let the hook end without a return value.")
    return None


def forward_verdict(collectives: List[Dict[str, Any]], reduced: List[Dict[str, Any]], hooks: List[Dict[str, Any]],
                    error: Optional[Dict[str, Any]] = None) -> Optional[Verdict]:
    """Collectives (or hooks) in the forward pass, where p.grad is None: no gradient exists yet (None: none ran
    there and no forward hook was registered). error: the call's error, raised during forward."""
    ran = [c for c in collectives if c.get("phase") == "forward"]
    kinds = sorted({h["kind"] for h in hooks if h["kind"] in ("forward_pre", "forward")})
    if not ran and not kinds:
        return None
    said = " and ".join({"forward_pre": "a forward pre-hook", "forward": "a forward hook"}[k] for k in kinds)
    said = said or "code that runs in the forward pass"
    tensors = {r["tensor"] for r in reduced if r.get("phase") == "forward"}
    if "other" in tensors and "forward" in kinds:
        return fail("averaged_output", f"your all_reduce ran in {said}, on the model's output, during the forward "
                                       "pass: averaging what the model computes is not averaging the gradients, "
                                       "which only backward writes into p.grad. Average p.grad, after backward or "
                                       "as each gradient arrives.")
    if error is not None:
        done = f"there it raised {error['type']}{error['where']}: {error['message']}"
    elif ran:
        done = f"ran {len(ran)} collective(s) there ({ran[0]['op']} first)"
    else:
        done = "sent nothing there (there was no gradient to send)"
    return fail("sync_in_forward", f"your code registered {said}, which runs during the forward pass, before "
                                   f"backward, when p.grad is still None (zero_grad set it so), and {done}. The "
                                   "gradients exist only after backward: average them then (after backward, or in "
                                   "a hook that autograd calls once p.grad is written).")
