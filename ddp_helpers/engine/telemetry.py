"""Per-rank, per-step telemetry: the shared-memory tables the ranks write and the parent reads.

Each rank fills its own rows, so the parent keeps every finished step even if a rank dies (nothing to flush,
nothing to lose). The columns are named once, in the IntEnums below; their counts follow from them.
"""
from __future__ import annotations

import enum
import math
import time
from typing import Sequence

import numpy as np
import torch
import xxhash

from ..ranks.procs import peak_rss_bytes
from .config import TrainConfig
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


class TelemetryBuffers:
    """The shared tables: one row block per rank, created in the parent before the ranks start."""

    def __init__(self, world_size: int, max_steps: int, samples_per_step: int, n_capture: int, n_params: int):
        def shared(shape, fill, dtype):
            return torch.full(shape, fill, dtype=dtype).share_memory_()

        self.f64 = shared((world_size, max_steps, len(StepFloat)), float("nan"), torch.float64)
        self.i64 = shared((world_size, max_steps, len(StepInt)), 0, torch.int64)
        self.samples = shared((world_size, max_steps, samples_per_step), -1, torch.int32)
        self.count = shared((world_size,), 0, torch.int64)  # steps done: rows below count are final
        self.rank_info = shared((world_size, len(RankField)), float("nan"), torch.float64)
        self.captures = shared((world_size, max(n_capture, 1), 2, n_params), 0.0, torch.float32)
        self.capture_done = shared((world_size, max(n_capture, 1)), False, torch.bool)

    TABLES = ("f64", "i64", "samples", "rank_info", "captures", "capture_done")  # per-rank tables, plus count

    @property
    def capacity(self) -> int:
        """Rows available per rank."""
        return self.f64.shape[1]

    def progress(self) -> int:
        """Steps finished by the slowest rank."""
        return int(self.count.min())

    def rank_rows(self, rank: int) -> dict:
        """Copies of one rank's rows (to send them to another process)."""
        rows = {k: getattr(self, k)[rank].clone() for k in self.TABLES}
        rows["count"] = int(self.count[rank])
        return rows

    def set_rank_rows(self, rank: int, rows: dict) -> None:
        """Put rows made by rank_rows (in another process) into this process's tables."""
        for k in self.TABLES:
            getattr(self, k)[rank] = rows[k]
        self.count[rank] = rows["count"]


def samples_hash(idx) -> int:
    """A 64-bit hash (XXH3) of the int64 sample indices: equal on two ranks exactly when they used the same samples."""
    arr = np.ascontiguousarray(np.asarray(idx, dtype=np.int64))
    return int.from_bytes(xxhash.xxh3_64_digest(arr), "little", signed=True)


class RankTelemetry:
    """What one rank records: begin(step) before it, end(...) after optimizer.step, finish() at the end."""

    def __init__(self, buf: TelemetryBuffers, rank: int, cfg: TrainConfig, model: torch.nn.Module,
                 grads: GradRecorder):
        self.buf, self.rank, self.grads, self.on = buf, rank, grads, cfg.telemetry
        self.params = list(model.parameters())
        # What the fingerprint hashes: on CPU, NumPy views made once (the optimizer updates the parameters in place).
        self.hashed = [p.detach().numpy() for p in self.params] if self.params[0].device.type == "cpu" else self.params
        self.capture_index = {s: i for i, s in enumerate(cfg.capture_grad_steps)}
        # numpy views of this rank's shared rows: element writes cost ~0.2 us instead of ~9 us through torch
        self.f64, self.i64 = buf.f64[rank].numpy(), buf.i64[rank].numpy()
        self.samples, self.count = buf.samples[rank].numpy(), buf.count.numpy()
        self.info = buf.rank_info[rank].numpy()
        self.row, self.t0, self.capture = 0, 0.0, False

    def begin(self, step: int) -> None:
        """Start timing the step; tell the hook whether to keep this step's full gradients."""
        if self.row >= self.buf.capacity:
            raise RuntimeError(f"telemetry buffers hold {self.buf.capacity} steps; step {step} is one too many")
        self.t0 = time.monotonic()
        if self.row == 0:
            self.info[RankField.T_FIRST] = self.t0
        self.capture = self.on and step in self.capture_index
        self.grads.start_step(self.capture)

    def end(self, step: int, loss: torch.Tensor, idx: torch.Tensor) -> None:
        """Record the finished step (loss, norms, fingerprint, samples, time) and publish it to the parent."""
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
        t1 = time.monotonic()
        f64[row, StepFloat.START], f64[row, StepFloat.TIME] = self.t0, t1 - self.t0
        self.row += 1
        self.count[self.rank] = self.row  # publish last: rows below count are complete

    def _loss_and_norms(self, loss: torch.Tensor) -> Sequence[float]:
        sq = self.grads.squared_norms()
        if sq is None:  # no all-reduce ran (e.g. only no_sync micro-batches)
            return loss.item(), math.nan, math.nan
        loss_v, local_sq, synced_sq = torch.stack([loss, *sq]).tolist()  # one device sync per step
        return loss_v, math.sqrt(local_sq), math.sqrt(synced_sq)

    def _capture(self, ci: int) -> None:
        # After backward() every p.grad holds the averaged gradient: identical on all ranks.
        local = self.grads.local_grads
        self.buf.captures[self.rank, ci, 0] = torch.cat([local[id(p)].reshape(-1).float().cpu() for p in self.params])
        self.buf.captures[self.rank, ci, 1] = torch.cat([p.grad.reshape(-1).float().cpu() for p in self.params])
        self.buf.capture_done[self.rank, ci] = True

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
