"""The checked exercises of notebooks 0, 3b, 11 and 12: solutions and other correct answers pass, the notebooks' blanks
say "not done yet", each typical mistake gets its own hint (a nudge first), and no hint hands over the code."""
from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # teacher/ sits next to the package, outside it (not installed on purpose)

from ddp_helpers import launch  # noqa: E402
from ddp_helpers.exercises import EXERCISES, NOT_DONE, PRACTICE_EXERCISES, reset_hints  # noqa: E402
from ddp_helpers.exercises._harness import NO_NUDGE  # noqa: E402
from teacher.solutions import PRACTICE_ALTERNATIVES, PRACTICE_SOLUTIONS  # noqa: E402
from teacher.wrong_answers import PRACTICE_WRONG  # noqa: E402

from _hints import assert_gets_its_hint, nudge  # noqa: E402

NOTEBOOKS = {"global_loss": "11_mixed_precision_and_compile", "load_checkpoint": "11_mixed_precision_and_compile",
             "replicas_agree": "12_debugging_elastic_and_sharding", "bucketed_sync": "03b_build_ddp_sync",
             "after_backward": "00_core_path", "as_gradients_arrive": "00_core_path"}
# What the learner writes, where it is a class (notebook 0's stop 5) rather than a function of the exercise's name.
CLASSES = {"after_backward": "AfterBackward", "as_gradients_arrive": "AsGradientsArrive"}
# The heading the blank comes after: the notebook's Exercises section, or notebook 0's stop 5.
SECTIONS = {"after_backward": "## Stop 5", "as_gradients_arrive": "## Stop 5"}


@pytest.fixture(autouse=True)
def fresh_hints():
    """Every test starts as a learner who has not failed a check yet (the first failure gets the nudge)."""
    reset_hints()
    yield
    reset_hints()


def _cells(notebook: str) -> list:
    nb = json.loads((ROOT / "notebooks" / f"{notebook}.ipynb").read_text(encoding="utf-8"))
    return [{**c, "source": "".join(c["source"])} for c in nb["cells"]]


def _written(name: str) -> str:
    """The name the learner's answer has in the notebook: the function's, or the class's."""
    return CLASSES.get(name, name)


def _definition(name: str) -> str:
    return f"class {CLASSES[name]}:" if name in CLASSES else f"def {name}("


def _blank(name: str) -> dict:
    return next(c for c in _cells(NOTEBOOKS[name]) if c["source"].startswith(_definition(name)))


def _wrong(exercise_name: str, mistake: str):
    return next(w for w in PRACTICE_WRONG if (w.exercise, w.mistake) == (exercise_name, mistake))


def test_every_practice_exercise_has_a_solution_other_answers_and_wrong_answers():
    assert set(PRACTICE_EXERCISES) == set(PRACTICE_SOLUTIONS) == set(NOTEBOOKS)
    assert not set(PRACTICE_EXERCISES) & set(EXERCISES), "a lesson's exercise shadows the exercise notebook's"
    assert all(len(PRACTICE_ALTERNATIVES[n]) >= 2 for n in PRACTICE_EXERCISES)
    codes = [(w.exercise, w.mistake) for w in PRACTICE_WRONG]
    assert {e for e, _ in codes} == set(PRACTICE_EXERCISES) and len(codes) == len(set(codes))
    assert all(sum(e == n for e, _ in codes) >= 5 for n in PRACTICE_EXERCISES)


@pytest.mark.parametrize("name", list(PRACTICE_EXERCISES))
def test_the_notebook_has_the_blank_and_its_check_in_its_exercises_section(name):
    cells = _cells(NOTEBOOKS[name])
    blank = _blank(name)
    at = cells.index(blank)
    section = SECTIONS.get(name, "## Exercises")
    assert any(section in c["source"] for c in cells[:at] if c["cell_type"] == "markdown")
    assert "blank" in blank["metadata"].get("tags", []) and "raise NotImplementedError()" in blank["source"]
    ns: dict = {}
    exec(blank["source"], ns)
    written = ns[_written(name)]
    assert list(inspect.signature(written).parameters) == list(inspect.signature(PRACTICE_SOLUTIONS[name]).parameters)
    check = cells[at + 1]
    assert f"check_{name}({_written(name)})" in check["source"]
    # Printed (a stream) or displayed (the verdict's text/plain, as a kernel shows it since #44): the same line.
    stored = "".join("".join(o.get("text", "") or o.get("data", {}).get("text/plain", "")) for o in check["outputs"])
    assert stored.startswith(f"NOT DONE YET  {name}: "), stored


def test_the_teacher_answers_cover_each_checked_exercise():
    for name, notebook in NOTEBOOKS.items():
        text = (ROOT / "teacher" / "notebook_answers" / f"{notebook}.md").read_text(encoding="utf-8")
        assert _definition(name) in text and f"check_{name}" in text, (name, notebook)


@pytest.mark.parametrize("name", list(PRACTICE_EXERCISES))
def test_solution_passes(name, capsys):
    result = PRACTICE_EXERCISES[name](PRACTICE_SOLUTIONS[name])
    printed = capsys.readouterr().out
    assert result.passed, result.message
    assert printed == f"PASS  {name}: {result.hint}\n"


@pytest.mark.parametrize("name, fn", [(n, f) for n, fns in PRACTICE_ALTERNATIVES.items() for f in fns],
                         ids=[f.__name__ for fns in PRACTICE_ALTERNATIVES.values() for f in fns])
def test_other_correct_answers_pass(name, fn):
    """A check judges what a function did: float64 or float32, an all_gather, a mapping, a broadcast, ..."""
    result = PRACTICE_EXERCISES[name](fn, quiet=True)
    assert result.passed, result.message


@pytest.mark.parametrize("name, world_size", [("global_loss", 4), ("load_checkpoint", 3), ("replicas_agree", 4),
                                              ("bucketed_sync", 4), ("as_gradients_arrive", 4)])
def test_checks_run_at_another_world_size(name, world_size):
    result = PRACTICE_EXERCISES[name](PRACTICE_SOLUTIONS[name], quiet=True, world_size=world_size)
    assert result.passed and str(world_size) in result.hint, result.message


@pytest.mark.parametrize("name", list(PRACTICE_EXERCISES))
def test_the_notebooks_blank_says_not_done_yet(name, capsys):
    ns: dict = {}
    exec(_blank(name)["source"], ns)
    capsys.readouterr()
    result = PRACTICE_EXERCISES[name](ns[_written(name)])
    assert result.mistake == NOT_DONE and not result.done
    assert capsys.readouterr().out == (f"NOT DONE YET  {name}: replace each `raise NotImplementedError()` line "
                                       "with your code, then run this cell again.\n")


@pytest.mark.parametrize("wrong", PRACTICE_WRONG, ids=[f"{w.exercise}-{w.mistake}" for w in PRACTICE_WRONG])
def test_typical_wrong_answer_gets_its_hint(wrong, capsys):
    """The first failure prints the nudge; the specific mistake is in .detail; neither spells out the solution."""
    result = PRACTICE_EXERCISES[wrong.exercise](wrong.fn)
    printed = capsys.readouterr().out
    name = wrong.exercise
    assert_gets_its_hint(wrong, PRACTICE_EXERCISES[name], PRACTICE_SOLUTIONS[name], result, printed)


def test_every_typical_mistake_has_a_nudge():
    missing = {(w.exercise, w.mistake) for w in PRACTICE_WRONG
               if w.mistake not in NO_NUDGE and not nudge(PRACTICE_EXERCISES[w.exercise], w.mistake)}
    assert not missing, f"mistakes without a first-tier hint: {sorted(missing)}"


def test_asking_again_names_the_missing_barrier():
    wrong = _wrong("load_checkpoint", "no_barrier")
    first, second = (PRACTICE_EXERCISES["load_checkpoint"](wrong.fn, quiet=True) for _ in range(2))
    assert first.nudged and not second.nudged and wrong.hint in second.hint


# ------------------------------------------------------------------------------- what the checks rest on
def test_the_sample_counts_tell_every_wrong_formula_apart():
    """global_loss's numbers: the weighted mean, the plain mean of means, the sum of means, the sum over samples,
    that sum / world size and / each rank's own count all differ, at every world size a check runs."""
    from ddp_helpers.exercises.global_loss import _count, _loss

    for w in (2, 3, 4, 5):
        losses = np.array([_loss(r) for r in range(w)])
        counts = np.array([_count(r) for r in range(w)], dtype=float)
        total = (losses * counts).sum()
        candidates = [total / counts.sum(), losses.mean(), losses.sum(), total, total / w, *(total / counts)]
        assert len({round(c, 6) for c in candidates}) == len(candidates), w


def test_a_sum_or_norm_cannot_see_the_swapped_values_but_a_fingerprint_can():
    from ddp_helpers import fingerprint
    from ddp_helpers.exercises.replicas_agree import CASES, replica

    same, other = replica(), replica()
    CASES["swapped"][0](other)
    flat = [torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in (same, other)]
    assert not torch.equal(*flat)
    assert flat[0].sum() == flat[1].sum() and flat[0].norm() == flat[1].norm()  # exact: multiples of 1/64
    assert fingerprint(same.parameters()) != fingerprint(other.parameters())
    bit = replica()
    CASES["one_bit"][0](bit)
    assert torch.allclose(flat[0], torch.cat([p.detach().reshape(-1) for p in bit.parameters()]))


def test_the_late_write_catches_a_missing_barrier_every_time():
    """Rank 0 writes only once the others have loaded (or entered a collective): the race is not left to luck."""
    wrong = _wrong("load_checkpoint", "no_barrier")
    results = [PRACTICE_EXERCISES["load_checkpoint"](wrong.fn, quiet=True, world_size=w) for w in (2, 3, 2)]
    assert [r.mistake for r in results] == ["no_barrier"] * 3


def test_a_map_location_function_is_tried_on_cpu_only():
    from teacher.solutions import load_checkpoint_function

    result = PRACTICE_EXERCISES["load_checkpoint"](load_checkpoint_function, quiet=True)
    assert result.passed and "could not be tried on the meta device" in result.hint


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: a cuda:0 tag then loads onto it")
def test_without_map_location_a_gpu_machine_loads_onto_the_saving_gpu():
    result = PRACTICE_EXERCISES["load_checkpoint"](_wrong("load_checkpoint", "no_map_location").fn, quiet=True)
    assert result.mistake == "no_map_location" and "came back on cuda:0" in result.detail, result.detail


def test_a_check_leaves_the_kernels_torch_load_alone():
    before = torch.load
    PRACTICE_EXERCISES["load_checkpoint"](PRACTICE_SOLUTIONS["load_checkpoint"], quiet=True)
    assert torch.load is before is torch.serialization.load


def _gathered_twice(rank, world_size):
    from ddp_helpers.exercises._watch import watch_collectives

    def learner():
        out = [None] * world_size
        dist.all_gather_object(out, rank)  # torch's own all_gathers inside it are not the learner's
        dist.all_reduce(torch.ones(3, dtype=torch.float64), op=dist.ReduceOp.MAX)
        dist.barrier()
        return out

    with watch_collectives(learner) as records:
        learner()
    return [(r["op"], r["reduce"], r["numel"], r["dtype"]) for r in records]


def test_the_collective_watcher_records_the_learners_calls_only():
    records = launch(_gathered_twice, 2, threads_per_rank=1)[0]
    assert records == [("all_gather_object", None, None, None), ("all_reduce", "MAX", 3, "float64"),
                       ("barrier", None, None, None)]


def test_a_file_read_before_the_barrier_is_not_called_a_missing_barrier():
    """The barrier is there and the load comes after it, but from bytes read before it: the hint says so."""
    import io

    def load_checkpoint(path, device):
        with open(path, "rb") as f:
            data = f.read()  # the old file's bytes, read before waiting
        dist.barrier()
        return torch.load(io.BytesIO(data), map_location=device, weights_only=True)

    result = PRACTICE_EXERCISES["load_checkpoint"](load_checkpoint, quiet=True)
    assert result.mistake == "stale_file" and "although rank 0 had written" in result.detail, result.detail


def test_the_pass_line_says_what_collectives_the_answer_ran():
    """One all_reduce is one collective; one all_gather_object call runs two all_gathers, and the PASS line says so."""
    from teacher.solutions import global_loss_gathered_objects

    one = PRACTICE_EXERCISES["global_loss"](PRACTICE_SOLUTIONS["global_loss"], quiet=True)
    assert one.passed and "with one all_reduce, on 2" in one.hint, one.hint
    objects = PRACTICE_EXERCISES["global_loss"](global_loss_gathered_objects, quiet=True)
    assert objects.passed, objects.message
    assert "with one collective call, all_gather_object, which torch ran as 2 all_gathers" in objects.hint


def test_comparing_the_first_and_last_rank_passes_on_2_ranks_only():
    """On 2 ranks the first and the last are every rank; on 3 and 4 a middle rank's difference must be seen."""
    wrong = _wrong("replicas_agree", "some_ranks")
    assert PRACTICE_EXERCISES["replicas_agree"](wrong.fn, quiet=True, world_size=2).passed
    for w, middle in ((3, 1), (4, 2)):
        result = PRACTICE_EXERCISES["replicas_agree"](wrong.fn, quiet=True, world_size=w)
        assert result.mistake == "some_ranks" and f"rank {middle}'s first weight" in result.detail, result.detail


def test_the_replicas_check_runs_on_2_3_and_4_ranks():
    result = PRACTICE_EXERCISES["replicas_agree"](PRACTICE_SOLUTIONS["replicas_agree"], quiet=True)
    assert result.passed and "on 2, 3 and 4 ranks" in result.hint, result.hint
