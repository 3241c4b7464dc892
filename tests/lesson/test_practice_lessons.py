"""The helpers of notebooks 11 and 12: collectives recorded and parsed, stack dumps and agent logs read, graph
pieces counted, per-rank bytes counted, checkpoints tagged with a device."""
from __future__ import annotations

import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_helpers import launch
from ddp_helpers.lesson import comms, compiling, debugging, loading, sharding

DETAIL_ERROR = (
    "RuntimeError: Detected mismatch between collectives on ranks. Rank 1 is running collective: "
    "CollectiveFingerPrint(SequenceNumber=0, OpType=ALLREDUCE, TensorShape=[5], TensorDtypes=Float, "
    "TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu)), but Rank 0 is running collective: "
    "CollectiveFingerPrint(SequenceNumber=0, OpType=ALLREDUCE, TensorShape=[3, 2], TensorDtypes=Float, "
    "TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu)).Collectives differ in the following "
    "aspects:   Tensor Tensor shapes: 5vs 3")


def _recorded_step(rank, world_size):
    model = nn.Linear(6, 3)
    ddp = DDP(model)
    with comms.CommRecorder() as rec:
        F.mse_loss(ddp(torch.ones(2, 6)), torch.zeros(2, 3)).backward()
        out = torch.empty(world_size * 4)
        dist.all_gather_into_tensor(out, torch.ones(4))
    return rec.summary()


def test_the_recorder_sees_ddps_all_reduce_and_counts_the_full_buffer():
    summary = launch(_recorded_step, 2, threads_per_rank=1)[0]
    assert summary["allreduce_"] == {"calls": 1, "bytes": (6 * 3 + 3) * 4, "dtypes": ["float32"]}
    assert summary["_allgather_base_"] == {"calls": 1, "bytes": 2 * 4 * 4, "dtypes": ["float32"]}  # the output


def test_a_detail_mismatch_is_parsed_into_each_ranks_collective():
    assert comms.collective_mismatch(DETAIL_ERROR) == {1: {"op": "ALLREDUCE", "shape": [5], "sequence": 0},
                                                      0: {"op": "ALLREDUCE", "shape": [3, 2], "sequence": 0}}
    assert comms.collective_mismatch("RuntimeError: Connection closed by peer") == {}


def test_flight_recorder_support_is_explained_when_missing(monkeypatch):
    assert comms.flight_recorder_unsupported("gloo") is None  # torch 2.14 records gloo collectives
    monkeypatch.delattr(torch._C._distributed_c10d, "_dump_fr_trace")
    assert "nccl only" in comms.flight_recorder_unsupported("gloo")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "needs CUDA GPUs" in comms.flight_recorder_unsupported("nccl")


def test_a_flight_recorder_dump_is_read_with_the_callers_frame(tmp_path):
    frames = [{"name": "all_reduce", "filename": "/x/torch/distributed/distributed_c10d.py", "line": 3913},
              {"name": "train", "filename": "/tmp/ipykernel_1/123.py", "line": 16}]
    dump = {"pg_status": {"0": {"last_enqueued_collective": 2}},
            "entries": [{"collective_seq_id": 1, "profiling_name": "gloo:broadcast", "input_sizes": [[3]], "frames": []},
                        {"collective_seq_id": 2, "profiling_name": "gloo:all_reduce", "input_sizes": [[18]],
                         "frames": frames}]}
    path = tmp_path / "fr.pkl"
    path.write_bytes(pickle.dumps(dump))
    rec = comms.read_flight_recorder(str(path))
    assert rec["last"] == 2 and rec["entries"][1] == {"seq": 2, "op": "gloo:all_reduce", "sizes": [[18]],
                                                      "group": "0", "where": "train, line 16", "by": "all_reduce"}
    assert rec["entries"][0]["where"] == rec["entries"][0]["by"] == "?" and rec["groups"] == {"0": 2}


def test_a_stack_dump_is_read_innermost_first_up_to_the_first_thread():
    dump = ('Stack (most recent call first):\n'
            '  File "/site/torch/distributed/distributed_c10d.py", line 3913 in all_reduce\n'
            '  File "<dynamic-code>", line 2 in wait_for_peer\n'
            '\n'
            'Thread 0x00007f (most recent call first):\n'
            '  File "/x/threading.py", line 320 in wait\n')
    assert debugging.stack_frames(dump) == [("all_reduce", "distributed_c10d.py", 3913),
                                            ("wait_for_peer", "<dynamic-code>", 2)]


def test_a_dump_of_all_threads_is_read_thread_by_thread():
    dump = ('Thread 0x00007fb3 (most recent call first):\n'
            '  File "/x/selectors.py", line 415 in select\n'
            '  File "/pkg/ddp_helpers/ranks/starting.py", line 18 in _exit_when\n'
            '\n'
            'Current thread 0x00007fb4 (most recent call first):\n'
            '  File "/site/torch/distributed/distributed_c10d.py", line 3913 in all_reduce\n'
            '  File "<dynamic-code>", line 5 in wait_for_peer\n')
    assert debugging.thread_stacks(dump) == [
        (False, [("select", "selectors.py", 415), ("_exit_when", "starting.py", 18)]),
        (True, [("all_reduce", "distributed_c10d.py", 3913), ("wait_for_peer", "<dynamic-code>", 5)])]
    one = 'Stack (most recent call first):\n  File "<dynamic-code>", line 2 in f\n'
    assert debugging.thread_stacks(one) == [(True, [("f", "<dynamic-code>", 2)])]


@pytest.mark.parametrize("prints, step", [([[1, 2, 3], [1, 2, 3]], None), ([[1, 2, 3], [1, 5, 3]], 1),
                                          ([[7, 2], [8, 2], [7, 2]], 0), ([], None), ([[1, 2], [1]], None)])
def test_first_divergence_is_the_first_step_the_ranks_disagree(prints, step):
    assert debugging.first_divergence(prints) == step


def test_the_agent_log_keeps_its_story_without_pids_or_times():
    log = ("I1201 21:14:01.100000 22949 torch/distributed/elastic/agent/server/api.py:550] [default] Rendezvous "
           "complete for workers. Result:\n  restart_count=0\n  master_addr=127.0.0.1\n"
           "E1201 21:14:04.157000 22949 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 1) "
           "local_rank: 1 (pid: 22985) of binary: /venv/bin/python\n"
           "I1201 21:14:04.200000 22949 torch/distributed/elastic/agent/server/api.py:943] [default] Worker group "
           "FAILED. 1/1 attempts left; will restart worker group\n")
    assert debugging.agent_events(log) == ["restart_count=0", "failed (exitcode: 1) local_rank: 1",
                                           "[default] Worker group FAILED. 1/1 attempts left; will restart worker group"]


def test_the_graph_counter_sees_one_piece_with_every_layer_of_the_deep_mlp():
    import torch._dynamo

    a, b = compiling.build_deep_mlp(3, width=16, depth=4), compiling.build_deep_mlp(3, width=16, depth=4)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    counter = compiling.GraphCounter()
    x = torch.randn(2, 16)
    try:
        out = torch.compile(a, backend=counter)(x)
    finally:
        torch._dynamo.reset()
    assert counter.layers == [4] and torch.allclose(out, b(x))


def test_no_cxx_compiler_means_none(monkeypatch):
    import torch._inductor.cpp_builder as builder

    def missing():
        raise RuntimeError("no compiler")

    monkeypatch.setattr(builder, "get_cpp_compiler", missing)
    assert compiling.cxx_compiler() is None
    monkeypatch.setattr(builder, "get_cpp_compiler", lambda: "g++")
    assert compiling.cxx_compiler() == "g++"


class _Shard(torch.Tensor):
    """Stands for a DTensor: to_local() is this rank's part."""

    def to_local(self):
        return self[: len(self) // 2]


def test_rank_bytes_counts_adam_state_and_local_shards():
    model = nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters())
    F.mse_loss(model(torch.ones(2, 4)), torch.zeros(2, 3)).backward()
    opt.step()
    n = 4 * 3 + 3
    assert sharding.rank_bytes(model, opt) == {"parameters": 4 * n, "gradients": 4 * n, "optimizer state": 8 * n}
    assert sharding.tensor_bytes([torch.ones(8).as_subclass(_Shard)]) == 4 * 4

    class Zero:  # a ZeroRedundancyOptimizer keeps its shard's state in .optim
        optim = torch.optim.Adam([nn.Parameter(torch.ones(5))])

    Zero.optim.state[Zero.optim.param_groups[0]["params"][0]] = {"exp_avg": torch.ones(5), "step": torch.tensor(1.0)}
    assert sharding.rank_bytes(nn.Linear(1, 1), Zero())["optimizer state"] == 5 * 4  # the 0-dim step not counted


def test_methods_holding_the_same_bytes_stay_distinguishable_in_the_bytes_figure():
    """DDP and ZeRO hold the same parameter bytes: their bars stand side by side, not one hidden under the other."""
    one = {"parameters": 8, "gradients": 8, "optimizer state": 16}
    half = {"parameters": 4, "gradients": 4, "optimizer state": 8}
    fig = sharding.plot_rank_bytes({"DDP": {1: [one], 2: [one, one]}, "ZeRO": {1: [one], 2: [one, one]},
                                    "FSDP2": {1: [one], 2: [half, half]}}, one)
    bars = fig.axes[0].patches
    assert len(bars) == 6 and len({round(b.get_x(), 6) for b in bars}) == 6  # no two bars at the same place
    assert {b.get_facecolor() for b in bars[:2]}.isdisjoint({b.get_facecolor() for b in bars[2:4]})
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels[:3] == ["DDP (largest rank)", "ZeRO (largest rank)", "FSDP2 (largest rank)"] and "total / W" in labels


def test_the_bytes_figure_has_a_panel_per_part_and_refuses_nothing_to_plot():
    one = {"parameters": 8, "gradients": 8, "optimizer state": 16}
    fig = sharding.plot_rank_bytes({"DDP": {1: [one], 2: [one, one]}}, one)
    assert [ax.get_title() for ax in fig.axes] == list(sharding.PARTS)
    with pytest.raises(ValueError, match="plot_rank_bytes needs"):
        sharding.plot_rank_bytes({}, one)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU machine a cuda:0 checkpoint loads without mapping")
def test_a_checkpoint_saved_as_if_on_a_gpu_needs_map_location_here(tmp_path):
    path = str(tmp_path / "gpu.pt")
    with loading.saved_as_if_on("cuda:0"):
        torch.save({"w": torch.ones(3), "b": torch.zeros(2)}, path)
    torch.save({"w": torch.ones(3)}, str(tmp_path / "cpu.pt"))  # outside the block: saved as usual
    assert loading.saved_locations(path) == ["cuda:0", "cuda:0"]
    assert loading.saved_locations(str(tmp_path / "cpu.pt")) == ["cpu"]
    with pytest.raises(RuntimeError, match="map_location"):
        torch.load(path, weights_only=True)
    assert torch.load(path, map_location="cpu", weights_only=True)["w"].device.type == "cpu"
