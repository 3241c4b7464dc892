"""What the command line writes: its lines on stderr, and its output folder (room for what a run will write,
checked before it trains; result.json and the plots; a run's result kept somewhere else when writing it still
fails, e.g. a disk that filled up during training)."""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from typing import Any, List, Optional, Tuple

from ..common.files import atomic_write
from ..data.catalog import MAX_TRAIN, steps_per_epoch  # the same step count the run's plan will use
from ..engine.config import MAX_TABLE_BYTES, TrainConfig

PLOT_NAMES = ("loss.png", "grad_norms.png", "fingerprints.png")
# The listing's model, Flatten -> Linear(784, 10): weights and biases. A count, not the model, so that --out is
# sized before torch is imported (test_outputs checks it against engine.model.build_model).
MODEL_PARAMS = 28 * 28 * 10 + 10
KEPT_PREFIX = "ddp_helpers-result-"  # folders in the temp dir holding results that --out could not take


class OutputError(OSError):
    """The run trained, but its files could not be written into --out; the message says where the result is."""


def _b64(n_bytes: int) -> int:
    return 4 * -(-n_bytes // 3)  # arrays are stored as base64 text


def estimate_bytes(cfg: TrainConfig) -> Tuple[int, int]:
    """(result.json, the three plots) in bytes, from above: what a run of cfg writes into --out.

    Measured against real runs (mnist-5k and Fashion-MNIST, 1-8 ranks, 5-938 steps): result.json is 0.78-0.89
    of this estimate (0.25 without telemetry), the plots 0.15-0.46 (they grow with the ranks and the steps drawn).
    """
    steps = _steps(cfg)
    params = MODEL_PARAMS
    per_rank_step = 200 + _b64(4 * cfg.batch_size * cfg.accumulation_steps)  # numbers, hashes, sample indices
    captures = sum(1 for s in set(cfg.capture_grad_steps) if s < steps)
    result = (16_000 + _b64(4 * params) + steps * cfg.world_size * per_rank_step
              + captures * 2 * _b64(4 * params * cfg.world_size))  # local and synced gradients of every rank
    plots = len(PLOT_NAMES) * (150_000 + 60_000 * cfg.world_size)
    return int(result * 1.1), plots


def _steps(cfg: TrainConfig) -> int:
    """Optimizer steps a run of cfg records at most: its data set's largest size (mnist's is known only once it is
    loaded: offline it falls back to mnist-5k), and no more than a rank's tables hold, MAX_TABLE_BYTES of them at 4
    bytes a sample index (engine/telemetry.py refuses a larger run, once its size is known, before it starts: a
    run too large to record writes nothing here)."""
    per_epoch = -(-steps_per_epoch(MAX_TRAIN.get(cfg.dataset, 60000), cfg.world_size, cfg.batch_size,
                                   cfg.pipeline) // cfg.accumulation_steps)
    steps = min(cfg.epochs * per_epoch, cfg.max_steps or cfg.epochs * per_epoch)
    return min(steps, MAX_TABLE_BYTES // (4 * cfg.batch_size * cfg.accumulation_steps))


def check_room(out: str, cfg: TrainConfig, plots: bool) -> None:
    """Refuse an --out whose filesystem can't hold what the run will write (ValueError naming --out)."""
    result_bytes, plot_bytes = estimate_bytes(cfg)
    need = result_bytes + (plot_bytes if plots else 0)
    try:
        free = shutil.disk_usage(out).free
    except OSError:
        return  # can't tell (the probe already wrote there): the keep-on-failure path still protects the result
    if free < need:
        what = f"result.json ~{result_bytes:,}" + (f" and 3 plots ~{plot_bytes:,}" if plots else "")
        raise ValueError(f"--out {out!r} has {free:,} bytes free, and this run writes up to {need:,} ({what}); free "
                         "some space there or choose another --out" + ("" if not plots else ", or add --no-plots"))


def free_text(folder: str) -> str:
    """'N bytes free' for folder's filesystem, or '' where that can't be read."""
    try:
        return f", {shutil.disk_usage(folder).free:,} bytes free"
    except OSError:
        return ""


def keep_result(result, name: str = "result.json") -> Tuple[Optional[str], str]:
    """Save result in a new folder of the temp dir, else the home folder; (path or None, why not)."""
    why = ""
    for base in (tempfile.gettempdir(), os.path.expanduser("~")):
        try:
            folder = tempfile.mkdtemp(prefix=KEPT_PREFIX, dir=base)
            return result.save(os.path.join(folder, name)), ""
        except OSError as e:
            why = f"{base}: {e.strerror or e}"
    return None, why


def failure_message(result, out: str, written: List[str], failed: str, err: OSError,
                    name: str = "result.json") -> str:
    """One line: what couldn't be written and why, where the result is now, and the fix."""
    reason = f"{os.strerror(err.errno) if err.errno else err}{free_text(out)}"  # not atomic_write's long text
    fix = f"free some space in {out} or choose another --out"
    if written and os.path.basename(written[0]) == name:  # the result is safe; only a plot is missing
        return (f"{name} was written ({written[0]}), but {os.path.basename(failed)} could not be ({reason}); "
                f"{fix}, or add --no-plots")
    kept, why = keep_result(result, name)
    where = f"the run's {name} is kept at {kept}" if kept else f"it could not be kept elsewhere either ({why})"
    return f"can't write {failed} ({reason}): {where}; {fix}"


def say(line: str) -> None:
    """Write one line to stderr in one write: print's text and newline are two, and under torchrun (python -u)
    another process's log line written to the same terminal or pipe can land between them."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def write_outputs(result: Any, out: str, plots: bool = True) -> List[str]:
    """Save result.json and the plots; return the paths written.

    Raises OutputError (one line) if a file can't be written, saying where the result is: in out, or, where
    result.json itself failed, in a new folder of the temp dir.
    """
    paths: List[str] = []
    path = os.path.join(out, "result.json")
    try:
        os.makedirs(out, exist_ok=True)
        paths.append(result.save(path))
        if plots:
            from ..lesson.figures import training as P

            for name, draw in (("loss.png", lambda: P.plot_losses(result, smooth=10)),
                               ("grad_norms.png", lambda: P.plot_grad_norms(result)),
                               ("fingerprints.png", lambda: P.plot_fingerprints(result))):
                path, fig = os.path.join(out, name), draw()
                # the figures are drawn for >= 150 dpi; atomically, so a full disk leaves no broken PNG
                paths.append(atomic_write(path, lambda tmp, fig=fig: fig.savefig(tmp, dpi=150, format="png")))
    except OSError as e:  # a full disk, a folder removed or made read-only during training (PIL's too)
        raise OutputError(failure_message(result, out, paths, path, e)) from None
    return paths
