"""The engine's parts, one at a time: the step plan, the recording hook, results back into a model, no side
effects on the caller, the loop's edges (uneven shards, loader workers), and functions short enough to read."""
from __future__ import annotations

import ast
import pathlib

import numpy as np
import pytest
import torch

from ddp_helpers import TrainConfig, build_model, launch, run_training, train_single_process
from ddp_helpers.engine.plan import StepPlan
from ddp_helpers.engine.telemetry import RankField, StepFloat, StepInt, TableShape

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "ddp_helpers"


# ------------------------------------------------------------------------------------------ the step plan
def _walk(plan: StepPlan, batches_per_epoch: int):
    return [(step, micro) for step, micro in plan.steps(
        lambda epoch: [(epoch, b) for b in range(batches_per_epoch)])]


@pytest.mark.parametrize("accumulation", [1, 2, 3])
def test_plan_visits_every_batch_once_in_groups(accumulation):
    cfg = TrainConfig(dataset="mnist-5k", batch_size=64, epochs=2, accumulation_steps=accumulation)
    plan = StepPlan.for_run(cfg, n_train=4000, world_size=2)  # 2000 per rank: 32 batches, the last short
    steps = _walk(plan, 32)
    assert [s for s, _ in steps] == list(range(plan.end)) and plan.end == 2 * -(-32 // accumulation)
    seen = [b for _, micro in steps for b in micro]
    assert seen == [(e, b) for e in range(2) for b in range(32)]  # every batch of both epochs, in order, once
    assert all(len(m) == accumulation for _, m in steps if m[-1][1] != 31)  # only an epoch's last step is short


def test_a_resumed_plan_continues_where_the_full_one_was():
    cfg = TrainConfig(dataset="mnist-5k", epochs=3, accumulation_steps=2)
    full = _walk(StepPlan.for_run(cfg, 4000, 2), 32)
    for k in (1, 15, 16, 17, 40):
        assert _walk(StepPlan.for_run(cfg, 4000, 2, start_step=k), 32) == full[k:], k


def test_max_steps_ends_the_plan_and_a_resume_past_it_makes_none():
    cfg = TrainConfig(dataset="mnist-5k", max_steps=5)
    assert [s for s, _ in _walk(StepPlan.for_run(cfg, 4000, 2), 32)] == [0, 1, 2, 3, 4]
    assert StepPlan.for_run(cfg, 4000, 2, start_step=9).n_steps == 0


def test_telemetry_tables_are_sized_from_their_column_names():
    specs = TableShape(max_steps=3, samples_per_step=4, n_capture=0, n_params=5).specs()
    assert specs["f64"][1] == (3, len(StepFloat)) and specs["i64"][1] == (3, len(StepInt))
    assert specs["info"][1] == (len(RankField),) and specs["samples"][1] == (3, 4)


# ------------------------------------------------------------------------------------------ the hook
def test_recording_hook_changes_nothing_but_records(small_cfg):
    with_hook = run_training(small_cfg, progress=False, start_method="fork")
    builtin = run_training(small_cfg.replace(telemetry=False), progress=False, start_method="fork")
    # torch's allreduce_hook behind the recorder does what DDP's built-in C++ all-reduce does, bit for bit.
    assert np.array_equal(with_hook.final_params, builtin.final_params)
    assert with_hook.allreduce_calls == [8, 8] and builtin.allreduce_calls == [0, 0]
    assert with_hook.bytes_allreduced == [8 * 7850 * 4.0] * 2  # one float32 bucket of 7,850 gradients a step


GRAD = (1e5, 1e-4, 3e-8)  # too big for float16; small, rounded; below half of float16's smallest subnormal


def _synced_grad(rank, world_size, comm_hook):
    """Both ranks' gradient is GRAD; the gradient after DDP's all-reduce through the package's hook."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddp_helpers.engine.hooks import attach_recorder

    model = torch.nn.Linear(3, 1, bias=False)
    ddp = DDP(model)
    attach_recorder(ddp, comm_hook, record=False)
    (ddp(torch.tensor([GRAD])) * 1.0).sum().backward()  # d/dw of w . GRAD is GRAD
    return model.weight.grad.reshape(-1).tolist()


def test_fp16_hook_casts_before_it_divides_so_big_entries_overflow_and_tiny_ones_vanish():
    exact, fp16 = (launch(_synced_grad, 2, args=(h,), start_method="fork")[0] for h in ("allreduce", "fp16"))
    assert exact == pytest.approx(list(GRAD), rel=1e-6)  # the mean of two equal gradients: the gradient
    # 1e5 / 2 would fit float16 (max 65504): inf means the cast came first. 3e-8 is 0 in float16.
    assert fp16[0] == float("inf") and fp16[2] == 0.0
    assert fp16[1] != GRAD[1] and fp16[1] == pytest.approx(GRAD[1], rel=1e-3)  # rounded to ~3 digits


# ------------------------------------------------------------------------------------------ results into a model
def test_result_loads_into_a_model_that_predicts_like_the_trained_one(small_run):
    data_x = torch.randn(16, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    model = small_run.model()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert np.array_equal(flat.numpy(), small_run.final_params)
    assert not np.array_equal(small_run.final_params, build_model(0).state_dict()["1.weight"].reshape(-1).numpy())
    mine = small_run.load_into(build_model(7))
    assert torch.equal(mine(data_x), model(data_x))
    with torch.no_grad():
        for p in mine.parameters():
            p.zero_()  # the model owns its copy: the result keeps the trained values
    assert np.array_equal(torch.cat([p.reshape(-1) for p in small_run.model().parameters()]).detach().numpy(),
                          small_run.final_params)


def test_load_into_a_model_of_another_shape_names_the_fix(small_run):
    with pytest.raises(ValueError, match=r"7850 parameters .* result.model\(\)"):
        small_run.load_into(torch.nn.Linear(10, 2))


# ------------------------------------------------------------------------------------------ no side effects
def _caller_state():
    return torch.get_rng_state().clone(), torch.get_num_threads()


@pytest.mark.parametrize("call", ["run_training", "train_single_process", "build_model"])
def test_the_callers_random_state_and_threads_are_left_alone(call, small_cfg):
    torch.manual_seed(1234)
    torch.set_num_threads(2)
    rng, threads = _caller_state()
    if call == "run_training":
        run_training(small_cfg, progress=False, start_method="fork")
    elif call == "train_single_process":
        train_single_process(small_cfg.replace(threads_per_rank=1))
    else:
        build_model(5)
    after_rng, after_threads = _caller_state()
    assert torch.equal(rng, after_rng), f"{call} moved the caller's torch random state"
    assert after_threads == threads, f"{call} changed torch's thread count from {threads} to {after_threads}"


# ------------------------------------------------------------------------------------------ the loop's edges
@pytest.mark.slow
def test_uneven_data_never_hangs_three_ranks():
    """4,000 samples over 3 ranks: DistributedSampler pads to 1,334 each, so all ranks take 21 steps."""
    res = run_training(TrainConfig(dataset="mnist-5k", world_size=3, threads_per_rank=1), progress=False,
                       start_method="fork")
    assert [len(r) for r in res.ranks] == [21, 21, 21]
    assert res.fingerprints_agree()
    last = res.ranks[0].sample_indices[-1]
    assert (last >= 0).sum() == 1334 - 20 * 64  # the short last batch is the same size on every rank


def test_seed_pipeline_stops_its_loader_workers_before_the_rank_ends(tmp_path, monkeypatch):
    # A rank ends with os._exit, which skips the finalizers of live DataLoader workers' queues: their
    # semaphores then "leak" (Python warns at shutdown). The loop must release its loader first.
    import psutil

    import ddp_helpers.engine.worker as W

    original = W.evaluate

    def evaluate_and_count_workers(model, data, rank, *args, **kwargs):
        # evaluate runs right after the training loop: the loader's workers must be gone by now
        (tmp_path / f"rank{rank}").write_text(str(len(psutil.Process().children())))
        return original(model, data, rank, *args, **kwargs)

    monkeypatch.setattr(W, "evaluate", evaluate_and_count_workers)  # forked ranks inherit the patch
    cfg = TrainConfig(dataset="mnist-5k", max_steps=3, threads_per_rank=1, pipeline="seed", num_workers=2)
    run_training(cfg, progress=False, start_method="fork")
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["0", "0"]


# ------------------------------------------------------------------------------------------ readable code
TABLES = {("config.py", "check_types")}  # one check per setting: a table, read line by line


def _long_functions(limit: int = 60):
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit and (path.name, node.name) not in TABLES:
                    yield f"{path.relative_to(PACKAGE)}:{node.lineno} {node.name}() is {n} lines"


def test_no_function_in_the_package_is_longer_than_60_lines():
    assert list(_long_functions()) == []


def test_the_ddp_loop_reads_like_the_listing():
    from ddp_helpers.engine import worker
    import inspect

    src = inspect.getsource(worker.train)
    order = ["optimizer.zero_grad", "forward_backward(", "optimizer.step()"]
    positions = [src.index(s) for s in order]
    assert positions == sorted(positions) and len(src.splitlines()) <= 35
