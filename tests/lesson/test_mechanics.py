"""The mechanics notebooks' models and error helpers, alone and under real DDP ranks."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_helpers import ConfigError, RankFailedError, launch
from ddp_helpers.lesson.mechanics import (BranchNet, build_batchnorm_model, build_branch_model, comm_failure,
                                   tidy_error)

GLOO_CLOSED = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection "
               "closed by peer [127.0.0.1]:15781. This is typically caused by a remote worker crashing.")
GLOO_RESET = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error "
              "[127.0.0.1]:940: Connection reset by peer. This is typically caused by a remote worker hanging.")
GLOO_TIMEOUT = ("RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
                "Timed out waiting 3000ms for recv operation to complete")


def _grads_of(model: torch.nn.Module) -> list:
    return [p.grad is not None for p in model.parameters()]


def test_models_are_seeded_and_leave_the_callers_rng_alone():
    torch.manual_seed(123)
    before = torch.rand(1)
    torch.manual_seed(123)
    a, b, c = build_batchnorm_model(0), build_batchnorm_model(0), build_batchnorm_model(1)
    assert torch.rand(1) == before  # the caller's random stream continues as if nothing was built
    sa, sb, sc = (torch.cat([p.detach().reshape(-1) for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(sa, sb) and not torch.equal(sa, sc)
    assert torch.equal(build_branch_model(3).trunk[1].weight, build_branch_model(3).trunk[1].weight)


def test_batchnorm_model_updates_its_running_statistics_in_training_only():
    m = build_batchnorm_model(0)
    x = torch.randn(8, 1, 28, 28)
    m.eval()
    m(x)
    assert torch.count_nonzero(m.bn.running_mean) == 0
    m.train()
    assert m(x).shape == (8, 10)
    assert torch.count_nonzero(m.bn.running_mean) > 0 and int(m.bn.num_batches_tracked) == 1


@pytest.mark.parametrize("aux, used", [("never", [False, False]), ("always", [True, True]),
                                       ("alternate", [True, False, True])])
def test_branch_model_uses_its_head_as_aux_says(aux, used):
    m = build_branch_model(0, aux=aux)
    x = torch.randn(4, 1, 28, 28)
    for expected in used:
        m.zero_grad(set_to_none=True)
        m(x).sum().backward()
        assert _grads_of(m.aux_head) == [expected, expected]
        assert all(_grads_of(m.trunk))


def test_branch_model_depth_and_eval_forwards():
    m = build_branch_model(0, aux="alternate", depth=3, hidden=8)
    assert sum(isinstance(layer, torch.nn.Linear) for layer in m.trunk) == 4  # 3 hidden layers + the output
    m.eval()
    m(torch.randn(2, 1, 28, 28))
    assert m.forwards == 0  # evaluation does not move the alternation


@pytest.mark.parametrize("kwargs, setting", [({"aux": "sometimes"}, "aux="), ({"depth": 0}, "depth=")])
def test_bad_model_settings_are_refused_by_name(kwargs, setting):
    with pytest.raises(ConfigError, match=setting):
        BranchNet(**kwargs)
    if "aux" in kwargs:
        with pytest.raises(ConfigError, match="never"):
            build_branch_model(0, **kwargs)


def test_tidy_error_drops_source_locations_and_addresses():
    assert tidy_error(GLOO_RESET).startswith("RuntimeError: Read error ADDRESS: Connection reset by peer.")
    assert tidy_error(GLOO_CLOSED).startswith("RuntimeError: Connection closed by peer ADDRESS.")
    assert tidy_error(GLOO_TIMEOUT) == "RuntimeError: Timed out waiting 3000ms for recv operation to complete"
    plain = "ValueError: SyncBatchNorm expected input tensor to be on GPU"
    assert tidy_error(plain) == plain


def test_comm_failure_tells_a_timeout_from_a_lost_peer():
    assert comm_failure(GLOO_TIMEOUT) == "timeout"
    assert comm_failure(GLOO_CLOSED) == comm_failure(GLOO_RESET) == "peer closed the connection"
    assert comm_failure("RuntimeError: Expected to have finished reduction in the prior iteration") is None


# ---------------------------------------------------------------------------------------------- real ranks
def _branchy_steps(rank, world_size, options):
    torch.manual_seed(rank)  # different data per rank: synchronized gradients must still agree
    model = build_branch_model(0, aux="never")
    ddp = DDP(model, **options)
    grads = []
    for _ in range(2):
        ddp.zero_grad(set_to_none=True)
        ddp(torch.randn(4, 1, 28, 28)).sum().backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.trunk.parameters()]).numpy())
    return grads


def test_unused_head_stalls_ddp_until_find_unused_parameters():
    with pytest.raises(RankFailedError, match="Expected to have finished reduction in the prior iteration"):
        launch(_branchy_steps, 2, args=({},), start_method="fork")
    for options in ({"find_unused_parameters": True}, {"static_graph": True}):
        g0, g1 = launch(_branchy_steps, 2, args=(options,), start_method="fork")
        assert all(np.array_equal(a, b) for a, b in zip(g0, g1)), options


def _uneven(rank, world_size, join):
    ddp = DDP(build_branch_model(0, aux="always"))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    torch.manual_seed(rank)
    with Join([ddp], enable=join):
        for _ in range(2 + 2 * rank):  # rank 0: 2 batches, rank 1: 4
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(ddp(torch.randn(8, 1, 28, 28)), torch.randint(0, 10, (8,))).backward()
            opt.step()
    return torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()]).numpy()


def test_uneven_batches_fail_without_join_and_finish_with_it():
    # timeout_s=30: a failure classified as a lost peer (not a timeout) came from the exited rank's closed sockets
    with pytest.raises(RankFailedError) as info:
        launch(_uneven, 2, args=(False,), start_method="fork", timeout_s=30)
    assert info.value.rank == 1 and comm_failure(info.value.message) == "peer closed the connection"
    p0, p1 = launch(_uneven, 2, args=(True,), start_method="fork")
    assert np.array_equal(p0, p1)
