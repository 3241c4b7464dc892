"""The verdicts on notebook 3b's exercise, made in the parent from every rank's records (bucketed_sync records
them): the learner's call, where the code ran, which collective, every rank's waits, the values (no division, the
result never copied back, the offsets of the copy back, the bucket never sent), the works finish() keeps, the
buckets' grouping. Each names what was done, with the data the check has.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import numpy as np

from ._compare import close
from ._harness import Verdict, fail
from ._sync_checks import (call_verdict, divided_twice_verdict, first_value_verdict, iteration_records, local_grads,
                           mean_grads, no_finish_type, other_collective_verdict, registration_verdict, timing_verdict,
                           unwaited_on, value_labels, where_verdict)
from ._sync_frame import OBJECTS
from ._sync_watch import changed_shared

# With a cap of 140 numbers (560 bytes), bucketed_sync's model makes 3 or more buckets of several tensors from the
# reverse of model.parameters(), whatever the closing rule, and a partial last one.
CAP_BYTES = 560


def collective_verdict(outs: List[Dict[str, Any]]) -> Optional[Verdict]:
    """Collectives, but no all_reduce (broadcast, reduce, ...) and not the mean: the one used, named."""
    if any(x.get("phase") in ("backward", "finish") for o in outs for x in o["reduced"]):
        return None
    others = sorted({c["op"] for o in outs for c in o["collectives"] if c.get("phase") in ("backward", "finish")})
    if not others or not outs[0]["iterations"]:
        return None
    after = [o["iterations"][0]["after"] for o in outs]
    local = [o["iterations"][0]["local"] for o in outs]
    mean = mean_grads(local)
    if all(g is not None and close(g, mean[i]) for a in after for i, g in enumerate(a)):
        return None  # e.g. an all_gather, then the mean written back: right
    return other_collective_verdict(others[0], after, local)


def waits_verdict(outs: List[Dict[str, Any]]) -> Optional[Verdict]:
    """Every rank's works waited for."""
    found = unwaited_on(outs)
    if found is None:
        return None
    r, n, total = found
    return fail("unwaited", f"{n} of the {total} asynchronous all_reduces on rank {r} were never waited for: their "
                            "result is in the buffer only once the work is done, and your code read it before that "
                            "(or never). In finish(), call .wait() on every work the all_reduces returned before "
                            "writing the result into p.grad.")


def offsets_verdict(outs: List[Dict[str, Any]], it: int, mean: List[np.ndarray]) -> Optional[Verdict]:
    """p.grad filled from its bucket's buffer, but from another offset than its gradient's: named, with both."""
    rank0 = outs[0]
    layouts = [c["layout"] for c in iteration_records(rank0, it, "calls")]
    if not layouts or any(lay is None for lay in layouts):
        return None
    after = rank0["iterations"][it]["after"]
    for lay in layouts:
        buffer = np.concatenate([mean[i] for i in lay])
        starts = np.cumsum([0] + [mean[i].size for i in lay])
        for i, own in zip(lay, starts):
            g = after[i]
            if g is None or close(g, mean[i]):
                continue
            n = g.size
            found = [o for o in range(buffer.size - n + 1) if o != own and close(g, buffer[o:o + n])]
            if found:
                return fail("wrong_offsets", f"parameter {i}'s p.grad held the {n} numbers at offset {found[0]} of "
                                             f"its bucket's averaged buffer, but its own gradient sits at offset "
                                             f"{own} (the bucket holds parameters {lay}, in that order): the copy "
                                             "back read the wrong slice. Read each gradient back from the offset it "
                                             "was copied in at.")
    return None


def never_sent(outs: List[Dict[str, Any]], it: int, n_params: int) -> Optional[List[int]]:
    """The parameters no all_reduce of iteration it carried (None when a buffer could not be read)."""
    rank0 = outs[0]
    layouts = [c["layout"] for c in iteration_records(rank0, it, "calls")]
    if any(lay is None for lay in layouts):
        return None
    carried = {i for lay in layouts for i in lay}
    return [i for i in range(n_params) if i not in carried]


def flush_verdict(labels: List[List[str]], outs: List[Dict[str, Any]], it: int, n_params: int) -> Optional[Verdict]:
    """Most gradients the mean, the rest this rank's own (divided or not): the last bucket, never sent."""
    kinds = {lab for row in labels for lab in row}
    if not (kinds <= {"mean", "local", "local_div"} and "mean" in kinds and kinds != {"mean"}):
        return None
    left = sorted({i for row in labels for i, lab in enumerate(row) if lab != "mean"})
    which = f"parameter {left[0]}" if len(left) == 1 else f"parameters {left}"
    unsent = never_sent(outs, it, n_params)
    held = ("this rank's own gradient divided by the world size (your buffer's values, never summed)"
            if {labels[r][i] for r in range(len(labels)) for i in left} == {"local_div"} else
            "this rank's own gradient")
    if unsent is not None and not set(left) <= set(unsent):
        return None
    carried = " no all_reduce carried them" if unsent is not None else " they were never averaged"
    return fail("not_flushed", f"{len(left)} of {n_params} gradients ({which} of model.parameters(), whose "
                               f"gradients backward produces last) held {held} after finish():{carried}. That is "
                               "the last bucket, the one that never reached cap_bytes: send it too, when its last "
                               "gradient arrives (or in finish()).")


def structure_waits(outs: List[Dict[str, Any]]) -> Optional[Verdict]:
    """Right values; but an all_reduce that blocks, or a wait() during backward, on any rank."""
    for r, o in enumerate(outs):
        if any(not x["async"] and x.get("phase") == "backward" for x in o["reduced"]):
            return fail("blocking", "an all_reduce without async_op=True blocks the hook until every rank has sent "
                                    "its bucket, so backward stops there: start it with async_op=True and wait in "
                                    "finish().")
        early = [x for x in o["reduced"] if x.get("waited_in") in ("forward", "backward")]
        if early:
            return fail("waited_in_hook", f"{len(early)} of the {len(o['reduced'])} all_reduce(..., async_op=True) "
                                          f"on rank {r} were waited for during backward (wait() in the hook): "
                                          "backward stopped there until every rank had sent that bucket, just as "
                                          "with a blocking all_reduce. Keep each work, and wait for them in "
                                          "finish().")
    return None


def kept_verdict(outs: List[Dict[str, Any]]) -> Optional[Verdict]:
    """Right values, but finish() keeps every backward's works: the list grows every step."""
    held = [it["held"] for it in outs[0]["iterations"]]
    if len(held) > 1 and held[-1] > held[0]:
        return fail("kept_works", f"after finish() your code still held {held[0]} works or futures after the first "
                                  f"backward and {held[-1]} after the last of {len(held)}: finish() never empties "
                                  "what it collects, so it grows by a backward's works every step, and keeps them all "
                                  "alive. Empty it in finish(), once every work is done.")
    return None


def _filled_from(groups: List[List[int]], sizes: List[int], cap: int, order: List[int]) -> bool:
    """True when every bucket but the one holding order's last index was closed by the cap, walking `order`:
    it holds cap bytes, or the next parameter in order would have taken it past the cap."""
    position = {i: k for k, i in enumerate(order)}
    for group in groups:
        last = max(group, key=position.get)
        if position[last] == len(order) - 1:
            continue
        held = sum(sizes[i] for i in group)
        if held < cap and held + sizes[order[position[last] + 1]] <= cap:
            return False
    return True


def _grouping_verdict(layouts: List[List[int]], sizes: List[int]) -> Optional[Verdict]:
    """The verdict from which parameters share a bucket (not their layout inside it): DDP fills the buckets from
    the last parameter back; buckets filled from the first one fail."""
    n = len(sizes)
    if sorted(i for lay in layouts for i in lay) != list(range(n)):
        return None  # not every gradient was read from the buffers: the values tell the mistake instead
    backward, forward = list(range(n))[::-1], list(range(n))
    if _filled_from(layouts, sizes, CAP_BYTES, backward):
        return None
    if _filled_from(layouts, sizes, CAP_BYTES, forward):
        first = next(sorted(g) for g in layouts if 0 in g)
        return fail("forward_order", f"buckets filled from the first layer (parameters {first} of "
                                     "model.parameters() made the first full bucket): DDP fills them from the "
                                     "last layer back, in the order gradients become ready, so the first bucket is "
                                     "full early and its all_reduce overlaps the rest of backward. Walk the "
                                     "reverse of model.parameters().")
    return None


def _structure_verdict(calls: List[Dict[str, Any]], n_params: int, sizes: List[int]) -> Optional[Verdict]:
    """The verdict from how the right gradients travelled: buckets, their grouping, during backward or after."""
    layouts = [c["layout"] for c in calls if c["layout"] is not None]
    if len(calls) == 1:
        return fail("one_bucket", f"one all_reduce carried all {n_params} gradients, so nothing could travel while "
                                  "backward was still running: close a bucket once it holds cap_bytes bytes "
                                  "(numel() * element_size() per gradient), not cap_bytes numbers.")
    if len(calls) == n_params and all(len(lay) == 1 for lay in layouts):
        return fail("per_parameter", f"{n_params} all_reduces per backward, one per gradient: that is step 2, not "
                                     "buckets. Group the gradients into flat buckets of about cap_bytes.")
    verdict = _grouping_verdict(layouts, sizes) if len(layouts) == len(calls) else None
    if verdict is not None:
        return verdict
    if all(c["phase"] == "finish" for c in calls):
        return fail("after_backward", "every all_reduce started in finish(), after backward had returned, so none "
                                      "of them overlapped the backward pass: start each bucket's all_reduce in the "
                                      "hook, when its last gradient arrives.")
    return None


def _stale_verdict(rank0: Dict[str, Any], it: int) -> Verdict:
    """Backward it went wrong, the first did not: the second call's first backward (state shared between calls),
    or a buffer that kept values, or counters that did."""
    if OBJECTS[it] not in OBJECTS[:it]:
        shared = changed_shared(rank0)
        kept = (f" {shared} during the run: your calls share it, so the second call's hooks and finish() work on "
                "the first's too." if shared else "")
        return fail("second_call", "the first call's buckets left the mean in every p.grad, but a second call of "
                                   "bucketed_sync, on another copy of the model (as when the training cell runs "
                                   f"again), did not.{kept} Keep everything a call collects inside that call.")
    moments = [[c["n_arrived"] for c in iteration_records(rank0, i, "calls")] for i in (0, it)]
    shared = changed_shared(rank0)
    if shared:
        return fail("shared_state", f"after the first backward every p.grad held the mean, after backward {it + 1} "
                                    f"it did not, and {shared} during the run: state kept outside the call (a "
                                    "global, a default argument) is shared by every call, and outlives each "
                                    "backward. Make what a call collects inside it, and reset it in finish().")
    if moments[0] == moments[1]:
        return fail("stale_buffer", f"after the first backward every p.grad held the mean, after backward {it + 1} "
                                    "it did not, though the buckets were sent at the same moments: the flat buffers "
                                    "still held an earlier backward's values, and the next added to them (+=). "
                                    "Copy each gradient into its slot (copy_), or zero the buffers, every "
                                    "backward.")
    return fail("stale_state", f"after the first backward every p.grad held the mean, after backward {it + 1} it "
                               "did not: your hooks still counted an earlier backward's gradients, so the buckets were "
                               "sent at the wrong moments or not at all. Reset what they count (and the works) in "
                               "finish(), so that each backward starts with empty buckets.")


def _value_verdict(outs: List[Dict[str, Any]], it: int, world_size: int) -> Optional[Verdict]:
    """The verdict from one iteration's gradients (None when every rank holds the mean everywhere)."""
    labels, rank0 = value_labels(outs, it), outs[0]
    calls, n_params = iteration_records(rank0, it, "calls"), rank0["n_params"]
    kinds = {lab for row in labels for lab in row}
    if kinds == {"mean"}:
        return None
    verdict = first_value_verdict(kinds, [x for o in outs for x in o["reduced"]])
    if verdict is not None:
        return verdict
    if kinds == {"sum"}:
        return fail("no_divide", f"every rank holds {world_size}x the mean gradient, the sum over the ranks: "
                                 "all_reduce adds; divide each gradient by dist.get_world_size() (before or after "
                                 "the all_reduce).")
    if kinds == {"half"}:
        return divided_twice_verdict(world_size)
    if kinds == {"local"}:
        return fail("not_written_back", f"your code started {len(calls)} all_reduce(s) per backward, yet after "
                                        "finish() every p.grad still held this rank's own gradient: the averaged "
                                        "values stayed in your bucket's flat buffer. Copy each gradient's slice "
                                        "of the bucket back into p.grad once its all_reduce is done.")
    verdict = flush_verdict(labels, outs, it, n_params) or offsets_verdict(outs, it, mean_grads(local_grads(outs, it)))
    if verdict is not None:
        return verdict
    return fail("wrong_value", "after finish() the gradients were neither each rank's own nor the mean over the "
                               "ranks: average them (sum with all_reduce, divide by the world size) and write "
                               "them back into p.grad.")


def _call_verdict(outs: List[Dict[str, Any]]) -> Optional[Verdict]:
    """The verdict from the learner's call itself: no finish, and call_verdict's."""
    kind = no_finish_type(outs)
    if kind is not None:
        return fail("no_finish", f"bucketed_sync returned {kind}, not a function: return finish, the function that "
                                 "waits for the buckets and writes the averages into p.grad (the training loop "
                                 "calls it after loss.backward()).")
    return call_verdict(outs, outs[0]["hooks"][0])


def _values_verdict(outs: List[Dict[str, Any]], world_size: int) -> Optional[Verdict]:
    """The first wrong backward's verdict, from its reads and writes before wait(), else from its values; where it
    is not the first backward (and not no_divide), what was kept from an earlier one."""
    rank0 = outs[0]
    verdict, it = timing_verdict(outs, "sent_before_full")
    if verdict is not None:
        return _stale_verdict(rank0, it) if it > 0 else verdict
    for it in range(len(rank0["iterations"])):
        verdict = _value_verdict(outs, it, world_size)
        if verdict is not None and it > 0 and verdict.mistake != "no_divide":
            return _stale_verdict(rank0, it)
        if verdict is not None:
            return registration_verdict(rank0["hooks"][0]) or verdict
    return None


def diagnose(outs: List[Dict[str, Any]], world_size: int) -> Optional[Verdict]:
    """The verdict for one run: None when every iteration left the mean in every p.grad, sent as buckets should be."""
    verdict = (_call_verdict(outs) or where_verdict(outs, "Each bucket needs one dist.all_reduce(..., "
                                                           "async_op=True).") or
               collective_verdict(outs) or waits_verdict(outs) or _values_verdict(outs, world_size))
    if verdict is not None:
        return verdict
    rank0 = outs[0]
    shared = changed_shared(rank0)
    if shared:
        return fail("shared_state", f"every p.grad held the mean, but {shared} during the run: state kept "
                                    "outside the call (a global, a default argument) is one object every call "
                                    "shares, so a second call (the training cell run again, another model) adds "
                                    "to the first's. Make what a call collects inside it.")
    return (structure_waits(outs) or kept_verdict(outs) or
            _structure_verdict(iteration_records(rank0, 0, "calls"), rank0["n_params"], rank0["sizes"]))


def waits_seen(outs: List[Dict[str, Any]]) -> str:
    """How a passing answer's works were waited for, as far as the check saw it."""
    recs = [x for o in outs for x in o["reduced"]]
    if recs and all(x.get("waited_in") == "finish" for x in recs):
        return ", waited for in finish()"
    if any(x.get("future_in") for x in recs):
        return ", followed through their futures"
    return ""
