"""Per-rank, per-step telemetry: the tables each rank fills in its rows file, and the reader over a run's files.

Each rank fills its own tables in the run folder (ranks/folders.py), however it was started, so whoever reads
the run keeps every finished step even if a rank dies (nothing to flush, nothing to lose). The columns are
named once, in the IntEnums below; their counts follow from them.
"""
from __future__ import annotations

import enum
import math
import shutil
import signal
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np
import torch
import xxhash

from ..common.errors import setting
from ..common.files import free_text
from ..ranks.folders import rows_path
from ..ranks.starting import peak_rss_bytes
from ..ranks.rows import RowsReader, TableSpec, create_tables
from .config import MAX_TABLE_BYTES, ConfigError, TrainConfig
from .hooks import GradRecorder
from .model import fingerprint


class StepFloat(enum.IntEnum):
    """Columns of the float64 step table."""

    LOSS = 0  # this rank's mean loss on its own batch
    LOCAL_NORM = 1  # L2 norm of this rank's gradient, before the all-reduce
    SYNCED_NORM = 2  # ... and after it (the gradient optimizer.step uses)
    TIME = 3  # wall time of the step
    START = 4  # monotonic clock at the step's start


class StepInt(enum.IntEnum):
    """Columns of the int64 step table."""

    STEP = 0  # global step number (continues after a resume)
    FINGERPRINT = 1  # 64-bit hash of the parameters after the step
    SAMPLES = 2  # 64-bit hash of the sample indices the step used


class RankField(enum.IntEnum):
    """Fields of each rank's summary row (float64; NaN until the rank writes them)."""

    T_FIRST = 0  # monotonic clock at the first step
    T_END = 1  # ... after the last step
    CORRECT = 2  # test images classified correctly (summed over ranks)
    TOTAL = 3  # test images scored (summed over ranks)
    RSS = 4  # peak resident memory of the rank and its loader workers, bytes
    CUDA = 5  # peak GPU memory allocated, bytes (nccl ranks)
    BYTES = 6  # gradient bytes handed to all-reduce
    ALLREDUCES = 7  # communication-hook calls


@dataclass(frozen=True)
class TableShape:
    """How large one rank's tables are: the same numbers on every rank and in the parent (from the step plan)."""

    max_steps: int  # rows: optimizer steps this run makes (at least 1)
    samples_per_step: int  # batch_size * accumulation_steps
    n_capture: int  # steps whose full gradients are kept
    n_params: int  # scalar parameters of the model

    @classmethod
    def for_run(cls, cfg: TrainConfig, n_steps: int, n_params: int) -> "TableShape":
        """The tables of a run of cfg making n_steps steps with a model of n_params parameters (on every rank)."""
        return cls(max(n_steps, 1), cfg.batch_size * cfg.accumulation_steps, len(cfg.capture_grad_steps), n_params)

    def check_fits(self, cfg: TrainConfig, folder: str) -> None:
        """Refuse a run whose tables would not fit: over MAX_TABLE_BYTES a rank, or the room left in folder (the
        temp dir the rows files go to). The one check of a run's telemetry size, made once the data set's size
        is known (run_training's, the command line's and a torchrun rank's)."""
        per_rank = self.nbytes()
        if per_rank > MAX_TABLE_BYTES:
            raise self._too_large(cfg, per_rank)
        try:
            free = shutil.disk_usage(folder).free
        except OSError:
            return
        if per_rank * cfg.world_size > free:
            raise self._no_room(cfg, per_rank, folder)

    def _samples(self) -> str:
        return (f"{self.max_steps} steps x {self.samples_per_step} sample indices ({setting('batch_size')} x "
                f"{setting('accumulation_steps')})")

    def _too_large(self, cfg: TrainConfig, per_rank: int) -> ConfigError:
        return ConfigError(
            f"{setting('batch_size', cfg.batch_size, owner='TrainConfig')} is not accepted with "
            f"{setting('accumulation_steps', cfg.accumulation_steps)}, {setting('epochs', cfg.epochs)}, "
            f"{setting('max_steps', cfg.max_steps)}: each rank would record {per_rank:,} bytes of telemetry "
            f"({self._samples()}), over the {MAX_TABLE_BYTES:,} allowed; set {setting('max_steps')}, fewer epochs "
            f"or a smaller batch, or {setting('telemetry', False)}")

    def _no_room(self, cfg: TrainConfig, per_rank: int, folder: str) -> ConfigError:
        return ConfigError(
            f"{setting('world_size', cfg.world_size, owner='TrainConfig')} is not accepted here: the ranks' "
            f"telemetry needs {per_rank * cfg.world_size:,} bytes in {folder} ({free_text(folder)}; "
            f"{self._samples()} per rank); free some space there or point TMPDIR elsewhere, or set "
            f"{setting('max_steps')}, fewer epochs or a smaller batch")

    def specs(self) -> Dict[str, TableSpec]:
        """The rows file's tables: name -> (dtype, shape, initial fill)."""
        n = max(self.n_capture, 1)
        return {
            "f64": (np.float64, (self.max_steps, len(StepFloat)), np.nan),
            "i64": (np.int64, (self.max_steps, len(StepInt)), 0),
            "samples": (np.int32, (self.max_steps, self.samples_per_step), -1),
            "count": (np.int64, (1,), 0),  # steps done: rows below count are final
            "info": (np.float64, (len(RankField),), np.nan),
            "captures": (np.float32, (n, 2, self.n_params), 0.0),
            "capture_done": (np.bool_, (n,), False),
            "params": (np.float32, (self.n_params,), np.nan),  # rank 0's, after its last step: a partial result's
        }

    def nbytes(self) -> int:
        """Bytes of one rank's tables."""
        return sum(int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                   for dtype, shape, _ in self.specs().values())


def create_rank_tables(run_dir: str, rank: int, shape: TableShape) -> Dict[str, np.ndarray]:
    """This rank's rows file in run_dir, made and filled; writable views of its tables."""
    return create_tables(rows_path(run_dir, rank), shape.specs())


class RunRows:
    """Every rank's tables of one run, read from its run folder (or given over the process group)."""

    def __init__(self, run_dir: str, world_size: int):
        self.world_size = world_size
        self.reader = RowsReader(run_dir, world_size)

    def count(self, rank: int) -> int:
        """Steps one rank finished (0 if it has no rows yet)."""
        return int(self.reader.scalar(rank, "count") or 0)

    def counts(self) -> List[int]:
        """Steps finished by each rank."""
        return [self.count(r) for r in range(self.world_size)]

    def progress(self) -> int:
        """Steps finished by the slowest rank."""
        return min(self.counts())

    def tables(self, rank: int) -> Optional[Dict[str, np.ndarray]]:
        """A copy of one rank's tables (None if it made none)."""
        return self.reader.tables(rank)

    def all_tables(self) -> List[Optional[Dict[str, np.ndarray]]]:
        """A copy of every rank's tables, by rank (None for a rank that made none)."""
        return [self.reader.tables(r) for r in range(self.world_size)]

    def missing(self) -> List[int]:
        """The ranks whose rows this process can't see."""
        return [r for r in range(self.world_size) if not self.reader.has(r)]

    def give(self, rank: int, tables: Dict[str, np.ndarray]) -> None:
        """A rank's tables that came over the process group (its file is on another machine)."""
        self.reader.give(rank, tables)

    def close(self) -> None:
        """Unmap the files."""
        self.reader.close()


def samples_hash(idx) -> int:
    """A 64-bit hash (XXH3) of the int64 sample indices: equal on two ranks exactly when they used the same samples."""
    arr = np.ascontiguousarray(np.asarray(idx, dtype=np.int64))
    return int.from_bytes(xxhash.xxh3_64_digest(arr), "little", signed=True)


class RankTelemetry:
    """What one rank records: begin(step) before it, end(...) after optimizer.step, finish() at the end."""

    def __init__(self, run_dir: str, rank: int, shape: TableShape, cfg: TrainConfig, model: torch.nn.Module,
                 grads: GradRecorder):
        self.rank, self.grads, self.on, self.capacity = rank, grads, cfg.telemetry, shape.max_steps
        self.params = list(model.parameters())
        # What the fingerprint hashes: on CPU, NumPy views made once (the optimizer updates the parameters in place).
        self.hashed = [p.detach().numpy() for p in self.params] if self.params[0].device.type == "cpu" else self.params
        self.capture_index = {s: i for i, s in enumerate(cfg.capture_grad_steps)}
        tables = create_rank_tables(run_dir, rank, shape)  # this rank's file: its rows, written in place
        self.f64, self.i64, self.samples = tables["f64"], tables["i64"], tables["samples"]
        self.count, self.info = tables["count"], tables["info"]
        self.captures, self.capture_done = tables["captures"], tables["capture_done"]
        self.last_params = tables["params"]
        self.row, self.t0, self.capture = 0, 0.0, False
        self.hold_sigterm = hasattr(signal, "pthread_sigmask") and callable(signal.getsignal(signal.SIGTERM))

    def begin(self, step: int) -> None:
        """Start timing the step; tell the hook whether to keep this step's full gradients."""
        if self.row >= self.capacity:
            raise RuntimeError(f"telemetry tables hold {self.capacity} steps; step {step} is one too many")
        self.t0 = time.monotonic()
        if self.row == 0:
            self.info[RankField.T_FIRST] = self.t0
        self.capture = self.on and step in self.capture_index
        self.grads.start_step(self.capture)

    def end(self, step: int, loss: torch.Tensor, idx: torch.Tensor) -> None:
        """Record the finished step (loss, norms, fingerprint, samples, time) and publish it to the parent.

        A SIGTERM handler (a torchrun rank's: it writes the partial result) waits until the row is published:
        torchrun's agent stops a rank whenever a peer fails, also in the middle of this.
        """
        if self.hold_sigterm:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            self._record(step, loss, idx)
        finally:
            if self.hold_sigterm:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # a pending one is handled now

    def _record(self, step: int, loss: torch.Tensor, idx: torch.Tensor) -> None:
        row, f64, i64 = self.row, self.f64, self.i64
        if self.capture:
            self._capture(self.capture_index[step])
        if self.on:
            f64[row, StepFloat.LOSS], f64[row, StepFloat.LOCAL_NORM], f64[row, StepFloat.SYNCED_NORM] = \
                self._loss_and_norms(loss)
            i64[row, StepInt.FINGERPRINT] = fingerprint(self.hashed)
            idx_np = idx.numpy()
            i64[row, StepInt.SAMPLES] = samples_hash(idx_np)
            self.samples[row, :len(idx_np)] = idx_np
        i64[row, StepInt.STEP] = step
        if self.rank == 0:
            self._keep_params()
        t1 = time.monotonic()
        f64[row, StepFloat.START], f64[row, StepFloat.TIME] = self.t0, t1 - self.t0
        self.row += 1
        self.count[0] = self.row  # publish last: rows below count are complete

    def _keep_params(self) -> None:
        """Rank 0's parameters after this step, in its file: a failed run's partial result can be loaded."""
        offset = 0
        for p in self.hashed:
            flat = (p if isinstance(p, np.ndarray) else p.detach().float().cpu().numpy()).reshape(-1)
            self.last_params[offset:offset + flat.size] = flat
            offset += flat.size

    def _loss_and_norms(self, loss: torch.Tensor) -> Sequence[float]:
        sq = self.grads.squared_norms()
        if sq is None:  # no all-reduce ran (e.g. only no_sync micro-batches)
            return loss.item(), math.nan, math.nan
        loss_v, local_sq, synced_sq = torch.stack([loss, *sq]).tolist()  # one device sync per step
        return loss_v, math.sqrt(local_sq), math.sqrt(synced_sq)

    def _capture(self, ci: int) -> None:
        # After backward() every p.grad holds the averaged gradient: identical on all ranks.
        local = self.grads.local_grads
        self.captures[ci, 0] = torch.cat([local[id(p)].reshape(-1).float().cpu() for p in self.params]).numpy()
        self.captures[ci, 1] = torch.cat([p.grad.reshape(-1).float().cpu() for p in self.params]).numpy()
        self.capture_done[ci] = True

    def training_done(self, device: torch.device) -> None:
        """The loop is over: its end time and what the hook sent."""
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.info[RankField.T_END] = time.monotonic()
        self.info[RankField.BYTES], self.info[RankField.ALLREDUCES] = self.grads.bytes_sent, self.grads.calls

    def finish(self, correct: int, total: int, device: torch.device) -> None:
        """Test counts and peak memory, once the rank has evaluated."""
        self.info[RankField.CORRECT], self.info[RankField.TOTAL] = correct, total
        self.info[RankField.RSS] = peak_rss_bytes()
        if device.type == "cuda":
            self.info[RankField.CUDA] = torch.cuda.max_memory_allocated(device)
