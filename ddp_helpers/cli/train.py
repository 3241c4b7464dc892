"""Command line: `python -m ddp_helpers.train [flags]` starts the ranks itself; under torchrun, or as one of several
tasks of srun, each process is a rank.

Writes result.json and the three plots (loss.png, grad_norms.png, fingerprints.png) into --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from typing import Any, List, Optional, Tuple

from ..engine.config import TrainConfig
from .outputs import say, write_outputs

__all__ = ["build_parser", "config_from_args", "main", "say", "write_outputs"]


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
    """The command line: one flag per row of TrainConfig's table, plus --out, --no-plots and --start-method."""
    p = argparse.ArgumentParser(prog="python -m ddp_helpers.train", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag, hint, help = "--" + f.name.replace("_", "-"), hints[f.name], f.metadata["help"]
        optional = typing.get_origin(hint) is typing.Union
        base = typing.get_args(hint)[0] if optional else hint
        if base is bool:
            p.add_argument(flag, type=_bool_flag(optional), default=f.default, help=help,
                           metavar="BOOL|auto" if optional else "BOOL")
        elif typing.get_origin(base) is tuple:
            p.add_argument(flag, type=int, nargs="*", default=list(f.default), metavar="STEP", help=help)
        else:
            p.add_argument(flag, type=base, default=f.default, help=help)
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


def _writes_results() -> bool:
    """Does this process write result.json and the plots? (Under torchrun only global rank 0 does.)"""
    from ..ranks.env import under_torchrun

    return not under_torchrun() or os.environ["RANK"] == "0"


def _check_paths(args: argparse.Namespace) -> None:
    """The command line's own path check, made before any process starts: --out can be written (the run's own
    paths, --resume-from and --checkpoint-dir: engine.config.check_before_torch; the temp dir: where the forkserver's
    folder is made in it, ranks/folders.owned_dir). A typo there costs a tenth of a second, not torch's import."""
    from ..common.files import probe_output_dir
    from ..engine.config import ConfigError

    if _writes_results():
        try:
            probe_output_dir("--out", args.out)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def _check_room(out: str, cfg: TrainConfig, plots: bool) -> None:
    """Refuse an --out whose file system can't hold result.json and the plots (probed already; no torch needed)."""
    from ..engine.config import ConfigError
    from ..ranks.env import under_torchrun
    from .outputs import check_room

    if under_torchrun():  # torchrun's --nproc-per-node x --nnodes decides how many ranks' records are written
        cfg = cfg.replace(world_size=int(os.environ["WORLD_SIZE"]))
    try:
        check_room(os.path.expanduser(out), cfg, plots)
    except ConfigError:
        raise  # its settings marked, for the command line's words
    except ValueError as e:  # --out's own
        raise ConfigError(str(e)) from None


def _start_forkserver_early(start_method: str) -> None:
    """Start the forkserver now if it will start the ranks (not spawn, fork or torchrun): it imports torch for
    them while this process imports it for itself (what that saves: docs/benchmarks.md)."""
    from ..ranks.env import under_torchrun

    if start_method in ("auto", "forkserver") and not under_torchrun():
        from ..ranks.startmethod import warm_up

        warm_up()


def _check_flags(args: argparse.Namespace, existed: bool) -> Tuple[TrainConfig, Any]:
    """The flags' values, the ranks' sizes, paths and room, before the modules that import torch (seconds) could
    say it; the settings and the ranks' sizes (engine.config.check_before_torch's, not made again). An --out this
    made (existed: it was there before) and then refused is removed again. The run's telemetry size is checked
    once, by the engine, when the data set's size is known (engine/telemetry.py): mnist's is known once loaded."""
    from ..engine.config import check_before_torch
    from ..ranks.env import under_torchrun

    cfg = config_from_args(args)  # the flags' values: TrainConfig checks them as it is made
    # before the forkserver starts (main: _start_forkserver_early); under torchrun, this node's ranks
    sizes = check_before_torch(cfg, int(os.environ.get("LOCAL_WORLD_SIZE") or 1) if under_torchrun() else None)
    try:
        _check_paths(args)
        if _writes_results():
            _check_room(args.out, cfg, not args.no_plots)  # before anything trains: results that can't be written
    except BaseException:
        _remove_if_made(args.out, existed)
        raise
    return cfg, sizes


def _remove_if_made(out: str, existed: bool) -> None:
    """A refused run leaves no --out behind: remove it if this run made it and nothing was written there."""
    out = os.path.expanduser(out)
    if not existed and os.path.isdir(out) and not os.listdir(out):
        os.rmdir(out)


def _train(cfg: TrainConfig, sizes: Any, args: argparse.Namespace) -> Optional[object]:
    """Train as this process's part: one rank of a torchrun job, or every rank started here; the result or None."""
    from ..ranks.env import under_torchrun

    if under_torchrun():
        from .torchrun import record_atomically, run_torchrun

        # elastic's @record: an error leaves torchrun's error file, so the agent names this rank's traceback
        # as root cause (written by rename: the agent may SIGTERM this rank while it writes)
        return record_atomically(run_torchrun)(cfg, args.out, not args.no_plots, sizes)
    if not args.no_plots:  # the plots are drawn without pyplot; Agg keeps any pyplot import off screens
        import matplotlib

        matplotlib.use("Agg")
    from ..engine.checkpoint import CheckpointError
    from ..engine.runner import run_checked

    try:
        result = run_checked(cfg, sizes, start_method=args.start_method)  # its checks before torch made above
    except CheckpointError as e:  # the training finished: its result is written, then the error said
        write_outputs(e.result, args.out, not args.no_plots)
        raise
    write_outputs(result, args.out, not args.no_plots)
    return result


def _save_partial(e, out: str) -> None:
    from .outputs import failure_message

    path = os.path.join(out, "partial_result.json")
    try:
        say(f"metrics collected before the failure: {e.partial_result.save(path)}")
    except OSError as err:
        say(f"error: {failure_message(e.partial_result, out, [], path, err, 'partial_result.json')}")


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point for the command line's own launch, torchrun's ranks and srun's tasks."""
    args = build_parser().parse_args(argv)
    from ..engine.config import ConfigError
    from ..ranks.env import adopt_scheduler_env
    from .words import for_flags

    try:  # a task of srun is a rank as one of torchrun is: one contract from here on
        adopt_scheduler_env()
    except ValueError as e:
        say(f"error: {e}")
        return 2
    existed = os.path.exists(os.path.expanduser(args.out))
    try:
        cfg, sizes = _check_flags(args, existed)
        _start_forkserver_early(args.start_method)  # its folder made in the temp dir judges it (before torch loads)
    except ConfigError as e:
        _remove_if_made(args.out, existed)  # a temp dir refused by the forkserver's folder: --out probed already
        say(f"error: {for_flags(e)}")
        return 2
    from ..data import DataError
    from ..engine.checkpoint import CheckpointError
    from ..ranks.launcher import LaunchError, RankFailedError
    from .outputs import OutputError

    try:
        result = _train(cfg, sizes, args)
    except (ConfigError, DataError, LaunchError) as e:  # refused before any rank started
        _remove_if_made(args.out, existed)
        say(f"error: {for_flags(e)}")  # in the words of the command line: its flags
        return 2
    except OutputError as e:
        say(f"error: {e}")
        return 1
    except CheckpointError as e:
        say(f"error: {e.said(os.path.join(args.out, 'result.json'))}")
        return 1
    except RankFailedError as e:
        say(f"error: {e}")
        if e.partial_result is not None:
            _save_partial(e, args.out)
        return 1
    if result is None:
        return 0  # a torchrun rank other than 0: rank 0 writes and prints
    print(result.summary())
    print(f"wall {result.wall_time_s:.2f} s, start-up {result.startup_s:.2f} s, training loop {result.loop_time_s:.2f} s "
          f"({result.steps_per_s:.0f} steps/s)")
    print(f"wrote {os.path.join(args.out, 'result.json')}" + ("" if args.no_plots else " and 3 plots"))
    return 0
