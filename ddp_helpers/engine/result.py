"""What run_training returns: TrainResult (per-rank step records, accuracy, timings), saved and loaded as JSON."""
from __future__ import annotations

import base64
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import numpy as np
import torch

from ..common.files import atomic_write
from .model import build_model
from .telemetry import RankField, StepFloat, StepInt

RESULT_FORMAT = "ddp_helpers.TrainResult/1"


def _enc(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "b64": base64.b64encode(a.tobytes()).decode("ascii")}


def _dec(d: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(d["b64"]), dtype=np.dtype(d["dtype"])).reshape(d["shape"]).copy()


def _clean(x: Any) -> Any:
    """Replace non-finite floats by None, recursively, so the file is strict JSON."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _num(x: Any) -> float:
    return float("nan") if x is None else float(x)


def _floats(a: np.ndarray) -> list:
    return [None if not math.isfinite(x) else float(x) for x in a.tolist()]


@dataclass
class RankRecords:
    """One rank's per-step series (arrays of equal length: one entry per optimizer step)."""

    rank: int
    step: np.ndarray  # global step number (continues after a resume)
    loss: np.ndarray  # this rank's mean loss on its own batch
    local_grad_norm: np.ndarray  # L2 norm of this rank's gradient, before the all-reduce
    synced_grad_norm: np.ndarray  # L2 norm of the gradient after the all-reduce (the one optimizer.step uses)
    param_fingerprint: List[str]  # 16 hex digits hashing all parameters after the step
    samples_hash: List[str]  # 16 hex digits hashing the sample indices the step used
    sample_indices: np.ndarray  # (steps, samples per step) int32, -1 where a last batch was short
    step_time_s: np.ndarray  # wall time of the step on this rank
    step_start_s: np.ndarray  # monotonic clock at the step's start (shared by all processes on a machine)

    def __len__(self) -> int:
        return len(self.step)


@dataclass
class TrainResult:
    """What run_training returns: per-rank records plus accuracy, timings and the config that produced them."""

    config: Dict[str, Any]
    backend: str
    dataset: str  # the data set actually used (after an offline fallback)
    data_source: str
    ranks: List[RankRecords]
    test_accuracy: float
    wall_time_s: float  # launch to the end of the last rank
    startup_s: float  # launch to the first step (the slowest rank's)
    loop_time_s: float  # the last rank's first step to the last rank's end: start-up + loop <= wall, no overlap
    peak_rss_mb: List[float]  # per rank (its DataLoader workers included)
    parent_rss_mb: float
    bytes_allreduced: List[float]  # per rank, gradient bytes handed to all-reduce
    allreduce_calls: List[int]  # per rank, communication-hook calls (one per bucket per synchronized backward)
    peak_cuda_mb: List[float] = field(default_factory=list)  # per rank, peak GPU memory allocated (NaN on CPU)
    captured_grads: Dict[int, Dict[str, np.ndarray]] = field(default_factory=dict)  # step -> local/synced (W, P)
    final_params: Optional[np.ndarray] = None  # rank 0's flattened parameters at the end (a partial result's: after
    # the last step rank 0 recorded)
    notes: List[str] = field(default_factory=list)
    complete: bool = True  # False for the partial result kept when a run failed
    # where the ranks ran, under torchrun or SLURM: the rendezvous address, each rank's host, interface and
    # address, the scheduler's job, the attempt, and on a failure the rank blamed (cli/nodes.py)
    provenance: Dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------------------------ views
    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self.ranks)

    @property
    def n_steps(self) -> int:
        """Steps every rank finished."""
        return min((len(r) for r in self.ranks), default=0)

    @property
    def steps_per_s(self) -> float:
        """Optimizer steps per second of training loop."""
        return self.n_steps / self.loop_time_s if self.loop_time_s > 0 else float("nan")

    def fingerprints_agree(self) -> bool:
        """True when all ranks had bitwise-equal parameters after every common step."""
        n = self.n_steps
        first = self.ranks[0].param_fingerprint[:n]
        return all(r.param_fingerprint[:n] == first for r in self.ranks[1:])

    def synced_norms_agree(self) -> bool:
        """True when every rank's synchronized gradient norm is identical at every common step."""
        n = self.n_steps
        a = self.ranks[0].synced_grad_norm[:n]
        return all(np.array_equal(r.synced_grad_norm[:n], a) for r in self.ranks[1:])

    def records(self) -> List[Dict[str, Any]]:
        """One flat dict per (rank, step), e.g. for pandas.DataFrame(result.records())."""
        out = []
        for r in self.ranks:
            for i in range(len(r)):
                out.append({
                    "rank": r.rank, "step": int(r.step[i]), "loss": float(r.loss[i]),
                    "local_grad_norm": float(r.local_grad_norm[i]), "synced_grad_norm": float(r.synced_grad_norm[i]),
                    "param_fingerprint": r.param_fingerprint[i], "samples_hash": r.samples_hash[i],
                    "step_time_s": float(r.step_time_s[i]),
                })
        return out

    def summary(self, digits: int = 4) -> str:
        """A short, deterministic text summary (no timings), safe to print in regression-tested notebooks."""
        lines = [f"dataset={self.dataset} backend={self.backend} world_size={self.world_size} steps={self.n_steps}"]
        for r in self.ranks:
            if len(r):
                lines.append(f"rank {r.rank}: first loss {r.loss[0]:.{digits}f}, last loss {r.loss[-1]:.{digits}f}")
        lines.append(f"parameters identical on all ranks after every step: {self.fingerprints_agree()}")
        lines.append(f"test accuracy: {self.test_accuracy:.{digits}f}")
        return "\n".join(lines)

    # ------------------------------------------------------------------------------------ the trained model
    def load_into(self, model: torch.nn.Module) -> torch.nn.Module:
        """Copy rank 0's final parameters into model (same shapes, in model.parameters() order); return it."""
        if self.final_params is None:
            raise ValueError("this result has no parameters: rank 0 recorded no step before the run failed")
        params = list(model.parameters())
        n = sum(p.numel() for p in params)
        if n != self.final_params.size:
            raise ValueError(f"the run trained {self.final_params.size} parameters and this model has {n}: load "
                             "into a model of the run's shape, e.g. result.model()")
        flat = torch.from_numpy(np.ascontiguousarray(self.final_params))
        offset = 0
        with torch.no_grad():  # in place, so an optimizer already holding these parameters keeps working
            for p in params:
                p.copy_(flat[offset:offset + p.numel()].view_as(p))
                offset += p.numel()
        return model

    def model(self) -> torch.nn.Module:
        """A new model of the run's shape (Flatten -> Linear(784, 10)) holding its trained parameters."""
        return self.load_into(build_model(int(self.config.get("seed", 0))))

    # ------------------------------------------------------------------------------------ files
    def to_dict(self) -> dict:
        """JSON-able dict (arrays of numbers as base64 with dtype and shape; NaN as null)."""
        return _clean({
            "format": RESULT_FORMAT,
            "config": self.config, "backend": self.backend, "dataset": self.dataset, "data_source": self.data_source,
            "test_accuracy": self.test_accuracy, "wall_time_s": self.wall_time_s, "startup_s": self.startup_s,
            "loop_time_s": self.loop_time_s, "peak_rss_mb": self.peak_rss_mb, "parent_rss_mb": self.parent_rss_mb,
            "bytes_allreduced": self.bytes_allreduced, "allreduce_calls": self.allreduce_calls,
            "peak_cuda_mb": self.peak_cuda_mb, "notes": self.notes, "complete": self.complete,
            "provenance": self.provenance,
            "final_params": None if self.final_params is None else _enc(self.final_params),
            "captured_grads": {str(k): {n: _enc(a) for n, a in v.items()} for k, v in self.captured_grads.items()},
            "ranks": [{
                "rank": r.rank, "step": r.step.tolist(), "loss": _floats(r.loss),
                "local_grad_norm": _floats(r.local_grad_norm), "synced_grad_norm": _floats(r.synced_grad_norm),
                "param_fingerprint": r.param_fingerprint, "samples_hash": r.samples_hash,
                "sample_indices": _enc(r.sample_indices), "step_time_s": _floats(r.step_time_s),
                "step_start_s": _floats(r.step_start_s),
            } for r in self.ranks],
        })

    @classmethod
    def from_dict(cls, d: dict) -> "TrainResult":
        """Inverse of to_dict."""
        if d.get("format") != RESULT_FORMAT:
            raise ValueError(f"not a {RESULT_FORMAT} file (format={d.get('format')!r})")

        def arr(x):
            return np.array([np.nan if v is None else v for v in x], dtype=np.float64)

        ranks = [RankRecords(
            rank=r["rank"], step=np.array(r["step"], dtype=np.int64), loss=arr(r["loss"]),
            local_grad_norm=arr(r["local_grad_norm"]), synced_grad_norm=arr(r["synced_grad_norm"]),
            param_fingerprint=list(r["param_fingerprint"]), samples_hash=list(r["samples_hash"]),
            sample_indices=_dec(r["sample_indices"]), step_time_s=arr(r["step_time_s"]),
            step_start_s=arr(r["step_start_s"]),
        ) for r in d["ranks"]]
        return cls(
            config=d["config"], backend=d["backend"], dataset=d["dataset"], data_source=d["data_source"], ranks=ranks,
            test_accuracy=_num(d["test_accuracy"]), wall_time_s=_num(d["wall_time_s"]),
            startup_s=_num(d["startup_s"]), loop_time_s=_num(d["loop_time_s"]),
            peak_rss_mb=[_num(x) for x in d["peak_rss_mb"]], parent_rss_mb=_num(d["parent_rss_mb"]),
            bytes_allreduced=[_num(x) for x in d["bytes_allreduced"]], allreduce_calls=d["allreduce_calls"],
            peak_cuda_mb=[_num(x) for x in d.get("peak_cuda_mb", [])],  # absent in files from older versions
            captured_grads={int(k): {n: _dec(a) for n, a in v.items()} for k, v in d["captured_grads"].items()},
            final_params=None if d["final_params"] is None else _dec(d["final_params"]),
            notes=d.get("notes", []), complete=d.get("complete", True),
            provenance=d.get("provenance") if isinstance(d.get("provenance"), dict) else {},
        )

    def save(self, path: str) -> str:
        """Write the result as JSON (atomically) and return the path."""
        path = os.fspath(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        text = json.dumps(self.to_dict(), allow_nan=False)

        def write(tmp: str) -> None:
            with open(tmp, "w") as fh:
                fh.write(text)

        return atomic_write(path, write)

    @classmethod
    def load(cls, path: str) -> "TrainResult":
        """Read a file written by save(); a file that isn't one is named, with what is wrong with it."""
        with open(path) as fh:
            text = fh.read()
        try:
            return cls.from_dict(json.loads(text))
        except RecursionError:  # json's decoder recurses once per level: 10**5 nested brackets exhaust the stack
            raise ValueError(f"{path} is not a result file: its JSON nests deeper than Python's recursion limit "
                             f"({sys.getrecursionlimit()}), which no result file does; it was damaged, edited, or "
                             "written by something else") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not a result file: its JSON is broken at line {e.lineno}, column {e.colno} "
                             f"({e.msg}); it was cut short or edited. Run the training again to write it anew") from None
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            raise ValueError(f"{path} is not a {RESULT_FORMAT} file that this version reads ({type(e).__name__}: "
                             f"{e}); it was damaged, edited, or written by something else") from None


def hex64(x: int) -> str:
    """Signed 64-bit int -> 16 hex digits."""
    return f"{x & 0xFFFFFFFFFFFFFFFF:016x}"


def _rank_records(tables: Optional[Dict[str, np.ndarray]], r: int) -> RankRecords:
    if tables is None:  # a rank that died before it made its rows file
        empty = np.zeros(0)
        return RankRecords(r, empty.astype(np.int64), empty, empty, empty, [], [], np.zeros((0, 0), np.int32),
                           empty, empty)
    n = int(tables["count"][0])
    f, i = tables["f64"][:n], tables["i64"][:n]
    return RankRecords(
        rank=r, step=i[:, StepInt.STEP].copy(), loss=f[:, StepFloat.LOSS].copy(),
        local_grad_norm=f[:, StepFloat.LOCAL_NORM].copy(), synced_grad_norm=f[:, StepFloat.SYNCED_NORM].copy(),
        param_fingerprint=[hex64(int(x)) for x in i[:, StepInt.FINGERPRINT]],
        samples_hash=[hex64(int(x)) for x in i[:, StepInt.SAMPLES]],
        sample_indices=tables["samples"][:n].copy(),
        step_time_s=f[:, StepFloat.TIME].copy(), step_start_s=f[:, StepFloat.START].copy(),
    )


def _startup_and_loop(info: np.ndarray, t_launch: float) -> tuple:
    firsts, ends = info[:, RankField.T_FIRST], info[:, RankField.T_END]
    started, ended = firsts[np.isfinite(firsts)], ends[np.isfinite(ends)]
    startup = float(started.max() - t_launch) if len(started) else float("nan")
    # The loop begins when the last rank begins: until then the others wait in their first all-reduce, and that
    # wait is start-up (already counted above), not training. Measured per rank, it would be counted twice.
    loop = float(ended.max() - started.max()) if len(started) and len(ended) else float("nan")
    return startup, loop


def _captured(tables: List[Optional[Dict[str, np.ndarray]]], capture_steps: tuple) -> Dict[int, Dict[str, np.ndarray]]:
    captured = {}
    if any(t is None for t in tables):
        return captured
    for ci, s in enumerate(capture_steps):
        if all(bool(t["capture_done"][ci]) for t in tables):
            captured[int(s)] = {"local": np.stack([t["captures"][ci, 0] for t in tables]),
                                "synced": np.stack([t["captures"][ci, 1] for t in tables])}
    return captured


def collect_result(tables: List[Optional[Dict[str, np.ndarray]]], config: dict, backend: str, dataset: str,
                   data_source: str, t_launch: float, t_done: float, capture_steps: tuple,
                   final_params: Optional[np.ndarray], parent_rss_mb: float, complete: bool = True) -> TrainResult:
    """Turn every rank's tables (RunRows.all_tables: as far as each rank got) into a TrainResult."""
    info = np.stack([t["info"] if t is not None else np.full(len(RankField), np.nan) for t in tables])
    startup, loop = _startup_and_loop(info, t_launch)
    correct, total = info[0, RankField.CORRECT], info[0, RankField.TOTAL]
    acc = float(correct / total) if np.isfinite(total) and total > 0 else float("nan")

    def per_rank(col: RankField, scale: float = 1.0) -> List[float]:
        return [float(x) * scale if math.isfinite(x) else float("nan") for x in info[:, col]]

    if final_params is None and tables and tables[0] is not None and int(tables[0]["count"][0]) > 0:
        final_params = tables[0]["params"].copy()  # after rank 0's last recorded step (a failed run's)
    return TrainResult(
        config=config, backend=backend, dataset=dataset, data_source=data_source,
        ranks=[_rank_records(t, r) for r, t in enumerate(tables)], test_accuracy=acc,
        wall_time_s=t_done - t_launch, startup_s=startup, loop_time_s=loop,
        peak_rss_mb=per_rank(RankField.RSS, 1 / 2**20), parent_rss_mb=parent_rss_mb,
        bytes_allreduced=per_rank(RankField.BYTES),
        allreduce_calls=[int(x) if math.isfinite(x) else 0 for x in info[:, RankField.ALLREDUCES]],
        peak_cuda_mb=per_rank(RankField.CUDA, 1 / 2**20),
        captured_grads=_captured(tables, capture_steps), final_params=final_params, complete=complete,
    )
