"""Command line: `python -m ddp_helpers.train [flags]` spawns the ranks itself; under torchrun each process is a rank.

Writes result.json and the three plots (loss.png, grad_norms.png, fingerprints.png) into --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import typing
from typing import List, Optional

from .engine.config import TrainConfig


def _bool_flag(optional: bool):
    """argparse type for a bool setting; "auto" means None where the setting allows it."""
    def parse(text: str) -> Optional[bool]:
        t = text.lower()
        if t in ("1", "true", "yes", "on"):
            return True
        if t in ("0", "false", "no", "off"):
            return False
        if optional and t in ("auto", "none"):
            return None
        raise argparse.ArgumentTypeError(f"{text!r} is not one of true/false" + ("/auto" if optional else ""))
    return parse


def build_parser() -> argparse.ArgumentParser:
    """The command line: one flag per TrainConfig field, plus --out, --no-plots and --start-method."""
    p = argparse.ArgumentParser(prog="python -m ddp_helpers.train", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        optional = typing.get_origin(hint) is typing.Union
        base = typing.get_args(hint)[0] if optional else hint
        if base is bool:
            p.add_argument(flag, type=_bool_flag(optional), default=f.default,
                           metavar="BOOL|auto" if optional else "BOOL")
        elif f.name == "capture_grad_steps":
            p.add_argument(flag, type=int, nargs="*", default=list(f.default), metavar="STEP")
        else:
            p.add_argument(flag, type=base, default=f.default)
    p.add_argument("--out", default="runs/latest", help="folder for result.json and the plots")
    p.add_argument("--no-plots", action="store_true", help="write result.json only")
    p.add_argument("--start-method", choices=("auto", "forkserver", "spawn", "fork"), default="auto",
                   help="how to start the ranks (ignored under torchrun); auto = forkserver where available, else spawn")
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """TrainConfig from parsed flags."""
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)}
    values["capture_grad_steps"] = tuple(values["capture_grad_steps"])
    return TrainConfig(**values)


def say(line: str) -> None:
    """Write one line to stderr in one write: print's text and newline are two, and under torchrun (python -u)
    another process's log line written to the same terminal or pipe can land between them."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def write_outputs(result, out: str, plots: bool = True) -> List[str]:
    """Save result.json and the plots; return the paths written.

    Raises OutputError (one line) if a file can't be written, saying where the result is: in out, or, where
    result.json itself failed, in a new folder of the temp dir.
    """
    from .engine.fileio import atomic_write
    from .outputs import OutputError, failure_message

    paths: List[str] = []
    path = os.path.join(out, "result.json")
    try:
        os.makedirs(out, exist_ok=True)
        paths.append(result.save(path))
        if plots:
            from .lesson import plots as P

            for name, draw in (("loss.png", lambda: P.plot_losses(result, smooth=10)),
                               ("grad_norms.png", lambda: P.plot_grad_norms(result)),
                               ("fingerprints.png", lambda: P.plot_fingerprints(result))):
                path, fig = os.path.join(out, name), draw()
                # the figures are drawn for >= 150 dpi; atomically, so a full disk leaves no broken PNG
                paths.append(atomic_write(path, lambda tmp, fig=fig: fig.savefig(tmp, dpi=150, format="png")))
    except OSError as e:  # a full disk, a folder removed or made read-only during training (PIL's too)
        raise OutputError(failure_message(result, out, paths, path, e)) from None
    return paths


def _load_on_node(cfg: TrainConfig, rank: int, local_rank: int):
    """One process per node reads (or downloads) the data first; the others then read the files it wrote.

    What went wrong on any node reaches every rank (all_gather_object is also the barrier), so all of them stop
    with the same DataError instead of the peers dying of a closed connection.
    """
    import torch.distributed as dist

    from .data import DataError, load_data

    data, error = None, None
    if local_rank == 0:
        try:
            data = load_data(cfg, quiet=rank != 0)
        except DataError as e:
            error = str(e)
    errors = [None] * dist.get_world_size()
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

    from .engine.config import ConfigError

    steps = [None] * dist.get_world_size()
    dist.all_gather_object(steps, start_step)
    if len(set(steps)) > 1:
        raise ConfigError(f"TrainConfig.resume_from is not accepted: the ranks would resume from different steps "
                          f"({', '.join(f'rank {r}: {s}' for r, s in enumerate(steps))}); put checkpoint_dir on a "
                          "file system that every node reads, or give every node the same checkpoint file")


def _gather_on_rank0(job, rank: int) -> bool:
    """Each process filled only its own rows: gather them on rank 0 (as objects, so gloo and nccl both work)."""
    import torch.distributed as dist

    rows = [None] * job.cfg.world_size
    dist.all_gather_object(rows, job.buffers.rank_rows(rank))
    if rank == 0:
        for r, row in enumerate(rows):
            job.buffers.set_rank_rows(r, row)
    return rank == 0


def _torchrun_rank(rank: int, world_size: int, cfg: TrainConfig, backend: str, start_step: int, out: str,
                   plots: bool, t_launch: float) -> Optional[object]:
    """A torchrun rank's work inside its group: this node's data, the loop, the records gathered on rank 0."""
    from .engine import worker
    from .engine.job import Job
    from .ranks.env import RankEnv

    _check_same_start(start_step)
    job = Job.create(cfg, backend, _load_on_node(cfg, rank, RankEnv.from_environ().local_rank), start_step)
    job.t_launch = t_launch
    try:
        summary = worker.train(rank, world_size, cfg, backend, job.data, job.buffers)
    except BaseException:
        if rank == 0:  # what rank 0 recorded before the failure (its peers' rows are out of reach now)
            _save_partial(job, out)
        raise
    if not _gather_on_rank0(job, rank):
        return None
    result = job.result(final_params=summary["final_params"])
    write_outputs(result, out, plots)
    return result


def _save_partial(job, out: str) -> None:
    try:
        path = job.result(complete=False).save(os.path.join(out, "partial_result.json"))
        say(f"metrics rank 0 collected before the failure: {path}")
    except Exception as e:  # noqa: BLE001 - never hide the failure itself
        say(f"could not save rank 0's partial metrics: {e}")


def run_torchrun(cfg: TrainConfig, out: str, plots: bool) -> Optional[object]:
    """One rank of a torchrun job, entered the way every rank is (ranks.rank.run_rank); rank 0 returns the result."""
    from .engine.checkpoint import resolve_resume
    from .engine.config import default_threads
    from .engine.job import check_job
    from .ranks.env import RankEnv
    from .ranks.rank import run_rank

    env = RankEnv.from_environ()
    # torchrun's --nproc-per-node x --nnodes decides the world size; it owns the port (master_port=0: not ours).
    cfg = cfg.replace(world_size=env.world_size, master_port=0)
    cfg = resolve_resume(cfg)  # --resume-from latest: each attempt of a restarted job continues from the last one
    backend, start_step = check_job(cfg, local_world_size=env.local_world_size, check_port=False)
    threads = cfg.threads_per_rank or default_threads(env.local_world_size)  # this node's ranks share its cores
    return run_rank(_torchrun_rank, (cfg, backend, start_step, out, plots, time.monotonic()), backend, cfg.timeout_s,
                    threads, cfg.bind_cores)


def _writes_results() -> bool:
    """Does this process write result.json and the plots? (Under torchrun only global rank 0 does.)"""
    from .ranks.env import under_torchrun

    return not under_torchrun() or os.environ["RANK"] == "0"


def _check_paths(args: argparse.Namespace, cfg: TrainConfig) -> None:
    """The path checks that need no torch, made before any process starts: --out can be written, --resume-from
    is a file, --checkpoint-dir can be made. A typo there costs a tenth of a second, not a forkserver importing torch."""
    from .engine.config import ConfigError, check_resume_path, check_writable_dir
    from .engine.fileio import probe_output_dir

    check_resume_path(cfg.resume_from)
    if cfg.checkpoint_dir is not None:
        check_writable_dir("checkpoint_dir", str(cfg.checkpoint_dir))
    if _writes_results():
        try:
            probe_output_dir("--out", args.out)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _check_room(out: str, cfg: TrainConfig, plots: bool) -> None:
    """Refuse an --out whose file system can't hold result.json and the plots (probed already; no torch needed)."""
    from .engine.config import ConfigError
    from .outputs import check_room
    from .ranks.env import under_torchrun

    if under_torchrun():  # torchrun's --nproc-per-node x --nnodes decides how many ranks' records are written
        cfg = cfg.replace(world_size=int(os.environ["WORLD_SIZE"]))
    try:
        check_room(os.path.expanduser(out), cfg, plots)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _start_forkserver_early(start_method: str) -> None:
    """Start the forkserver now if it will start the ranks (not spawn, fork or torchrun): it imports torch for
    them while this process imports it for itself (3.2 s instead of 4.4 s for 8 steps with a free core)."""
    from .ranks.env import under_torchrun

    if start_method in ("auto", "forkserver") and not under_torchrun():
        from .ranks.startmethod import warm_up

        warm_up()


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point for both the spawn launcher and torchrun."""
    args = build_parser().parse_args(argv)
    from .cli_words import as_flags
    from .engine.config import ConfigError, check_types

    try:  # the flags' values, paths and room first: the modules below import torch (~2 s) before they could say it
        cfg = config_from_args(args)
        check_types(cfg)
        _check_paths(args, cfg)
        if _writes_results():
            _check_room(args.out, cfg, not args.no_plots)  # before anything trains: results that can't be written
    except ConfigError as e:
        say(f"error: {as_flags(str(e))}")
        return 2
    _start_forkserver_early(args.start_method)
    from .data import DataError
    from .outputs import OutputError, failure_message
    from .ranks.env import under_torchrun
    from .ranks.launcher import LaunchError, RankFailedError

    try:
        if under_torchrun():
            from .ranks.torchrun_errors import record_atomically

            # elastic's @record: an error leaves torchrun's error file, so the agent names this rank's traceback
            # as root cause (written by rename: the agent may SIGTERM this rank while it writes)
            result = record_atomically(run_torchrun)(cfg, args.out, not args.no_plots)
            if result is None:
                return 0
        else:
            if not args.no_plots:  # the plots are drawn without pyplot; Agg keeps any pyplot import off screens
                import matplotlib

                matplotlib.use("Agg")
            from .engine.runner import run_training

            result = run_training(cfg, start_method=args.start_method)
            write_outputs(result, args.out, not args.no_plots)
    except (ConfigError, DataError, LaunchError) as e:
        say(f"error: {as_flags(str(e))}")  # in the words of the command line: its flags
        return 2
    except OutputError as e:
        say(f"error: {e}")
        return 1
    except RankFailedError as e:
        say(f"error: {e}")
        if e.partial_result is not None:
            path = os.path.join(args.out, "partial_result.json")
            try:
                say(f"metrics collected before the failure: {e.partial_result.save(path)}")
            except OSError as err:
                say(f"error: {failure_message(e.partial_result, args.out, [], path, err, 'partial_result.json')}")
        return 1
    print(result.summary())
    print(f"wall {result.wall_time_s:.2f} s, start-up {result.startup_s:.2f} s, training loop {result.loop_time_s:.2f} s "
          f"({result.steps_per_s:.0f} steps/s)")
    print(f"wrote {os.path.join(args.out, 'result.json')}" + ("" if args.no_plots else " and 3 plots"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
