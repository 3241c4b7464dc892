"""One rank of a torchrun job (`torchrun ... -m ddp_helpers.train`): entered as every rank is (ranks.rank.run_rank),
its error in elastic's error file written whole or not at all (record_atomically), and leaving its outcome and its
rows the way a launched rank does, in a run folder (ranks/folders.py).

The run folder is on the rank's machine, in the temp dir, shared by the job's ranks there. Rank 0 reads the rows
of the ranks it can see there; only the others' travel over the process group. A rank that fails, or that
torchrun's agent stops (SIGTERM, when a peer failed), first writes the job's partial result from every rank's
rows it can see: the rows are in their files already, so none recorded before the failure is lost.
"""
from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Callable, List, Optional, TypeVar

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from ..common.errors import setting
from ..engine.config import ConfigError, TrainConfig
from .leaving import PARTIAL, Leaver, hold_alive, partial_name, remove_if_last, wait_for_peer_rows  # noqa: F401
from .nodes import attempt_counts, attempt_label, gather_places, job_key, node_line, provenance
from .outputs import say, write_outputs
from ..ranks.reports import error_text


def run_folder(master_addr: str, master_port: int) -> str:
    """This machine's run folder for this attempt of the job, held by every local rank while it runs.

    Named by the job (torchrun's run id, the rendezvous endpoint, SLURM's job and step: cli/nodes.job_key) and
    the attempt. The name is predictable (the job's ranks find it independently), so another user could make it
    first: it is created with mode 0700, or an existing one accepted only if it is a real folder of this user's
    with mode 0700 (common.files.make_private_dir), before anything in it is read or written. In the temp dir's
    sticky folder nobody else can then rename or replace it. Folders that earlier jobs' ranks left here when
    they were killed (SIGKILL: no code of theirs ran) are removed first, as launch() does (folders.remove_stale:
    only this user's real folders that no live process holds).
    """
    from ..common.files import make_private_dir
    from ..ranks.folders import RUN_DIR_PREFIX, hold, remove_stale

    remove_stale()
    key = job_key(master_addr, master_port)
    path = os.path.join(tempfile.gettempdir(), f"{RUN_DIR_PREFIX}torchrun-{key}-a{attempt_label()}")
    make_private_dir(path, "the torchrun run folder", "Remove it (as its owner or root), or give this job another "
                     "--rdzv-id or --rdzv-endpoint port, or point TMPDIR at a folder only this user can write")
    hold(path)  # a folder some local rank holds is never taken for a dead launch's (folders.remove_stale)
    return path


def _load_on_node(cfg: TrainConfig, rank: int, local_rank: int) -> Any:
    """One process per node reads (or downloads) the data first; the others then read the files it wrote.

    What went wrong on any node reaches every rank (all_gather_object is also the barrier), so all of them stop
    with the same DataError instead of the peers dying of a closed connection.
    """
    import torch.distributed as dist

    from ..data import DataError, load_data

    data, error = None, None
    if local_rank == 0:
        try:
            data = load_data(cfg, quiet=rank != 0)
        except DataError as e:
            error = e.marked  # its settings still marked: the command line names them as flags
    errors: List[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e is not None), None)
    if first is not None:
        raise DataError(first)
    return data if local_rank == 0 else load_data(cfg, quiet=True)


def _check_same_start(start_step: int) -> None:
    """Refuse, on every rank, a job whose ranks would resume from different steps.

    Each rank resolves --resume-from latest itself: a node that can't see rank 0's checkpoint folder (not on a
    shared file system) would start over while the others resume, and their collectives would no longer pair up.
    """
    import torch.distributed as dist

    steps: List[Optional[int]] = [None] * dist.get_world_size()
    dist.all_gather_object(steps, start_step)
    if len(set(steps)) > 1:
        raise ConfigError(f"{setting('resume_from', owner='TrainConfig')} is not accepted: the ranks would resume "
                          f"from different steps ({', '.join(f'rank {r}: {s}' for r, s in enumerate(steps))}); put "
                          f"{setting('checkpoint_dir')} on a file system that every node reads, or give every node "
                          "the same checkpoint file")


def _gather_rows(job: Any, rank: int) -> List[int]:
    """Give rank 0 every rank's rows: from the files it can see, over the group only for the others; returns
    the ranks whose rows travelled. Every rank has finished writing when the first collective returns."""
    import torch.distributed as dist

    world = job.cfg.world_size
    counts: List[Optional[int]] = [None] * world
    dist.all_gather_object(counts, job.rows.count(rank))
    seen = job.rows.counts() if rank == 0 else []
    far = [[r for r in range(world) if seen[r] != counts[r]] if rank == 0 else None]
    dist.broadcast_object_list(far, src=0)  # the ranks whose file rank 0 can't see (another machine)
    sent: List[Any] = [None] * world
    dist.all_gather_object(sent, job.rows.tables(rank) if rank in far[0] else None)
    if rank == 0:
        for r in far[0]:
            job.rows.give(r, sent[r])
    return far[0]


def _meet(rank: int, local_rank: int, leaver: Leaver, env: Any) -> None:
    """Every rank's host, interface and address, gathered once the group exists: in the provenance that
    result.json (or a partial result) records, and one line per node (said by its local rank 0)."""
    import socket

    rendezvous = f"{env.master_addr}:{env.master_port}"
    places = gather_places(rank, env.master_addr, env.master_port)
    leaver.provenance = provenance(places, rendezvous, job_key(env.master_addr, env.master_port))
    if local_rank == 0:
        say(node_line(places, socket.gethostname(), rendezvous))


def _torchrun_rank(rank: int, world_size: int, cfg: TrainConfig, backend: str, start_step: int, out: str,
                   plots: bool, leaver: Leaver, env: Any) -> Optional[object]:
    """A torchrun rank's work inside its group: this node's data, the loop, the result on rank 0."""
    from ..engine import worker
    from ..engine.job import Job

    run_dir = leaver.run_dir
    _check_same_start(start_step)
    _meet(rank, env.local_rank, leaver, env)
    job = Job.create(cfg, backend, _load_on_node(cfg, rank, env.local_rank), run_dir, start_step)
    job.t_launch = leaver.t_launch
    leaver.job = job
    summary = worker.train(rank, world_size, cfg, backend, job.data, run_dir)
    _gather_rows(job, rank)
    if rank != 0:
        leaver.finish()
        return None  # the last local rank out removes this machine's run folder (run_torchrun)
    result = job.result(final_params=summary["final_params"])
    result.provenance = dict(leaver.provenance)
    # the true rendezvous address, not the setting's default (torchrun decided it)
    result.config.update(master_addr=env.master_addr, master_port=env.master_port)
    job.rows.close()
    write_outputs(result, out, plots)
    leaver.finish()
    if summary.get("checkpoint_error"):  # the training finished and its result is written: say what is missing
        from ..engine.checkpoint import CheckpointError

        raise CheckpointError(summary["checkpoint_error"], result, holder=os.path.join(out, "result.json"))
    return result


def name_earlier_partial(out: str) -> Optional[str]:
    """After a SLURM requeue, the partial result the failed attempt left as partial_result.json (it could not
    know a requeue would follow) renamed by its attempt, so it doesn't read as this attempt's; its new path."""
    from ..engine.result import TrainResult
    from .nodes import slurm_job

    path = os.path.join(out, PARTIAL)
    job = slurm_job().get("job_id")
    if attempt_counts()[0] == 0 or not job or not os.path.isfile(path):
        return None
    try:
        earlier = TrainResult.load(path)
    except (OSError, ValueError):
        return None
    if earlier.complete or earlier.provenance.get("slurm", {}).get("job_id") != job:
        return None  # another job's file: not ours to rename
    named = os.path.join(out, f"partial_result.attempt{earlier.provenance.get('attempt') or 0}.json")
    os.replace(path, named)
    return named


def run_torchrun(cfg: TrainConfig, out: str, plots: bool, sizes: Optional[Any] = None) -> Optional[object]:
    """One rank of a torchrun (or SLURM) job, entered the way every rank is (ranks.rank.run_rank); rank 0
    returns the result. Whatever ends the rank once its run folder exists (an error, torchrun's agent, the
    scheduler's SIGTERM) leaves a partial result, and the last local rank out removes the folder. sizes:
    engine.config.check_before_torch's for this node's ranks, if the command line made them already."""
    from ..data import DataError
    from ..engine.checkpoint import check_resume, resolve_resume
    from ..engine.config import check_before_torch
    from ..ranks.env import GpuLayout, RankEnv
    from ..ranks.rank import run_rank
    from ..ranks.reports import error_report

    env = RankEnv.from_environ()
    # torchrun's --nproc-per-node x --nnodes decides the world size; it owns the port (master_port=0: not ours).
    cfg = cfg.replace(world_size=env.world_size, master_port=0)
    sizes = sizes or check_before_torch(cfg, env.local_world_size)  # this node's ranks share its cores
    # no address: torchrun owns the rendezvous; the GPUs as this rank sees them (SLURM may show each task its own),
    # refused here, before init_process_group, where some rank of the node would have none (ranks/env.py)
    layout = None if cfg.backend == "gloo" else GpuLayout.of_rank()
    backend = sizes.place(cfg.backend, cfg.bind_cores, layout=layout)
    cfg = resolve_resume(cfg)  # --resume-from latest: each attempt of a restarted job continues from the last one
    start_step = check_resume(cfg)
    threads = sizes.threads
    t_launch = time.monotonic()
    try:
        run_dir = run_folder(env.master_addr, env.master_port)
    except PermissionError as e:  # another user's folder, or a link: named, and nothing in it read
        raise ConfigError(str(e)) from None
    leaver = Leaver(None, env.rank, out, run_dir, cfg=cfg, backend=backend, t_launch=t_launch)
    leaver.provenance = {"job": job_key(env.master_addr, env.master_port), "attempt": attempt_label()}
    try:
        leaver.install()  # from the start: a SIGTERM during start-up leaves a partial result too
        hold_alive(run_dir, env.rank)  # a SIGTERM's sender is judged by which peers still run
        if env.rank == 0:
            name_earlier_partial(out)
        args = (cfg, backend, start_step, out, plots, leaver, env)
        return run_rank(_torchrun_rank, args, backend, cfg.timeout_s, threads, cfg.bind_cores)
    except (ConfigError, DataError):
        raise  # bad settings or data, the same on every attempt: named as such, no partial result
    except BaseException as e:
        if not leaver.leaving:
            leaver.leave(error_report(e))
        raise
    finally:
        remove_if_last(run_dir)


# --- torchrun's error file, written whole or not at all ---
# Under torchrun each rank's top-level function is wrapped in elastic's ``@record``, which writes the rank's
# traceback as JSON to ``TORCHELASTIC_ERROR_FILE`` so the agent can name the root cause. torch writes it in place
# (``ErrorHandler.record_exception``: ``open(file, "w")`` then ``json.dump``). When one rank fails, the agent
# terminates the others (``SubprocessContext._poll``: ``close()``) and then reads every failed rank's error file
# (``_capture_process_failures`` -> ``ProcessFailure.__post_init__``: ``json.load``). A rank that was writing its
# own error file (a peer's failure reached it in a collective) when SIGTERM came leaves an empty or cut file, and
# the agent itself dies of a JSONDecodeError instead of restarting the workers. Here the file appears by rename.

F = TypeVar("F", bound=Callable)
_ENV = "TORCHELASTIC_ERROR_FILE"


class AtomicErrorHandler(ErrorHandler):
    """torch's error handler, writing its JSON beside the error file and renaming it into place."""

    def record_exception(self, e: BaseException) -> None:
        try:
            str(e)
        except Exception:  # noqa: BLE001 - torch formats f"{type(e).__name__}: {e}", which would raise here
            e = _stand_in(e)
        file = os.environ.get(_ENV)
        if not file:
            return super().record_exception(e)  # no file: torch logs what it would have written
        partial = f"{file}.{os.getpid()}.partial"
        os.environ[_ENV] = partial  # torch's own format, written to the side
        try:
            super().record_exception(e)
        finally:
            os.environ[_ENV] = file
        os.replace(partial, file)  # atomic: the agent reads nothing or all of it


def _stand_in(e: BaseException) -> BaseException:
    """An error of the same type name whose str() is what of `e` can be rendered (error_text)."""
    name = type(e).__name__
    return type(name, (Exception,), {})(error_text(e)[len(name) + 2:])


def record_atomically(fn: F) -> F:
    """elastic's ``@record`` with an error file that is never seen half-written."""
    return record(fn, error_handler=AtomicErrorHandler())
