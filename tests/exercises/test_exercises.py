"""The exercise checks: solutions pass, the notebook's blanks say "not done yet", each typical mistake gets its hint."""
from __future__ import annotations

import inspect
import json
import os
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # teacher/ sits next to the package, outside it (not installed on purpose)

from ddp_helpers.exercises import EXERCISES, NOT_DONE, CheckResult, reset_hints, summarize  # noqa: E402
from ddp_helpers.exercises._harness import NO_NUDGE  # noqa: E402
from teacher.solutions import ALTERNATIVES, SOLUTIONS  # noqa: E402
from teacher.wrong_answers import WRONG  # noqa: E402

from _hints import assert_gets_its_hint, nudge  # noqa: E402

NOTEBOOK = ROOT / "notebooks" / "exercises" / "exercises.ipynb"


def _cells(tag=None):
    nb = json.loads(NOTEBOOK.read_text(encoding="utf-8"))
    return [c for c in nb["cells"] if c["cell_type"] == "code"
            and (tag is None or tag in c.get("metadata", {}).get("tags", []))]


def _src(cell) -> str:
    return "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]


@pytest.fixture(autouse=True)
def fresh_hints():
    """Every test starts as a learner who has not failed a check yet (the first failure gets the nudge)."""
    reset_hints()
    yield
    reset_hints()


@pytest.fixture(scope="module")
def blanks():
    """The notebook's blank functions, defined the way the notebook defines them (setup cell + blank cells)."""
    ns: dict = {"__name__": "exercise_notebook"}
    exec(_src(_cells()[0]), ns)  # the imports
    for cell in _cells("blank"):
        exec(_src(cell), ns)
    return ns


def test_every_exercise_has_a_solution_and_wrong_answers():
    assert len(EXERCISES) >= 6
    assert set(SOLUTIONS) == set(EXERCISES)
    assert {w.exercise for w in WRONG} == set(EXERCISES)
    codes = [(w.exercise, w.mistake) for w in WRONG]
    assert len(codes) == len(set(codes)), "each wrong answer should show a different mistake"


def test_notebook_has_one_blank_and_one_check_per_exercise(blanks):
    names = [n for n in EXERCISES if callable(blanks.get(n))]
    assert names == list(EXERCISES), f"blank functions found in the notebook: {names}"
    calls = "\n".join(_src(c) for c in _cells())
    for name, check in EXERCISES.items():
        assert f"{check.__name__}({name})" in calls
        assert list(inspect.signature(blanks[name]).parameters) == list(inspect.signature(SOLUTIONS[name]).parameters)


@pytest.mark.parametrize("name", list(EXERCISES))
def test_solution_passes(name, capsys):
    result = EXERCISES[name](SOLUTIONS[name])
    printed = capsys.readouterr().out
    assert isinstance(result, CheckResult)
    assert result.passed, result.message
    assert result.mistake == "" and printed.startswith(f"PASS  {name}: ")


@pytest.mark.parametrize("name, fn", [(n, f) for n, fns in ALTERNATIVES.items() for f in fns],
                         ids=[f.__name__ for fns in ALTERNATIVES.values() for f in fns])
def test_other_correct_answers_pass(name, fn):
    """A check judges what a function did, not how it is written: AVG, a copy sent back, an ExitStack, ..."""
    result = EXERCISES[name](fn, quiet=True)
    assert result.passed, result.message


def test_changed_exercises_have_other_correct_answers():
    for name in ("global_mean", "average_gradients", "accumulation_step"):
        assert len(ALTERNATIVES.get(name, [])) >= 2, name


@pytest.mark.parametrize("name", list(EXERCISES))
def test_blank_says_not_done_yet(name, blanks, capsys):
    result = EXERCISES[name](blanks[name])
    printed = capsys.readouterr().out
    assert not result.passed and result.mistake == NOT_DONE and not result.done
    assert printed == f"NOT DONE YET  {name}: replace each `raise NotImplementedError()` line with your code, " \
                      "then run this cell again.\n"
    assert "Traceback" not in printed


def test_empty_body_also_says_not_done_yet(capsys):
    def average_gradients(model):
        """Only a docstring and `...`: nothing written yet."""
        ...

    result = EXERCISES["average_gradients"](average_gradients)
    assert result.mistake == NOT_DONE and "still empty" in result.hint


@pytest.mark.parametrize("wrong", WRONG, ids=[f"{w.exercise}-{w.mistake}" for w in WRONG])
def test_typical_wrong_answer_gets_its_hint(wrong, capsys):
    """The first failure prints the nudge; the specific mistake is in .detail; neither spells out the solution."""
    result = EXERCISES[wrong.exercise](wrong.fn)
    printed = capsys.readouterr().out
    name = wrong.exercise
    assert_gets_its_hint(wrong, EXERCISES[name], SOLUTIONS[name], result, printed)


def test_every_typical_mistake_has_a_nudge():
    missing = {(w.exercise, w.mistake) for w in WRONG
               if w.mistake not in NO_NUDGE and not nudge(EXERCISES[w.exercise], w.mistake)}
    assert not missing, f"mistakes without a first-tier hint: {sorted(missing)}"


@pytest.mark.parametrize("exercise_name, mistake", [("global_mean", "no_divide"),
                                                    ("accumulation_step", "loss_not_scaled")])
def test_asking_again_gives_the_specific_mistake(exercise_name, mistake, capsys):
    wrong = next(w for w in WRONG if (w.exercise, w.mistake) == (exercise_name, mistake))
    check = EXERCISES[exercise_name]
    first, second, third = (check(wrong.fn) for _ in range(3))
    printed = capsys.readouterr().out.splitlines()
    assert first.nudged and wrong.hint not in first.hint
    assert not second.nudged and second.hint == first.detail and wrong.hint in second.hint
    assert third.hint == second.hint, "later failures keep the specific hint"
    assert printed == [f"TRY AGAIN  {exercise_name}: {r.hint}" for r in (first, second, third)]


def test_hint_tiers_are_counted_per_exercise(capsys):
    """A first failure in one exercise gets its nudge even after failures in another; reset_hints starts over."""
    by = {(w.exercise, w.mistake): w for w in WRONG}
    mean_wrong, avg_wrong = by[("global_mean", "no_divide")], by[("average_gradients", "no_divide")]
    EXERCISES["global_mean"](mean_wrong.fn, quiet=True)
    assert EXERCISES["average_gradients"](avg_wrong.fn, quiet=True).nudged
    assert not EXERCISES["global_mean"](mean_wrong.fn, quiet=True).nudged
    reset_hints("global_mean")
    assert EXERCISES["global_mean"](mean_wrong.fn, quiet=True).nudged


def test_a_blank_does_not_use_up_the_nudge(blanks):
    wrong = next(w for w in WRONG if (w.exercise, w.mistake) == ("global_mean", "no_divide"))
    assert EXERCISES["global_mean"](blanks["global_mean"], quiet=True).mistake == NOT_DONE
    assert EXERCISES["global_mean"](wrong.fn, quiet=True).nudged


@pytest.mark.parametrize("name, world_size", [("global_mean", 4), ("shard_indices", 3), ("make_loader", 4)])
def test_checks_run_at_another_world_size(name, world_size):
    """The graded hidden tests run each check at another world size: solutions pass there too."""
    result = EXERCISES[name](SOLUTIONS[name], quiet=True, world_size=world_size)
    assert result.passed, result.message
    assert str(world_size) in result.hint


def test_a_world_size_the_check_cannot_use_is_refused():
    from ddp_helpers.engine.config import ConfigError

    with pytest.raises(ConfigError, match="world_size=1"):
        EXERCISES["global_mean"](SOLUTIONS["global_mean"], world_size=1)
    with pytest.raises(ConfigError, match="divides 40"):
        EXERCISES["make_loader"](SOLUTIONS["make_loader"], world_size=3)


def test_an_unexpected_error_is_named_with_its_line(capsys):
    def global_mean(value):
        return value.no_such_method()

    result = EXERCISES["global_mean"](global_mean)
    assert result.mistake == "error"
    assert "AttributeError on rank 0 at `return value.no_such_method()`" in result.hint
    assert "Traceback" not in capsys.readouterr().out


def test_one_ranks_mistake_ends_init_group_at_once(tmp_path, monkeypatch):
    """Rank 1's wrong rank is named before the rendezvous; rank 0, already waiting there (20 s timeout), is ended:
    the check returns well within that timeout of the moment rank 1's mistake was named."""
    import ddp_helpers.exercises._harness as H
    import ddp_helpers.exercises.init_group as G

    found = G._membership_problem

    def noted(a, rank, world_size):  # in the rank: the moment the watched init_process_group names the mistake
        problem = found(a, rank, world_size)
        if problem is not None:
            (tmp_path / f"rank{rank}").write_text(repr(time.monotonic()))  # CLOCK_MONOTONIC: every process's
        return problem

    monkeypatch.setattr(G, "_membership_problem", noted)
    monkeypatch.setattr(H, "START_METHOD", "fork")  # the ranks inherit the patch
    wrong = next(w for w in WRONG if (w.exercise, w.mistake) == ("init_group", "wrong_rank"))
    result = EXERCISES["init_group"](wrong.fn, quiet=True)
    returned = time.monotonic()
    assert result.mistake == "wrong_rank"
    named = float((tmp_path / "rank1").read_text())
    assert returned - named < 10, "the check waited for rank 0's rendezvous timeout"


@pytest.mark.parametrize("name", ["init_group", "global_mean"])
def test_a_function_that_ends_its_process_is_named(name):
    def ends_the_process(*args):
        os._exit(0)

    result = EXERCISES[name](ends_the_process, quiet=True)
    assert result.mistake == "rank_died" and "os._exit()" in result.hint, result.message


def test_checks_leave_the_callers_random_state_alone():
    import torch

    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    EXERCISES["accumulation_step"](SOLUTIONS["accumulation_step"], quiet=True)
    assert torch.equal(torch.rand(3), expected)


def test_summary_counts_passes():
    results = [CheckResult("a", True, "ok"), CheckResult("b", False, "x", NOT_DONE), CheckResult("c", False, "y", "z")]
    assert summarize(results).splitlines() == ["a                  done", "b                  not started",
                                               "c                  try again", "1 of 3 exercises pass"]


def _nbgrader_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("nbgrader") is not None


@pytest.mark.skipif(_nbgrader_installed(), reason="tests/exercises/test_nbgrader.py runs this notebook with the "
                    "same solutions in a real kernel (its sample-solved submission), hidden tests too")
@pytest.mark.slow
def test_solved_notebook_passes_in_a_real_kernel(tmp_path):
    """The blanks replaced by the solutions, run in a Jupyter kernel: fork really runs cell-defined functions."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(str(NOTEBOOK), as_version=4)
    for cell in nb.cells:
        if "blank" in cell.metadata.get("tags", []):
            name = next(n for n in EXERCISES if f"def {n}(" in cell.source)
            cell.source = inspect.getsource(SOLUTIONS[name])
    nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    last = "".join(o.get("text", "") for o in nb.cells[-2].outputs)
    assert last.rstrip().endswith(f"{len(EXERCISES)} of {len(EXERCISES)} exercises pass"), last


def test_a_group_that_fails_to_form_is_launched_again(monkeypatch):
    """A rank that failed inside the launcher's own group set-up (a busy machine) costs a retry, not a verdict."""
    from ddp_helpers.exercises import _harness
    from ddp_helpers.ranks.launcher import RankFailedError

    calls = []

    def flaky_launch(fn, world_size, **kwargs):
        calls.append(kwargs["init_group"])
        if len(calls) == 1:
            raise RankFailedError(0, "RuntimeError: Gloo connectFullMesh failed",
                                  traceback_text='File "rank.py", line 40, in init_group_from_env')
        return [{"rank": r} for r in range(world_size)]

    monkeypatch.setattr(_harness, "launch", flaky_launch)
    assert _harness.run_ranks(lambda *a: None, 2, ()) == [{"rank": 0}, {"rank": 1}]
    assert calls == [True, True]


def test_a_rank_dying_in_the_learners_code_is_not_retried(monkeypatch):
    from ddp_helpers.exercises import _harness
    from ddp_helpers.ranks.launcher import RankFailedError

    calls = []

    def dying_launch(fn, world_size, **kwargs):
        calls.append(1)
        raise RankFailedError(1, "exit code 3", traceback_text='File "<cell>", line 2, in global_mean')

    monkeypatch.setattr(_harness, "launch", dying_launch)
    with pytest.raises(_harness.Verdict) as v:
        _harness.run_ranks(lambda *a: None, 2, ())
    assert v.value.mistake == "rank_died" and len(calls) == 1


def _wrong(exercise_name, mistake):
    return next(w for w in WRONG if (w.exercise, w.mistake) == (exercise_name, mistake))


def test_the_forward_decides_as_the_hints_say():
    """torch's contract behind exercise 6's hints (DistributedDataParallel.no_sync, _pre_forward): a backward inside
    no_sync() after a forward outside it still all-reduces; a backward outside after a forward inside does not."""
    from ddp_helpers.exercises.accumulation import ACC_MICRO

    outside = EXERCISES["accumulation_step"](_wrong("accumulation_step", "forward_outside_no_sync").fn, quiet=True)
    assert f"all-reduced {ACC_MICRO} times" in outside.detail  # counted by a comm hook: each backward synced
    assert "micro-batches 1 and 2 ran inside" in outside.detail, outside.detail
    inside = EXERCISES["accumulation_step"](_wrong("accumulation_step", "last_forward_inside").fn, quiet=True)
    assert inside.mistake == "last_forward_inside" and "the backward of micro-batch 3 ran outside" in inside.detail


def test_a_forward_outside_no_sync_is_not_called_a_missing_no_sync():
    """The two mistakes give the same symptom (one all-reduce per micro-batch) and different hints."""
    without = EXERCISES["accumulation_step"](_wrong("accumulation_step", "no_no_sync").fn, quiet=True)
    misplaced = EXERCISES["accumulation_step"](_wrong("accumulation_step", "forward_outside_no_sync").fn, quiet=True)
    assert without.mistake == "no_no_sync" and "forward decides" not in without.detail
    assert misplaced.mistake == "forward_outside_no_sync" and "forward decides" in misplaced.detail
    assert "The forward pass should be included inside the context manager" in misplaced.detail


@pytest.mark.parametrize("exercise_name", ["global_mean", "average_gradients"])
def test_an_allreduce_of_a_copy_is_not_called_a_missing_allreduce(exercise_name):
    """Unchanged values after an all_reduce of a copy: the hint says a copy was reduced, not "call all_reduce"."""
    missing = EXERCISES[exercise_name](_wrong(exercise_name, "no_allreduce").fn, quiet=True)
    copy = EXERCISES[exercise_name](_wrong(exercise_name, "reduced_copy").fn, quiet=True)
    assert missing.mistake == "no_allreduce" and "no all_reduce was called" in missing.detail
    assert copy.mistake == "reduced_copy" and "you all-reduced a copy of" in copy.detail
    assert "no all_reduce was called" not in copy.detail


def test_divided_twice_names_the_operation_used():
    avg = EXERCISES["global_mean"](_wrong("global_mean", "divided_twice").fn, quiet=True)  # AVG, then / world size
    assert "ReduceOp.AVG already divides, and you divided again" in avg.detail

    def divide_before_and_after(model):
        for p in model.parameters():
            p.grad /= dist.get_world_size()
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()

    twice = EXERCISES["average_gradients"](divide_before_and_after, quiet=True)
    assert twice.mistake == "divided_twice" and "ReduceOp.SUM adds" in twice.detail


def test_a_partly_averaged_model_says_what_happened_to_each_parameter():
    def bias_not_divided(model):
        weight, bias = model.parameters()
        dist.all_reduce(weight.grad)
        dist.all_reduce(bias.grad)
        weight.grad /= dist.get_world_size()

    result = EXERCISES["average_gradients"](bias_not_divided, quiet=True)
    assert result.mistake == "some_params"
    assert "bias all-reduced but not divided by the world size" in result.detail, result.detail
    assert "loop over all" not in result.detail  # every parameter was reached: the loop is not the problem
    forgotten = EXERCISES["average_gradients"](_wrong("average_gradients", "some_params").fn, quiet=True)
    assert "bias never all-reduced" in forgotten.detail and "loop over all" in forgotten.detail


def test_the_story_of_an_accumulation_step_is_read_per_micro_batch():
    """The event log a rank records, read without launching: micro-batch numbers, where forward and backward ran."""
    from ddp_helpers.exercises.accumulation import _Story

    events = [("zero_grad", "optimizer"), ("forward", 1, True), ("backward", 1, False), ("forward", 3, False),
              ("backward", 3, True), ("module_forward", 5), ("backward", 5, True), ("allreduce",), ("step",),
              ("zero_grad", "optimizer")]
    s = _Story.read(events)
    assert s.ddp_sync == {1: True, 2: False} and s.bypassed == [3]
    assert s.backward_sync == {1: False, 2: True, 3: True}
    assert s.forward_outside() == [1] and s.forward_inside() == [2]
    assert s.allreduces == 1 and s.steps == 1 and s.zero_grads == [("optimizer", 0)]  # after the step: not counted


def test_init_group_by_environment_variables_passes():
    """The hint's other way: MASTER_ADDR and MASTER_PORT set to the given port, then the default env://."""
    import os

    import torch.distributed as dist

    from ddp_helpers.exercises import check_init_group

    def init_group(rank, world_size, port):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world_size)

    assert check_init_group(init_group).passed


def test_a_call_torch_refuses_on_every_rank_is_named_as_the_call_not_a_lost_peer():
    """A TypeError raised inside torch.distributed about the learner's own argument, on every rank: the hint names
    the call, the argument and the fix, and says every rank; it is no collective a peer never joined."""
    def global_mean(value):
        # a list, not a tensor: all_reduce's own check refuses it
        dist.all_reduce(value.tolist())
        return value

    result = EXERCISES["global_mean"](global_mean, quiet=True)
    assert result.mistake == "refused_call", result.message
    assert result.detail.startswith("dist.all_reduce refused your call at `dist.all_reduce(value.tolist())` on every "
                                    "rank"), result.detail
    assert "passed tensor=[" in result.detail and "(a list): pass a tensor" in result.detail
    assert "never joined" not in result.detail


def test_refused_call_reads_the_argument_from_torchs_frame():
    """Without launching: init_process_group refuses timeout=30 before it looks for any peer."""
    from ddp_helpers.exercises._errors import error_report

    def init_group():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:1", rank=0, world_size=1, timeout=30)

    try:
        init_group()
    except TypeError as e:
        report = error_report(e, init_group)
    assert report["refused"] == {"call": "init_process_group", "argument": "timeout", "value": "30",
                                 "value_type": "int"}
    assert report["comm"] is False and report["type"] == "TypeError"


def test_an_error_of_the_learners_own_line_is_not_a_refused_call():
    from ddp_helpers.exercises._errors import error_report

    def global_mean(value):
        raise TypeError("my own")

    try:
        global_mean(None)
    except TypeError as e:
        report = error_report(e, global_mean)
    assert report["refused"] is None and report["comm"] is False


def test_a_loss_divided_by_the_world_size_instead_of_the_micro_batches_is_named():
    import torch.nn.functional as F

    def accumulation_step(ddp_model, optimizer, micro_batches):
        optimizer.zero_grad()
        for i, (x, y) in enumerate(micro_batches):
            loss = F.cross_entropy(ddp_model(x), y) / dist.get_world_size()
            if i < len(micro_batches) - 1:
                with ddp_model.no_sync():
                    loss.backward()
            else:
                loss.backward()
        optimizer.step()

    result = EXERCISES["accumulation_step"](accumulation_step, quiet=True)
    assert result.mistake == "divided_by_world_size" and "instead of by the number of micro-batches" in result.detail


def test_shards_drawn_in_a_forked_global_rng_pass():
    """The check judges the global state after the call: fork_rng restores it, so only the result counts."""
    from teacher.solutions import shard_indices_forked_rng

    assert EXERCISES["shard_indices"](shard_indices_forked_rng, quiet=True).passed
