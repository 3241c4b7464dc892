"""Notebook 12's exercise, replicas_agree(model): True on every rank when every rank's parameters are bitwise equal
to every other rank's, False on every rank otherwise.

One rank's model differs from the others' in each case but the first, by less and less: a lot (the last rank's,
then a middle rank's, so that comparing only the first and the last rank shows), two values swapped (the same
sum and norm: the values are multiples of 1/64, so every float sum of them is exact), one bit of one value, and
only in the last parameter. Each case catches one way of comparing less than every bit, or fewer than every
rank. The check runs on 2, 3 and 4 ranks.
"""
from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Dict, Iterator, List, Optional

import numpy as np
import torch
from torch import nn

from ._harness import Verdict, call_student, check_on_2_and_3_ranks, exercise, fail, student_outcomes
from ._watch import patched, watch_collectives

NUDGES = {
    "wrong_type": "the exercise asks for True or False: look at what your function gives back.",
    "said_differ": "your function said the replicas differ when they were identical.",
    "no_collective": "can a rank tell whether the others' parameters equal its own without hearing from them?",
    "ranks_disagree": "the ranks did not all return the same answer: does every rank learn what the others found?",
    "missed_difference": "one rank's parameters differed clearly, and your function missed it: what does it "
                         "compare?",
    "summary": "one rank's parameters differed, and your function missed it: can two different sets of numbers "
               "give the same result in what you compare?",
    "tolerance": "one rank's parameters differed very slightly, and your function missed it: how equal must DDP's "
                 "replicas be?",
    "rounded": "one rank's parameters differed very slightly, and your function missed it: does anything in your "
               "comparison round?",
    "some_params": "one rank's parameters differed in one place only, and your function missed it: does it look at "
                   "every parameter?",
    "some_ranks": "one rank's parameters differed clearly, and your function missed it: which ranks does it "
                  "compare?",
}
SIZES = (2, 3, 4)  # a middle rank exists from 3 ranks on
QUANTUM = 64  # the parameters are multiples of 1 / QUANTUM, at most 1/2 in size: sums and squares are exact
_TOLERANT = ((torch, "allclose"), (torch, "isclose"), (torch.Tensor, "allclose"), (torch.Tensor, "isclose"),
             (np, "allclose"), (np, "isclose"), (math, "isclose"), (torch.testing, "assert_close"))


def replica() -> nn.Module:
    """The model every rank starts from: Linear(8, 4) -> ReLU -> Linear(4, 3), values k / 64, the same every time."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 3))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randint(-QUANTUM // 2, QUANTUM // 2 + 1, p.shape, generator=g).float() / QUANTUM)
            p.view(-1)[0] = 0.25  # a nonzero first value to change below
    return model


def _far(model: nn.Module) -> None:
    with torch.no_grad():
        model[0].weight.view(-1)[0] += 1.0


def _swapped(model: nn.Module) -> None:
    w = model[0].weight.detach().view(-1)
    j = int(torch.nonzero(w != w[0])[0])
    with torch.no_grad():
        w[0], w[j] = w[j].clone(), w[0].clone()


def _one_bit(model: nn.Module) -> None:
    w = model[0].weight.detach().view(-1)
    with torch.no_grad():
        w[0] = torch.nextafter(w[0], torch.tensor(math.inf))


def _last_param(model: nn.Module) -> None:
    with torch.no_grad():
        model[2].bias.view(-1)[0] += 0.5


# case -> (what the odd rank's model gets, the right answer, which rank is odd: "last" or "middle")
CASES = {"same": (lambda m: None, True, "last"), "far": (_far, False, "last"), "far_middle": (_far, False, "middle"),
         "swapped": (_swapped, False, "last"), "one_bit": (_one_bit, False, "last"),
         "last_param": (_last_param, False, "last")}


def odd_rank(case: str, world_size: int) -> int:
    """The rank whose model differs in this case: the last, or a middle one (rank 1 of 3, rank 2 of 4)."""
    return world_size - 1 if CASES[case][2] == "last" else world_size // 2


@contextlib.contextmanager
def _watch_tolerance(student_fn: Callable) -> Iterator[List[str]]:
    """While inside: the names of the tolerant comparisons (allclose, isclose, assert_close) the learner calls."""
    seen: List[str] = []

    def wrap(name: str) -> Callable[[Callable], Callable]:
        def make(real: Callable) -> Callable:
            def watched(*args: Any, **kwargs: Any) -> Any:
                seen.append(name)
                return real(*args, **kwargs)
            return watched
        return make

    with contextlib.ExitStack() as stack:
        for owner, name in _TOLERANT:
            stack.enter_context(patched(student_fn, owner, name, wrap(name)))
        yield seen


def _as_bool(value: Any) -> Any:
    """True or False for a bool (Python, NumPy, a one-element bool tensor); else the type's name."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype == torch.bool:
        return bool(value.item())
    return type(value).__name__


def _in_rank(rank: int, world_size: int, student_fn: Callable) -> Dict[str, Any]:
    """In each rank: the learner's function on each case's model (the last rank's differs), what it called."""
    out: Dict[str, Any] = {}
    with watch_collectives(student_fn) as collectives, _watch_tolerance(student_fn) as tolerant:
        for case, (change, _, _) in CASES.items():
            model, n_coll, n_tol = replica(), len(collectives), len(tolerant)
            if rank == odd_rank(case, world_size):
                change(model)
            call = call_student(student_fn, model)
            if call["status"] == "ok":
                call["value"] = _as_bool(call["value"])
            call.update(collectives=collectives[n_coll:], tolerant=tolerant[n_tol:])
            out[case] = call
            if call["status"] != "ok":
                out["call"] = call
                return out
    out["call"] = {"status": "ok"}
    return out


def _diagnose(outs: List[Dict[str, Any]], world_size: int) -> Optional[Verdict]:
    """The verdict for one run: the first case some rank got wrong (None when every rank was right in all)."""
    student_outcomes(outs)
    for case, (_, expected, _) in CASES.items():
        vals = [o[case]["value"] for o in outs]
        odd = next((v for v in vals if not isinstance(v, bool)), None)
        if odd is not None:
            return fail("wrong_type", f"your function returned a {odd}: return True or False (a bool), the same on "
                                      "every rank.")
        if any(v != expected for v in vals):
            return _case_verdict(case, vals, outs[0][case], odd_rank(case, world_size), world_size)
    return None


def _sent(collectives: List[Dict[str, Any]]) -> str:
    """'each rank sent: all_reduce of 1 float32 number, ...' for the collectives of one call ('' if none sent one)."""
    parts = [f"{c['op']} of {c['numel']} {c['dtype']} number{'s' * (c['numel'] != 1)}" for c in collectives
             if c["numel"] is not None]
    return f"each rank sent: {', '.join(parts)}" if parts else ""


def _case_verdict(case: str, vals: List[bool], call: Dict[str, Any], odd: int, world_size: int) -> Verdict:
    """The verdict for a case some rank got wrong; call: rank 0's call in it (its collectives and comparisons);
    odd: the rank whose model differed."""
    colls = call["collectives"]
    if len(set(vals)) > 1:
        said = ", ".join(f"rank {r} {v}" for r, v in enumerate(vals))
        if colls and all(c["op"] in ("broadcast", "broadcast_object_list", "scatter") for c in colls):
            return fail("ranks_disagree", f"the ranks returned different answers ({said}): each rank compared "
                                          "its parameters with rank 0's and kept its own verdict, so rank 0, which "
                                          f"compares with itself, never learned that rank {odd} differs. Every rank "
                                          "must return the same answer: share the verdicts, or gather every rank's "
                                          "fingerprint.")
        return fail("ranks_disagree", f"the ranks returned different answers ({said}): every rank must learn "
                                      "what every other rank has, and return the same answer.")
    if case == "same":
        return fail("said_differ", "the replicas were identical (the same parameters on every rank), but your "
                                   "function returned False.")
    if not colls:
        return fail("no_collective", f"rank {odd}'s parameters differed, yet every rank said the replicas agree: "
                                     "your function called no collective, so each rank only looked at its own "
                                     "parameters. The ranks must exchange what they hold (a fingerprint, say).")
    sent = _sent(colls)
    if case == "far_middle":
        return fail("some_ranks", f"rank {odd}'s first weight differed by 1.0 (rank {odd} of ranks 0 to "
                                  f"{world_size - 1}: neither the first nor the last), and your function said the "
                                  "replicas agree, although it caught the same difference on the last rank: compare "
                                  "every rank's parameters, not only the first and the last rank's.")
    if case == "far":
        return fail("missed_difference", f"rank {odd}'s first weight differed by 1.0, and your function said the "
                                         f"replicas agree ({sent or 'look at what it compares'}): compare the "
                                         "parameters' values, model.parameters().")
    if case == "swapped":
        return fail("summary", f"rank {odd} had two values of its first weight swapped, and your function said the "
                               f"replicas agree{f' ({sent})' if sent else ''}: a sum or a norm of the parameters is "
                               "the same for both. Compare every value bitwise: a fingerprint of the bytes, or "
                               "torch.equal on the gathered parameters.")
    if case == "one_bit":
        if call["tolerant"]:
            return fail("tolerance", f"rank {odd}'s first weight differed from the others' in the last bit of one "
                                     f"value, and your function said the replicas agree: {call['tolerant'][0]} "
                                     "allows a tolerance, which hides exactly the tiny differences a divergence "
                                     "starts from. DDP's replicas are bitwise identical: compare them bitwise "
                                     "(torch.equal, or a fingerprint).")
        return fail("rounded", f"rank {odd}'s first weight differed from the others' in the last bit of one value, "
                               f"and your function said the replicas agree{f' ({sent})' if sent else ''}: something "
                               "in the comparison rounds that difference away (a float sum, a lower precision). "
                               "Compare bitwise (torch.equal, or a fingerprint).")
    return fail("some_params", f"only rank {odd}'s last parameter (the second layer's bias) differed, and your "
                               "function said the replicas agree: compare all of model.parameters(), not only "
                               "some.")


@exercise("replicas_agree", NUDGES)
def check_replicas_agree(student_fn: Callable, world_size: Optional[int] = None) -> str:
    """Notebook 12: replicas_agree(model) must say, on every rank, whether all ranks' parameters are bitwise equal."""
    sizes = check_on_2_and_3_ranks(_in_rank, _diagnose, student_fn, world_size,
                                   hardcoded=(("ranks_disagree", "missed_difference"),
                                              "is a number of ranks written into your code?"), sizes=SIZES)
    on = ", ".join(map(str, sizes[:-1])) + " and " * (len(sizes) > 1) + str(sizes[-1])
    return ("every rank said the replicas agree when they did, and differ when the last or a middle rank's "
            "parameters differed by a lot, or the last rank's by two swapped values, by one bit, or only in the last "
            f"parameter, on {on} ranks.")
