"""Which rank a failure is blamed on, when the launcher's own ending of the others leaves signals behind."""
from __future__ import annotations

import signal
import time

import pytest

from ddp_helpers import RankFailedError, launch


def _raises_while_the_other_ignores_sigterm(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("the real failure")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the launcher's SIGTERM goes unheard: SIGKILL after the grace
    time.sleep(1000)


def test_the_rank_that_raised_is_named_not_the_one_the_launcher_killed():
    with pytest.raises(RankFailedError) as e:
        launch(_raises_while_the_other_ignores_sigterm, 2, init_group=False, start_method="fork")
    assert e.value.rank == 1 and "the real failure" in e.value.message
