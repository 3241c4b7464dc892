"""Notebook 3b's exercise, bucketed_sync(model, cap_bytes): DDP's bucketed gradient hook, built by the learner.

The learner's function registers hooks on the model's parameters and returns finish(). The check runs two
iterations on every rank (zero_grad, forward, backward, finish()) and compares each p.grad with the mean of the
ranks' local gradients. While they run it records, for every all_reduce the learner starts: whether it was
started during backward or in finish(), whether it was asynchronous and waited for, and which parameters' gradients
the tensor held, in which order (read from its values against each gradient as it arrived). So a hint names what
was done: a handle never waited for, no division, the last partial bucket never sent, buckets filled in forward
order, the result never written back into p.grad, not the first wrong number it caused.
"""
from __future__ import annotations

import contextlib
import copy
import functools
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ._compare import close
from ._harness import Verdict, call_student, check_on_2_and_3_ranks, exercise, fail, student_outcomes
from ._bucket_verdicts import (CAP_BYTES, OBJECTS, _stale_verdict, _structure_verdict, collective_verdict, flush_verdict, kept_verdict, offsets_verdict, op_verdict,
                               structure_waits, waits_verdict, where_verdict)
from ._sync_checks import (backward_error, changed_params, forward_verdict, hook_mistake, params_of,
                           registration_verdict, returned_verdict, snapshot, timing_verdict)
from ._sync_watch import changed_shared, held_handles, shared_containers, watch_hooks
from ._watch import sentinel_read, unwaited, watch_all_reduce, watch_collectives

# Linear layers (in, out): 10 tensors from 3 to 144 numbers; with CAP_BYTES, several buckets and a partial last one.
LAYERS = ((6, 10), (10, 12), (12, 12), (12, 8), (8, 3))
BATCH = 16
ITERATIONS = 3

NUDGES = {
    "no_finish": "the exercise asks for a function back: what does the training loop call after backward?",
    "no_all_reduce": "the ranks never combined their gradients.",
    "unwaited": "an asynchronous all_reduce returns at once: when is its result there?",
    "blocking": "your gradients are right, but each all_reduce held up the backward pass.",
    "no_divide": "the ranks agree, but not on the mean.",
    "not_written_back": "there were all_reduces, yet every p.grad is still this rank's own: where does the result "
                        "end up?",
    "not_flushed": "most gradients were averaged, but not all: which bucket was never sent?",
    "stale_state": "the first backward's gradients were right, the second's were not: what does your code "
                   "remember from one backward to the next?",
    "wrong_value": "the gradients are not the mean over the ranks.",
    "one_bucket": "all the gradients travelled in one all_reduce.",
    "per_parameter": "every gradient travelled on its own.",
    "forward_order": "the gradients are right, but look at which parameters share a bucket.",
    "divided_twice": "the ranks agree, but their gradients are too small: count the divisions.",
    "read_before_wait": "an asynchronous all_reduce returns at once: when may its buffer be read?",
    "changed_in_flight": "an asynchronous all_reduce returns at once: when may its buffer be changed?",
    "sent_before_full": "the gradients are not the mean: was every bucket complete when you sent it?",
    "late_binding": "your hooks were registered in a loop: which parameter does each of them use?",
    "hook_on_data": "look at the tensor you registered your hook on.",
    "tensor_hook": "look at which hook you registered, and what it is called with.",
    "wrote_p_data": "after finish() the weights themselves had changed: where should the averages go?",
    "stale_buffer": "the first backward's gradients were right, the second's were not: what is in your flat "
                    "buffer when the second backward starts?",
    "after_backward": "the gradients are right, but nothing travelled while backward was running.",
    "not_all_reduce": "the ranks communicated, but did every rank end up with the sum?",
    "wrong_op": "look at the operation your all_reduce applies.",
    "wrong_offsets": "the gradients are not the mean: where in the bucket does each gradient sit?",
    "sync_in_forward": "look at when your code runs: before or after the gradients exist?",
    "averaged_output": "look at what your code averages: the gradients, or something else?",
    "hook_returned": "backward stopped in your hook: look at what it returns.",
    "waited_in_hook": "your gradients are right, but each all_reduce still held up the backward pass.",
    "kept_works": "your gradients are right, but look at what your code still holds after finish().",
    "second_call": "the first call's gradients were right, a second call's were not: what do your calls share?",
    "shared_state": "look at where your code keeps what it collects.",
}


def net() -> nn.Sequential:
    """The check's model: five Linear layers with ReLUs between them, the same weights on every rank."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        layers: List[nn.Module] = []
        for i, (a, b) in enumerate(LAYERS):
            layers += [nn.Linear(a, b)] + ([nn.ReLU()] if i < len(LAYERS) - 1 else [])
        return nn.Sequential(*layers)


def _batch(rank: int, iteration: int) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * iteration + rank)
    return torch.randn(BATCH, LAYERS[0][0], generator=g), torch.randint(0, LAYERS[-1][1], (BATCH,), generator=g)


def _layout(t: torch.Tensor, arrived: Dict[int, torch.Tensor], world_size: int) -> Optional[List[int]]:
    """Which parameters' gradients t holds, in its order (the arrived ones, divided by the world size or not);
    None when its values are not a row of arrived gradients."""
    flat, order, offset = t.detach().reshape(-1), [], 0
    while offset < flat.numel():
        for i, g in arrived.items():
            seg = flat[offset:offset + g.numel()]
            if i not in order and seg.numel() == g.numel() and (
                    torch.allclose(seg, g, rtol=1e-5, atol=1e-9) or
                    torch.allclose(seg * world_size, g, rtol=1e-5, atol=1e-9)):
                order.append(i)
                offset += g.numel()
                break
        else:
            return None
    return order


class _Recorder:
    """Inside a rank: each gradient as it arrives (hooks registered before the learner's), per model, and each
    all_reduce, on the model whose backward or finish() runs (running["object"])."""

    def __init__(self, models: List[nn.Module], world_size: int):
        self.world_size, self.running = world_size, {"phase": "setup", "hook": None, "object": 0}
        self.arrivals: List[Dict[int, torch.Tensor]] = [{} for _ in models]
        self.calls: List[Dict[str, Any]] = []
        for arrived, model in zip(self.arrivals, models):
            for i, p in enumerate(model.parameters()):
                p.register_post_accumulate_grad_hook(
                    lambda p, i=i, arrived=arrived: arrived.__setitem__(i, p.grad.detach().reshape(-1).clone()))

    @property
    def arrived(self) -> Dict[int, torch.Tensor]:
        """The gradients of the model now running, as they arrived in this backward."""
        return self.arrivals[self.running["object"]]

    @property
    def phase(self) -> str:
        """Where the run is: "setup", "forward", "backward", "finish" or "after"."""
        return self.running["phase"]

    @phase.setter
    def phase(self, now: str) -> None:
        self.running["phase"] = now

    def classify(self, t: torch.Tensor) -> Tuple[str, Optional[int]]:
        """What an all_reduce's tensor is: where it was started, and the parameters it held (see _layout)."""
        self.calls.append({"phase": self.phase, "numel": t.numel(), "n_arrived": len(self.arrived),
                           "layout": _layout(t, self.arrived, self.world_size), "object": self.running["object"]})
        return "tensor", len(self.calls) - 1


def _grads(model: nn.Module) -> List[Optional[np.ndarray]]:
    return [None if p.grad is None else p.grad.detach().reshape(-1).double().numpy().copy() for p in model.parameters()]


def _iteration(model: nn.Module, local_model: nn.Module, rec: _Recorder, finish: Callable, rank: int, it: int,
               student_fn: Callable) -> Dict[str, Any]:
    """One iteration as a training loop runs it: zero_grad, forward, backward, finish(); what came out."""
    x, y = _batch(rank, it)
    local_model.zero_grad(set_to_none=True)
    F.cross_entropy(local_model(x), y).backward()  # this rank's own gradients, no hooks: the reference
    model.zero_grad(set_to_none=True)
    rec.arrived.clear()
    first_call = len(rec.calls)
    params = params_of(model)
    before = snapshot(params)
    rec.running.pop("returned", None)
    try:
        rec.phase = "forward"
        loss = F.cross_entropy(model(x), y)
        rec.phase = "backward"
        loss.backward()  # the learner's hooks run in here
    except Exception as e:  # noqa: BLE001 - an error in the learner's hook becomes a hint
        return {"call": backward_error(e, student_fn, rec.running)}
    shared_mid = shared_containers(student_fn)
    rec.phase = "finish"
    call = call_student(finish)
    call.pop("value", None)
    rec.phase = "after"
    return {"call": call, "local": _grads(local_model), "after": _grads(model),
            "calls": list(range(first_call, len(rec.calls))), "changed": changed_params(before, params),
            "sentinel": [i for i, p in enumerate(params) if sentinel_read(p.grad)], "held": held_handles(finish),
            "shared": [shared_mid, shared_containers(student_fn)]}


def _call(student_fn: Callable, model: nn.Module, rec: _Recorder, out: Dict[str, Any]) -> Optional[Callable]:
    """The learner's function on one model: its finish(), or None with out["call"] saying why."""
    with watch_hooks(params_of(model), rec.running, student_fn) as hooks:
        call = call_student(student_fn, model, CAP_BYTES)
    out.setdefault("hooks", hooks)  # the first call's: the one every registration verdict reads
    finish = call.pop("value", None)
    if call["status"] == "ok" and not callable(finish):
        call = {"status": "no_finish", "type": type(finish).__name__}
    # a hook on p.data is refused as it is registered: the mistake, not torch's error, is the hint
    out["call"] = hook_mistake(hooks) or call
    return finish if out["call"]["status"] == "ok" else None


def _in_rank(rank: int, world_size: int, student_fn: Callable) -> Dict[str, Any]:
    """In each rank: the learner's function on two copies of the check's model (as when a notebook's cell runs
    again), then ITERATIONS training iterations: the first model's, the second's, the first's again."""
    models = [net()]
    models.append(copy.deepcopy(models[0]))
    local_model = copy.deepcopy(models[0])
    rec = _Recorder(models, world_size)
    out: Dict[str, Any] = {"iterations": [], "shared_before": shared_containers(student_fn)}
    phase = functools.partial(rec.running.__getitem__, "phase")
    with contextlib.ExitStack() as stack:
        reduced = stack.enter_context(watch_all_reduce(student_fn, rec.classify, deferred=True, phase=phase))
        collectives = stack.enter_context(watch_collectives(
            student_fn, on_call=lambda record: record.update(phase=phase())))
        finishes = []
        for k, model in enumerate(models):
            rec.running["object"] = k
            finishes.append(_call(student_fn, model, rec, out))
            if finishes[-1] is None:
                break
        for it, k in enumerate(OBJECTS if out["call"]["status"] == "ok" else ()):
            rec.running["object"] = k
            result = _iteration(models[k], local_model, rec, finishes[k], rank, it, student_fn)
            result["object"] = k
            out["iterations"].append(result)
            if result["call"]["status"] != "ok":
                out["call"] = result["call"]
                break
    for handle in rec.running["handles"]:  # the learner's global hooks end with the check
        handle.remove()
    out.update(calls=rec.calls, reduced=reduced, collectives=collectives, n_params=len(params_of(models[0])),
               sizes=[p.numel() * p.element_size() for p in params_of(models[0])])
    return out


# ------------------------------------------------------------------------------------------------ the parent
def _labels(outs: List[Dict[str, Any]], it: int, world_size: int) -> List[List[str]]:
    """For each rank and parameter after iteration it: "mean", "sum", "half" (the mean divided again by the world
    size), "local", "local_div" (this rank's own, divided by the world size), "none" or "other"."""
    local = [[np.asarray(g) for g in o["iterations"][it]["local"]] for o in outs]
    mean = [sum(local[r][i] for r in range(world_size)) / world_size for i in range(len(local[0]))]

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


def _mean(outs: List[Dict[str, Any]], it: int) -> List[np.ndarray]:
    local = [[np.asarray(g) for g in o["iterations"][it]["local"]] for o in outs]
    return [sum(local[r][i] for r in range(len(outs))) / len(outs) for i in range(len(local[0]))]


def _value_verdict(outs: List[Dict[str, Any]], it: int, world_size: int) -> Optional[Verdict]:
    """The verdict from one iteration's gradients (None when every rank holds the mean everywhere)."""
    labels, rank0 = _labels(outs, it, world_size), outs[0]
    calls, n_params = [rank0["calls"][k] for k in rank0["iterations"][it]["calls"]], rank0["n_params"]
    kinds = {lab for row in labels for lab in row}
    if kinds == {"mean"}:
        return None
    if "none" in kinds:
        return fail("wrong_value", "some p.grad was None after finish(): leave every gradient in p.grad, averaged.")
    verdict = op_verdict(outs)
    if verdict is not None:
        return verdict
    if kinds == {"sum"}:
        return fail("no_divide", f"every rank holds {world_size}x the mean gradient, the sum over the ranks: "
                                 "all_reduce adds; divide each gradient by dist.get_world_size() (before or after "
                                 "the all_reduce).")
    if kinds == {"half"}:
        return fail("divided_twice", f"every rank holds the mean divided by {world_size} once more: you divided "
                                     "by the world size twice (before the all_reduce and after it, or "
                                     "ReduceOp.AVG and a division). Divide once.")
    if kinds == {"local"}:
        return fail("not_written_back", f"your code started {len(calls)} all_reduce(s) per backward, yet after "
                                        "finish() every p.grad still held this rank's own gradient: the averaged "
                                        "values stayed in your bucket's flat buffer. Copy each gradient's slice "
                                        "of the bucket back into p.grad once its all_reduce is done.")
    verdict = flush_verdict(labels, outs, it, n_params) or offsets_verdict(outs, it, _mean(outs, it))
    if verdict is not None:
        return verdict
    return fail("wrong_value", "after finish() the gradients were neither each rank's own nor the mean over the "
                               "ranks: average them (sum with all_reduce, divide by the world size) and write "
                               "them back into p.grad.")


def _first_call_verdict(outs: List[Dict[str, Any]]) -> Optional[Verdict]:
    """The verdict from the learner's call itself: no finish, hooks registered the wrong way, errors."""
    if any(o["call"]["status"] == "no_finish" for o in outs):
        kind = next(o["call"]["type"] for o in outs if o["call"]["status"] == "no_finish")
        return fail("no_finish", f"bucketed_sync returned {kind}, not a function: return finish, the function that "
                                 "waits for the buckets and writes the averages into p.grad (the training loop "
                                 "calls it after loss.backward()).")
    verdict = returned_verdict([o["call"] for o in outs])
    if verdict is not None:
        return verdict
    bad = [o for o in outs if o["call"]["status"] != "ok"]
    if bad and bad[0]["call"].get("phase") == "forward":
        verdict = forward_verdict([c for o in outs for c in o["collectives"]],
                                  [x for o in outs for x in o["reduced"]], outs[0]["hooks"], bad[0]["call"])
        if verdict is not None:
            return verdict
    verdict = registration_verdict(outs[0]["hooks"]) if bad else None
    if verdict is not None and bad[0]["call"]["status"] not in ("not_done", "mistake"):
        return verdict
    student_outcomes(outs)
    return None


def _diagnose(outs: List[Dict[str, Any]], world_size: int) -> Optional[Verdict]:
    """The verdict for one run: None when every iteration left the mean in every p.grad, sent as buckets should be."""
    verdict = (_first_call_verdict(outs) or where_verdict(outs) or collective_verdict(outs) or
               waits_verdict(outs))
    if verdict is not None:
        return verdict
    rank0 = outs[0]
    its = rank0["iterations"]
    for o in outs:
        verdict, it = timing_verdict(o["reduced"], o["iterations"], [r["calls"] for r in o["iterations"]],
                                     "sent_before_full")
        if verdict is not None:
            return _stale_verdict(rank0, it) if it > 0 else verdict
    for it in range(len(its)):
        verdict = _value_verdict(outs, it, world_size)
        if verdict is not None and it > 0 and verdict.mistake != "no_divide":
            return _stale_verdict(rank0, it)
        if verdict is not None:
            return registration_verdict(rank0["hooks"]) or verdict
    shared = changed_shared(rank0)
    if shared:
        return fail("shared_state", f"every p.grad held the mean, but {shared} during the run: state kept "
                                    "outside the call (a global, a default argument) is one object every call "
                                    "shares, so a second call (the training cell run again, another model) adds "
                                    "to the first's. Make what a call collects inside it.")
    return (structure_waits(outs) or kept_verdict(outs) or
            _structure_verdict([rank0["calls"][k] for k in its[0]["calls"]], rank0["n_params"], rank0["sizes"]))


def _waits_seen(outs: List[Dict[str, Any]]) -> str:
    """How a passing answer's works were waited for, as far as the check saw it."""
    recs = [x for o in outs for x in o["reduced"]]
    if recs and all(x.get("waited_in") == "finish" for x in recs):
        return ", waited for in finish()"
    if any(x.get("future_in") for x in recs):
        return ", followed through their futures"
    return ""


@exercise("bucketed_sync", NUDGES)
def check_bucketed_sync(student_fn: Callable, world_size: Optional[int] = None) -> str:
    """Notebook 3b: bucketed_sync(model, cap_bytes) must average the gradients in buckets sent during backward."""
    seen: Dict[str, str] = {}

    def judged(outs: List[Dict[str, Any]], size: int) -> Optional[Verdict]:
        verdict = _diagnose(outs, size)
        seen["waits"] = _waits_seen(outs)
        return verdict

    sizes = check_on_2_and_3_ranks(_in_rank, judged, student_fn, world_size,
                                   hardcoded=(("no_divide", "divided_twice", "wrong_value"),
                                              "divide by dist.get_world_size(), not a fixed number."))
    return (f"{ITERATIONS} backward passes left the mean gradient in every p.grad, carried in buckets filled from "
            "the last layer back, each all-reduced with async_op=True while backward was running"
            f"{seen.get('waits', '')}, on {' and on '.join(map(str, sizes))} ranks.")
