"""Notebook 0's stop 5: the learner's blanks, the worked solution behind "Stuck?" (the package's classes, which the
notebook runs until the learner's pass), and what the checks of the hand-built synchronizations rest on: the
late-binding closure read from the hooks' closures, an asynchronous result that lands only at wait()."""
from __future__ import annotations

import inspect
import json
import re
from pathlib import Path

import torch

from ddp_helpers import launch
from ddp_helpers.exercises._sync_watch import late_bound, watch_hooks
from ddp_helpers.exercises._watch import SENTINEL, sentinel_read, watch_all_reduce
from ddp_helpers.lesson import core_sync

ROOT = Path(__file__).resolve().parents[2]


def _cells() -> list:
    nb = json.loads((ROOT / "notebooks" / "00_core_path.ipynb").read_text(encoding="utf-8"))
    return [{**c, "source": "".join(c["source"])} for c in nb["cells"]]


def test_each_stuck_box_shows_the_worked_class_the_notebook_falls_back_to():
    boxes = [c["source"] for c in _cells() if c["cell_type"] == "markdown" and "<details>" in c["source"]]
    shown = [re.search(r"```python\n(.*?)\n```", b, re.S).group(1) for b in boxes]
    worked = [inspect.getsource(cls).rstrip() for cls in (core_sync.AfterBackward, core_sync.AsGradientsArrive)]
    assert shown == worked


def test_the_notebook_runs_the_learners_class_once_it_passes_else_the_worked_one():
    code = "\n".join(c["source"] for c in _cells() if c["cell_type"] == "code")
    for step, name in ((1, "AfterBackward"), (2, "AsGradientsArrive")):
        assert f"step_{step} = {name} if result_{step}.passed else core_sync.{name}" in code
    blanks = [c for c in _cells() if "blank" in c["metadata"].get("tags", [])]
    assert [b["source"].split(":")[0] for b in blanks] == ["class AfterBackward", "class AsGradientsArrive"]
    assert "make_sync" not in code, "one name for the hand-built class, another for torch's DDP"


def test_a_lambda_made_in_a_loop_is_seen_as_late_bound_and_a_bound_one_is_not():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    params = list(model.parameters())
    with watch_hooks(params) as late:
        for p in params:
            p.register_post_accumulate_grad_hook(lambda _: p.grad)
    with watch_hooks(params) as bound:
        for p in params:
            p.register_post_accumulate_grad_hook(lambda _, p=p: p.grad)
    with watch_hooks(params) as tensor_hooks:
        params[0].register_hook(lambda g: g)
    assert late_bound(late) == len(params) - 1
    assert late_bound(bound) is None and {h["on"] for h in bound} == set(range(len(params)))
    assert tensor_hooks == [{"kind": "tensor", "on": 0, "closes_over": None}]


def _in_flight(rank, world_size):
    def learner():
        t = torch.full((4,), float(rank + 1))
        early = t.clone()  # read right after the call
        work = torch.distributed.all_reduce(t, async_op=True)
        early = t.clone()
        t[0] = 5.0  # written while it travels
        work.wait()
        return early, t

    with watch_all_reduce(learner, lambda t: ("tensor", None), deferred=True) as records:
        early, t = learner()
    return sentinel_read(early), bool((early == SENTINEL).all()), t.tolist(), records[0]["in_flight"]


def test_a_deferred_all_reduce_lands_at_wait_and_sees_reads_and_writes_before_it():
    read, all_sentinel, after, in_flight = launch(_in_flight, 2, threads_per_rank=1)[0]
    assert read and all_sentinel
    assert after == [3.0] * 4  # the sum, whatever was written meanwhile
    assert in_flight == "filled"
