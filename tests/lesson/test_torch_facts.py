"""Every torch fact the notebooks quote, pinned against the installed torch (issue 58): a symbol that exists, a
default, a source line, a docstring phrase, an error text. A release that changes one turns its test red, and the
notebook cell named in the test's id says what to reword. Facts that differ between releases are asserted per
version. Needs torch and pytest only, so that it runs in a bare venv of any torch (docs/maintainers.md):
`python -m pytest tests/lesson/test_torch_facts.py --noconftest -p no:cacheprovider`.

C++ functions are pinned where the wheel ships their declaration (torch/include/.../reducer.hpp); a fact that
lives only in a compiled library (gloo's error texts, reducer.cpp's comments) is not pinned here, and
docs/maintainers.md lists those.
"""
from __future__ import annotations

import inspect
import re
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

DDP_MODULE = pytest.importorskip("torch.nn.parallel.distributed")
C10D = pytest.importorskip("torch.distributed.distributed_c10d")
VERSION = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", torch.__version__).groups())
INCLUDE = Path(torch.__file__).parent / "include"


def _source(obj) -> str:
    return inspect.getsource(obj)


def _squeezed(text: str) -> str:
    """text with every run of white space one space: docstrings and sources wrap differently by release."""
    return " ".join(text.split())


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """A one-rank gloo group in this process (a FileStore in a private temporary folder)."""
    store = tmp_path_factory.mktemp("facts") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()


# ------------------------------------------------------------------ defaults and symbols
def test_00_35_07_11_bucket_cap_mb_defaults_to_25_mib():
    assert DDP_MODULE._DEFAULT_BUCKET_CAP_MB == 25
    assert "bucket_cap_mb if bucket_cap_mb is not None else _DEFAULT_BUCKET_CAP_MB" in _squeezed(
        _source(DDP_MODULE._BucketCapacityConfig.create))


def test_00_35_03_03b27_11_the_first_bucket_is_1_mib_only_at_the_default_cap():
    assert dist._DEFAULT_FIRST_BUCKET_BYTES == 1024 * 1024
    src = _squeezed(_source(DDP_MODULE._BucketCapacityConfig.create))
    assert "is_using_default = bucket_cap_mb is None" in src
    assert "dist._DEFAULT_FIRST_BUCKET_BYTES if is_using_default else bucket_bytes_cap" in src
    given = DDP_MODULE._BucketCapacityConfig.create(0.3, None, False)
    default = DDP_MODULE._BucketCapacityConfig.create(None, None, False)
    assert given.first_bucket_bytes_cap == given.bucket_bytes_cap == int(0.3 * 2 ** 20)
    assert default.first_bucket_bytes_cap == 2 ** 20 and default.bucket_bytes_cap == 25 * 2 ** 20


def test_03b27_03_07_one_unlimited_first_bucket_unless_find_unused_parameters():
    cfg = DDP_MODULE._BucketCapacityConfig.create(None, None, False)
    assert cfg.compute_bucket_size_limits(static_graph=False, find_unused_parameters=False)[0] == [sys.maxsize]
    assert cfg.compute_bucket_size_limits(static_graph=True, find_unused_parameters=True)[0] == [sys.maxsize]
    assert cfg.compute_bucket_size_limits(static_graph=False, find_unused_parameters=True)[0] == [
        2 ** 20, 25 * 2 ** 20]


def test_03b27_bucket_bytes_cap_default_says_whether_the_first_cap_is_smaller():
    src = _squeezed(_source(DDP.__init__))
    assert ("self.bucket_bytes_cap_default = ( self._bucket_config.first_bucket_bytes_cap "
            "< self._bucket_config.bucket_bytes_cap )") in src


def test_03b27_buckets_are_assigned_in_parameters_order_and_handed_to_the_reducer_reversed():
    src = _squeezed(_source(DDP._ddp_init_helper))
    assert "dist._compute_bucket_assignment_by_size( parameters," in src
    assert "list(reversed(bucket_indices))" in src
    assert "self._bucket_config.compute_bucket_size_limits(" in src
    assert "self._bucket_config.first_bucket_bytes_cap," in src  # handed to the Reducer


def test_03b27_find_unused_parameters_buckets_run_last_parameters_first(group):
    """With find_unused_parameters=True: bucket 0 holds the last parameters, in parameters() order."""
    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 100), torch.nn.Linear(100, 10))
    names = {id(p): n for n, p in model.named_parameters()}
    seen = []

    def hook(state, bucket):
        seen.append([names[id(p)] for p in bucket.parameters()])
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp = DDP(model, bucket_cap_mb=0.05, find_unused_parameters=True)
    ddp.register_comm_hook(None, hook)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "did not find any unused parameters": true, and not the point
        ddp(torch.randn(4, 100)).sum().backward()
    assert seen == [["1.bias", "2.weight", "2.bias"], ["0.weight", "0.bias", "1.weight"]]


def test_00_second_reading_one_bucket_first_then_rebuilt_in_gradient_order(group):
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 2))
    names = {id(p): n for n, p in model.named_parameters()}
    seen = []

    def hook(state, bucket):
        seen.append([names[id(p)] for p in bucket.parameters()])
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    ddp = DDP(model, bucket_cap_mb=0.0001)
    ddp.register_comm_hook(None, hook)
    steps = []
    for _ in range(2):
        seen.clear()
        ddp(torch.randn(3, 10)).sum().backward()
        steps.append(list(seen))
    assert steps[0] == [["0.weight", "0.bias", "1.weight", "1.bias"]]  # one bucket, in parameters() order
    assert len(steps[1]) > 1 and steps[1][0][0] == "1.bias"  # rebuilt: the last layer's gradients first


# ------------------------------------------------------------------ the Reducer (its header ships with torch)
REDUCER_HPP = INCLUDE / "torch" / "csrc" / "distributed" / "c10d" / "reducer.hpp"


@pytest.mark.parametrize("name", ["autograd_hook", "mark_variable_ready", "mark_variable_ready_dense",
                                  "mark_bucket_ready", "finalize_backward", "rebuild_buckets",
                                  "prepare_for_backward", "run_allreduce_hook", "delay_all_reduce",
                                  "should_rebuild_buckets"])
def test_00_03b_the_reducer_functions_named_are_declared(name):
    if not REDUCER_HPP.exists():
        pytest.skip(f"this torch ships no C++ headers ({REDUCER_HPP})")
    assert re.search(rf"\b{name}\s*\(", REDUCER_HPP.read_text())


def test_03b27_should_rebuild_buckets_reads_as_quoted():
    if not REDUCER_HPP.exists():
        pytest.skip(f"this torch ships no C++ headers ({REDUCER_HPP})")
    assert "return (static_graph_ || !find_unused_parameters_) && !has_rebuilt_bucket_;" in REDUCER_HPP.read_text()


def test_00_second_reading_future_wait_synchronizes_with_the_current_streams():
    ivalue = INCLUDE / "ATen" / "core" / "ivalue_inl.h"
    if not ivalue.exists():
        pytest.skip(f"this torch ships no C++ headers ({ivalue})")
    text = ivalue.read_text()
    wait = text[text.index("void wait()"):]
    assert "synchronizeWithCurrentStreams()" in wait[:wait.index("\n  }\n")]


def test_03b27_static_graph_delays_the_first_all_reduce_with_queue_callback():
    src = _squeezed(_source(DDP_MODULE._DDPSink.backward))
    assert "queue_callback(" in src and "_delay_all_reduce" in src


# ------------------------------------------------------------------ collectives and works
def test_00_6_all_reduce_waits_on_its_work_unless_async_op():
    src = _squeezed(_source(C10D.all_reduce))
    assert "if async_op: return work" in src and "work.wait()" in src


def test_00_6_03b9_work_wait_on_nccl_makes_the_stream_wait():
    doc = _squeezed(dist.Work.wait.__doc__)
    assert "Letting the current stream block on the completion of the NCCL work" in doc
    assert "it will block the CPU thread until the NCCL work is completed" in doc


def test_03b9_work_is_the_handle_to_a_pending_asynchronous_operation():
    assert "the handle to a pending asynchronous operation" in _squeezed(dist.Work.__doc__)


@pytest.mark.parametrize("op", ["SUM", "AVG", "MAX", "MIN", "PRODUCT"])
def test_00_9_01_10_the_reduce_ops_listed_exist(op):
    assert hasattr(dist.ReduceOp, op)


def test_00_9_01_10_gloo_accepts_avg_from_torch_2_8(group):
    t = torch.tensor([2.0, 4.0])
    if VERSION >= (2, 8):
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        assert t.tolist() == [2.0, 4.0]
    else:
        with pytest.raises(RuntimeError, match="Cannot use ReduceOp.AVG with Gloo"):
            dist.all_reduce(t, op=dist.ReduceOp.AVG)


def test_00_6_min_is_a_reduce_op_for_the_barrier(group):
    ok = torch.tensor([1])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    assert ok.item() == 1


@pytest.mark.parametrize("name", ["isend", "recv", "all_gather", "all_gather_object", "monitored_barrier",
                                  "barrier", "new_group", "TCPStore", "DistStoreError", "GradBucket"])
def test_00_01_03b_12_the_distributed_names_quoted_exist(name):
    assert hasattr(dist, name)


def test_12_36_monitored_barrier_takes_wait_all_ranks():
    assert "wait_all_ranks" in inspect.signature(dist.monitored_barrier).parameters


@pytest.mark.parametrize("method", ["buffer", "index", "is_last", "parameters"])
def test_07_25_a_grad_bucket_has_the_methods_quoted(method):
    assert callable(getattr(dist.GradBucket, method))


def test_01_28_init_barrier_is_the_environment_variable_default_0():
    src = _source(C10D)
    assert "def _is_barrier_after_init" in src and "def _store_based_barrier" in src
    assert re.search(r'TORCH_DIST_INIT_BARRIER", "0"', src)


# ------------------------------------------------------------------ hooks
def test_00_28_post_accumulate_grad_hooks_take_param_and_return_none():
    doc = torch.Tensor.register_post_accumulate_grad_hook.__doc__
    assert "hook(param: Tensor) -> None" in doc


def test_00_28_a_hook_that_returns_a_value_makes_backward_raise():
    w = torch.ones(2, requires_grad=True)
    w.register_post_accumulate_grad_hook(lambda p: p.grad)
    with pytest.raises(RuntimeError, match="post accumulate grad hooks should return None"):
        (w * 2).sum().backward()


def test_00_second_reading_allreduce_hook_divides_before_its_all_reduce():
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    assert callable(default_hooks.allreduce_hook)
    src = _squeezed(_source(default_hooks._allreduce_fut))
    assert "tensor.div_(group_to_use.size())" in src
    assert src.index("div_(") < src.index("all_reduce(")


@pytest.mark.parametrize("hook", ["fp16_compress_hook", "bf16_compress_hook"])
def test_05_13_the_compression_hooks_exist(hook):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    assert callable(getattr(default_hooks, hook))


@pytest.mark.parametrize("name", ["_register_accum_grad_hook", "_register_delay_all_reduce_hook",
                                  "_get_ddp_logging_data", "_check_sync_bufs_pre_fwd",
                                  "_check_global_requires_backward_grad_sync", "_sync_final_model",
                                  "_get_active_ddp_module", "register_comm_hook", "no_sync", "join"])
def test_03b17_07_09_10_11_the_ddp_methods_quoted_exist(name):
    assert callable(getattr(DDP, name))


def test_03b17_the_delayed_hook_divides_and_starts_one_async_all_reduce():
    register = _squeezed(_source(DDP._register_delay_all_reduce_hook))
    assert "param_to_hook_all_reduce.register_hook(self._delayed_all_reduce_hook)" in register
    hook = _squeezed(_source(DDP._delayed_all_reduce_hook))
    assert "div_(world_size)" in hook and "async_op=True" in hook


def test_10_16_join_divides_by_the_initial_world_size_by_default():
    params = inspect.signature(DDP.join).parameters
    assert params["divide_by_initial_world_size"].default is True
    assert params["throw_on_early_termination"].default is False


def test_10_10_join_notify_join_context_exists():
    from torch.distributed.algorithms.join import Join

    assert callable(Join.notify_join_context)


# ------------------------------------------------------------------ buffers
def test_00_17_09_10_buffers_sync_only_after_a_forward_that_syncs():
    will = _squeezed(_source(DDP.will_sync_module_buffers))
    assert "self.require_forward_param_sync and self.forward_sync_buffers" in will
    post = _squeezed(_source(DDP._post_forward))
    assert ("if torch.is_grad_enabled() and self.require_backward_grad_sync: "
            "self.require_forward_param_sync = True") in post
    assert "else: self.require_forward_param_sync = False" in post
    assert "self._check_sync_bufs_pre_fwd()" in _squeezed(_source(DDP._pre_forward))


def test_09_2_broadcast_buffers_renamed_forward_sync_buffers_from_2_13(group):
    params = inspect.signature(DDP.__init__).parameters
    if VERSION < (2, 13):
        assert "forward_sync_buffers" not in params and params["broadcast_buffers"].default is True
        return
    assert "forward_sync_buffers" in params
    with pytest.warns(FutureWarning, match="deprecated"):
        DDP(torch.nn.Linear(2, 2), broadcast_buffers=False)


# ------------------------------------------------------------------ docstrings and errors quoted
def test_03b31_05_2_no_sync_says_forward_goes_inside():
    assert ("The forward pass should be included inside the context manager, or else gradients will still be "
            "synchronized") in _squeezed(DDP.no_sync.__doc__)


def test_07_23_gradient_as_bucket_view_docstring_phrases():
    doc = _squeezed(DDP.__doc__)
    assert "the saved memory size will be equal to the total gradients size" in doc
    assert ("``gradient_as_bucket_view`` alone cannot avoid copies because the bucket view alias is destroyed "
            "every iteration") in doc


def test_09_12_sync_batchnorm_gathers_because_counts_differ():
    from torch.nn.modules import _functions

    src = _squeezed(re.sub(r"\n\s*#", " ", _source(_functions.SyncBatchNorm.forward)))  # a comment's lines joined
    assert "Use allgather instead of allreduce because count could be different across ranks" in src
    assert callable(torch.nn.SyncBatchNorm.convert_sync_batchnorm)


def test_09_33_an_unused_parameter_fails_the_second_step(group):
    class Half(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.unused = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)

        def forward(self, x):
            return self.used(x)

    ddp = DDP(Half())
    ddp(torch.ones(1, 2)).sum().backward()
    with pytest.raises(RuntimeError, match="Expected to have finished reduction in the prior iteration"):
        ddp(torch.ones(1, 2)).sum().backward()


def test_11_0_the_first_bucket_error_of_ddp_optimizer():
    from torch._dynamo.backends import distributed as dynamo_ddp

    src = _source(dynamo_ddp.DDPOptimizer.__init__)
    assert "First bucket should be smaller/equal to other buckets" in src
    assert "if self.first_bucket_cap > self.bucket_bytes_cap" in _squeezed(src)


@pytest.mark.parametrize("mode", ["ddp_optimizer", "no_optimization", "python_reducer",
                                  "python_reducer_without_compiled_forward"])
def test_11_20_optimize_ddp_modes(mode):
    from torch._dynamo import utils as dynamo_utils

    assert callable(dynamo_utils.get_optimize_ddp_mode)
    assert f'"{mode}"' in _source(dynamo_utils)


def test_11_20_the_python_reducer_sets_the_cpp_reducer_aside():
    assert "self._use_python_reducer" in _source(DDP.__init__)


def test_00_15_02_8_distributed_sampler_seeds_with_seed_plus_epoch_and_strides_by_rank():
    from torch.utils.data import DistributedSampler

    src = _squeezed(_source(DistributedSampler.__iter__))
    assert "g.manual_seed(self.seed + self.epoch)" in src
    assert "indices[self.rank : self.total_size : self.num_replicas]" in src
    assert callable(DistributedSampler.set_epoch)


def test_11_35_12_11_the_state_sync_helpers_exist():
    from torch.distributed import utils as dist_utils

    assert callable(dist_utils._sync_module_states) and callable(dist_utils._sync_params_and_buffers)


def test_11_10_grad_scaler_takes_cpu():
    from torch.amp import GradScaler

    assert GradScaler("cpu").get_scale() == 2.0 ** 16


def test_03b17_async_collective_tensor_and_functional_all_reduce_exist():
    from torch.distributed import _functional_collectives as fc

    assert callable(fc.all_reduce) and isinstance(fc.AsyncCollectiveTensor, type)


def test_12_19_the_rendezvous_names_quoted_exist():
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous

    assert callable(dynamic_rendezvous.DynamicRendezvousHandler.next_rendezvous)
    src = _source(dynamic_rendezvous)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE" in src


@pytest.mark.parametrize("name", ["bucket_cap_mb", "find_unused_parameters", "gradient_as_bucket_view",
                                  "static_graph", "delay_all_reduce_named_params", "param_to_hook_all_reduce",
                                  "broadcast_buffers", "batched_grad_copy"])
def test_03b_07_09_10_the_ddp_arguments_quoted_exist(name):
    assert name in inspect.signature(DDP.__init__).parameters


@pytest.mark.parametrize("name", ["Reducer", "_compute_bucket_assignment_by_size", "ProcessGroupGloo"])
def test_03b17_03b27_the_c10d_bindings_quoted_exist(name):
    assert hasattr(dist, name)


def test_11_4_the_allreduce_op_and_the_dispatch_mode_exist():
    from torch.utils._python_dispatch import TorchDispatchMode

    assert isinstance(TorchDispatchMode, type) and hasattr(torch.ops.c10d, "allreduce_")


def test_11_16_ddp_marks_its_forward():
    assert "_inside_ddp_forward" in _source(DDP_MODULE)


def test_11_20_optimize_ddp_defaults_to_the_ddp_optimizer():
    from torch._dynamo import config
    from torch._dynamo import utils as dynamo_utils

    assert config.optimize_ddp is True
    assert "ddp_optimizer" in _source(dynamo_utils.get_optimize_ddp_mode)


def test_12_19_the_agent_sets_the_restart_count():
    from torch.distributed.elastic.agent.server import local_elastic_agent

    assert "TORCHELASTIC_RESTART_COUNT" in _source(local_elastic_agent)
