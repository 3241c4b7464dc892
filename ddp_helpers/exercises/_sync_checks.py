"""What the checks of a hand-built gradient synchronization share (notebook 0's two steps, notebook 3b's buckets):
the nudges they word alike, each backward's gradients labelled against the mean, and the mistakes read from the
learner's call, from how hooks were registered, from where the collectives ran, from what happened to an
asynchronous all_reduce's tensor before its wait(), and from the parameters and gradients after finish().

Inside a rank the checks record (see _sync_frame); the verdicts here are made in the parent from those records,
so each names what the learner's code did.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..common.errors import ranks_text
from ._compare import close
from ._harness import Verdict, fail, student_outcomes
from ._watch import unwaited

# The nudges (first-tier hints) both checks word alike; each check adds its own.
NUDGES = {
    "no_all_reduce": "the ranks never combined their gradients.",
    "not_all_reduce": "the ranks communicated, but did every rank end up with the sum?",
    "wrong_op": "look at the operation your all_reduce applies.",
    "unwaited": "an asynchronous all_reduce returns at once: when is its result there?",
    "no_divide": "the ranks agree, but not on the mean.",
    "divided_twice": "the ranks agree, but their gradients are too small: count the divisions.",
    "wrote_p_data": "after finish() the weights themselves had changed: where should the averages go?",
    "late_binding": "your hooks were registered in a loop: which parameter does each of them use?",
    "hook_on_data": "look at the tensor you registered your hook on.",
    "tensor_hook": "look at which hook you registered, and what it is called with.",
    "hook_returned": "backward stopped in your hook: look at what it returns.",
    "sync_in_forward": "look at when your code runs: before or after the gradients exist?",
    "averaged_output": "look at what your code averages: the gradients, or something else?",
    "blocking": "your gradients are right, but each all_reduce held up the backward pass.",
    "waited_in_hook": "your gradients are right, but each all_reduce still held up the backward pass.",
    "wrong_value": "the gradients are not the mean over the ranks.",
}
HOOK_FIX = ("register self.ready (or your hook) with p.register_post_accumulate_grad_hook(...), which calls it with "
            "p once p.grad holds this backward's gradient")
LEARNING = ("forward", "backward", "finish", "step")  # phases of the learner's code after it was made
OPS = {"MAX": "the largest of the ranks' values", "MIN": "the smallest of the ranks' values",
       "PRODUCT": "the product of the ranks' values"}


def iteration_records(o: Dict[str, Any], it: int, key: str) -> List[Dict[str, Any]]:
    """One rank's records of one kind ("reduced", "collectives", ...) made during backward it."""
    return [o[key][k] for k in o["iterations"][it][key]]


def local_grads(outs: List[Dict[str, Any]], it: int) -> List[List[np.ndarray]]:
    """Each rank's own gradients in backward it (no synchronization)."""
    return [[np.asarray(g) for g in o["iterations"][it]["local"]] for o in outs]


def mean_grads(local: List[List[Any]]) -> List[np.ndarray]:
    """Per parameter, the mean of the ranks' own gradients: what every p.grad must hold."""
    return [sum(np.asarray(rank[i]) for rank in local) / len(local) for i in range(len(local[0]))]


def value_labels(outs: List[Dict[str, Any]], it: int) -> List[List[str]]:
    """For each rank and parameter after backward it: "mean", "sum", "half" (the mean divided again by the world
    size), "local", "local_div" (this rank's own, divided by the world size), "none" or "other"."""
    world_size, local = len(outs), local_grads(outs, it)
    mean = mean_grads(local)

    def label(r: int, i: int) -> str:
        g = outs[r]["iterations"][it]["after"][i]
        if g is None:
            return "none"
        for name, want in (("mean", mean[i]), ("sum", mean[i] * world_size), ("half", mean[i] / world_size),
                           ("local", local[r][i]), ("local_div", local[r][i] / world_size)):
            if close(g, want):
                return name
        return "other"

    return [[label(r, i) for i in range(len(mean))] for r in range(world_size)]


def first_value_verdict(kinds: set, reduced: List[Dict[str, Any]]) -> Optional[Verdict]:
    """Gradients that are not the mean (kinds: their labels): the verdicts both checks give first, in the same
    words; a p.grad left None, or an all_reduce op that no division turns into the mean (MAX, MIN, ...)."""
    if "none" in kinds:
        return fail("wrong_value", "some p.grad was None after finish(): leave every gradient in p.grad, averaged.")
    ops = sorted({x["op"] for x in reduced} - {"SUM", "AVG"})
    if not ops:
        return None
    return fail("wrong_op", f"your all_reduce used ReduceOp.{ops[0]}: every rank got "
                            f"{OPS.get(ops[0], f'the ranks values combined by {ops[0]}')}, element by element, not "
                            "their sum, so no division makes it the mean. Use the default op (SUM) and divide by the "
                            "world size, or ReduceOp.AVG.")


def divided_twice_verdict(world_size: int) -> Verdict:
    """Every p.grad the mean divided by the world size once more."""
    return fail("divided_twice", f"every rank holds the mean divided by {world_size} once more: you divided "
                                 "by the world size twice (before the all_reduce and after it, or "
                                 "ReduceOp.AVG and a division). Divide once.")


def unwaited_on(outs: List[Dict[str, Any]]) -> Optional[Tuple[int, int, int]]:
    """The first rank with asynchronous all_reduces never waited for: (rank, how many, of how many all_reduces)."""
    for r, o in enumerate(outs):
        pending = unwaited(o["reduced"])
        if pending:
            return r, len(pending), len(o["reduced"])
    return None


def no_finish_type(outs: List[Dict[str, Any]]) -> Optional[str]:
    """The type of what the learner's code made where it has no finish() to call (None: it has one)."""
    return next((o["call"]["type"] for o in outs if o["call"]["status"] == "no_finish"), None)


def call_verdict(outs: List[Dict[str, Any]], hooks: List[Dict[str, Any]]) -> Optional[Verdict]:
    """The verdict from the learner's code as called (hooks: those the first copy registered): a hook that
    returned a value, an error in the forward pass, hooks registered the wrong way; or its blank, its mistake seen
    in the rank, its error, raised (see student_outcomes)."""
    verdict = returned_verdict([o["call"] for o in outs])
    if verdict is not None:
        return verdict
    bad = [o for o in outs if o["call"]["status"] not in ("ok", "not_done", "mistake")]
    if bad and bad[0]["call"].get("phase") == "forward":
        verdict = forward_verdict([c for o in outs for c in o["collectives"]],
                                  [x for o in outs for x in o["reduced"]], hooks, bad[0]["call"])
        if verdict is not None:
            return verdict
    verdict = registration_verdict(hooks) if bad else None
    if verdict is not None:
        return verdict
    student_outcomes(outs)
    return None


def where_verdict(outs: List[Dict[str, Any]], fix: str) -> Optional[Verdict]:
    """No collective during backward or finish(): none at all, or only in forward, or only in optimizer.step().
    fix: what the no_all_reduce hint says to do."""
    ran = [c for o in outs for c in o["collectives"] if c.get("phase") in LEARNING]
    if any(c["phase"] in ("backward", "finish") for c in ran):
        return None
    hooks = outs[0]["hooks"][0]
    verdict = forward_verdict([c for o in outs for c in o["collectives"]], [x for o in outs for x in o["reduced"]],
                              hooks)
    if verdict is not None:
        return verdict
    stepped = [c for c in ran if c["phase"] == "step"]
    if stepped:
        return fail("sync_in_step", f"your {stepped[0]['op']} ran inside optimizer.step() (in an optimizer step "
                                    "hook), after finish() had returned: when finish() returns, every p.grad must "
                                    "hold the mean already, and there it was still each rank's own. Average the "
                                    "gradients in finish() (or during backward).")
    return registration_verdict(hooks) or fail(
        "no_all_reduce", f"no collective was called after backward began: every rank kept its own gradients. {fix}")


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


def timing_verdict(outs: List[Dict[str, Any]], filled: str) -> Tuple[Optional[Verdict], int]:
    """Rank by rank, the first backward's verdict on reads and writes before wait() and on p.data, else a later
    one's, with the backward it came from (a problem only after the first backward comes from state kept from it).
    filled: see flight_verdict."""
    for o in outs:
        for it, result in enumerate(o["iterations"]):
            verdict = first_verdict(flight_verdict(iteration_records(o, it, "reduced"), filled),
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


def other_collective_verdict(name: str, after: List[List[Any]], local: List[List[Any]]) -> Verdict:
    """The verdict for a collective used where all_reduce belongs: what it does, and what every rank held.

    after, local: per rank, each parameter's gradient after finish() and this rank's own one."""
    world_size, mean = len(local), mean_grads(local)

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
            seen = f" After it only {ranks_text(right)} held the sum (or the mean); the others did not."
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
