"""A check names what the learner's function can't send or return, instead of a raw traceback or "exit()?"."""
from __future__ import annotations

import threading

import torch.distributed as dist

from ddp_helpers.exercises import check_global_mean

CELL = """
LOCK = threading.Lock()  # a global no new process can receive


def locked_mean(x):
    with LOCK:
        t = x.clone()
        dist.all_reduce(t)
        return t / dist.get_world_size()
"""


def _as_a_cell_defines_it():
    """locked_mean defined in __main__, as a notebook cell defines it: it travels by value, with its globals."""
    namespace = {"__name__": "__main__", "threading": threading, "dist": dist}
    exec(CELL, namespace)
    return namespace["locked_mean"]


def _returns_a_lock(x):
    t = x.clone()
    dist.all_reduce(t)
    return threading.Lock()


def test_a_global_the_ranks_cant_receive_is_named(capsys):
    check_global_mean(_as_a_cell_defines_it())
    out = capsys.readouterr().out
    assert "TRY AGAIN" in out and "can't be sent to the ranks" in out and "_thread.lock" in out, out
    assert "Traceback" not in out


def test_a_return_value_the_check_cant_use_is_named_not_taken_for_exit(capsys):
    check_global_mean(_returns_a_lock)
    out = capsys.readouterr().out
    assert "TRY AGAIN" in out and "could not use what your function returned" in out and "exit()" not in out, out
