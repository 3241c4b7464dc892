"""A training control panel for notebooks: pick the settings, press Train, watch each rank, see the plots.

The panel runs the package's real DDP training (run_training) when its Train button is pressed. One progress
bar per rank is driven by run_training's on_progress callback, which runs in the notebook's process between
polls of the ranks, so the bars move while the cell's kernel is busy. When training ends, the loss and gradient
norm plots appear in the panel's Output widget; a rejected setting or a failed rank is shown as a one-line
message in the panel, never as a traceback. Everything else a run says (the offline data fallback, a warning) is
shown in the same status line: printed from a button's callback, it would go to JupyterLab's log console, where a
learner never looks. Each run starts from an empty panel, so bars and plots always belong to the run named above.

Ranks are started with the launcher's default ("auto": forked from a server that has torch imported, where the
platform has one): after the first run a launch costs a fraction of a second, a spawn launch several seconds.
"""
from __future__ import annotations

import base64
import contextlib
import html
import io
import time
import warnings
from typing import Any, Callable, Dict, List, Optional

from ..engine.config import BACKENDS, DATASETS, ConfigError, TrainConfig
from ..data import DataError
from ..ranks.launcher import LaunchError, RankFailedError
from ..engine.result import TrainResult
from ..ranks.startmethod import resolve_start_method

DEFAULT_BASE = TrainConfig(dataset="mnist-5k", backend="gloo", threads_per_rank=1, seed=0)  # offline, deterministic
_COLORS = {"info": "#444444", "busy": "#1f5fa8", "done": "#1a7f37", "error": "#b42318", "notice": "#9a6700"}
_PREFIX = "[ddp_helpers] "  # how the package's notices start on stderr; the panel names no sender


class _LineSink(io.TextIOBase):
    """A text stream that hands each complete line to a callback (stands in for sys.stderr during a run)."""

    def __init__(self, on_line: Callable[[str], None]):
        super().__init__()
        self.on_line, self.pending = on_line, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            self.on_line(line)
        return len(text)

    def warning(self, message, category, filename, lineno, file=None, line=None) -> None:
        """warnings.showwarning's signature: one line, its class and message (not the file path)."""
        self.write(f"{category.__name__}: {message}\n")

    def flush(self) -> None:
        if self.pending:
            line, self.pending = self.pending, ""
            self.on_line(line)


def _figure_output(fig: Any) -> Dict[str, Any]:
    """A matplotlib Figure as an Output-widget display_data entry (PNG), without pyplot or a kernel."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=150)
    w, h = fig.get_size_inches()
    # Drawn at 150 dpi for sharpness, shown at 100 px per inch so the panel keeps its size on screen. A Plot's alt
    # text goes with it, as a Plot shown in a cell carries it (the site's static snapshot puts it on the <img>).
    alt = getattr(fig, "alt", "")
    shown = {"width": round(w * 100), **({"alt": alt} if alt else {})}
    return {"output_type": "display_data", "metadata": {"image/png": shown},
            "data": {"image/png": base64.b64encode(buf.getvalue()).decode("ascii"),
                     "text/plain": alt or f"<Figure size {w * 100:.0f}x{h * 100:.0f}>"}}


class ControlPanel:
    """ipywidgets panel around run_training; .result is the last finished TrainResult, .error the last failure."""

    def __init__(self, base: Optional[TrainConfig] = None, start_method: str = "auto", max_world_size: int = 8):
        import ipywidgets as w

        self.base = base or DEFAULT_BASE
        self.start_method = start_method
        self.result: Optional[TrainResult] = None
        self.error: Optional[BaseException] = None
        self.message = "Press Train to start."  # plain text of the status line's first line
        self.notices: List[str] = []  # what the last run said besides (the data fallback, warnings), one per line
        self.runs = 0
        style = {"description_width": "90px"}
        layout = w.Layout(width="260px")
        self.world_size = w.BoundedIntText(value=self.base.world_size, min=1, max=max_world_size,
                                           description="world size", style=style, layout=layout)
        self.backend = w.Dropdown(options=list(BACKENDS), value=self.base.backend, description="backend",
                                  style=style, layout=layout)
        self.dataset = w.Dropdown(options=list(DATASETS), value=self.base.dataset, description="dataset",
                                  style=style, layout=layout)
        # Free-form numbers on purpose: TrainConfig's checks are the one place that says what is accepted.
        self.batch_size = w.IntText(value=self.base.batch_size, description="batch size", style=style, layout=layout)
        self.lr = w.FloatText(value=self.base.lr, description="lr", style=style, layout=layout)
        self.epochs = w.BoundedIntText(value=self.base.epochs, min=1, max=1000, description="epochs", style=style,
                                       layout=layout)
        self.train_button = w.Button(description="Train", button_style="primary", icon="play",
                                     tooltip="Train with these settings on real processes")
        self.status = w.HTML()
        self.bars: List[Any] = []  # one IntProgress per rank, rebuilt for each run
        self.bar_labels: List[Any] = []
        self.progress = w.VBox()
        self.output = w.Output()
        self.train_button.on_click(lambda _button: self.train())
        settings = w.VBox([w.HBox([self.world_size, self.backend, self.dataset]),
                           w.HBox([self.batch_size, self.lr, self.epochs])])
        self.widget = w.VBox([w.HTML("<b>DDP training control panel</b>"), settings,
                              w.HBox([self.train_button, self.status]), self.progress, self.output])
        self._set_status("info", self.message)

    # ------------------------------------------------------------------------------------------- settings
    def config(self) -> TrainConfig:
        """The TrainConfig the widgets describe (a ConfigError for a value it can't hold)."""
        return self.base.replace(**self.settings())

    def settings(self) -> Dict[str, Any]:
        """The widget values, for short displays (shown as they are, also where TrainConfig would refuse one)."""
        return {"world_size": int(self.world_size.value), "backend": self.backend.value,
                "dataset": self.dataset.value, "batch_size": int(self.batch_size.value),
                "lr": float(self.lr.value), "epochs": int(self.epochs.value)}

    # ---------------------------------------------------------------------------------------------- train
    def train(self) -> Optional[TrainResult]:
        """Run one training with the current settings (what the Train button does); errors go to the panel."""
        self.runs += 1
        run = self.runs
        self.error = None
        self.notices = []
        self._clear_run()  # the previous run's bars and plots go, whatever this run turns out to be
        self.train_button.disabled = True  # one run at a time: a second click would queue behind this one
        sink = _LineSink(self._add_notice)
        try:
            # A button's callback has no cell: what it writes to stderr would land in Lab's log console.
            with contextlib.redirect_stderr(sink), warnings.catch_warnings():
                warnings.showwarning = sink.warning
                result, seconds = self._run(run)
        except ConfigError as e:
            self._failed(run, e, f"setting rejected: {e}")
            return None
        except RankFailedError as e:
            self._add_notes(getattr(e, "partial_result", None))
            self._failed(run, e, f"training failed on rank {e.rank}: {e.message}")
            return None
        except (LaunchError, DataError) as e:
            self._failed(run, e, f"could not start: {e}")
            return None
        except Exception as e:  # noqa: BLE001 - the panel shows every error as a message; .error keeps it
            self._failed(run, e, f"unexpected {type(e).__name__}: {e}")
            return None
        finally:
            sink.flush()
            self.train_button.disabled = False
        self.result = result
        self._add_notes(result)
        last = result.ranks[0].loss[-1] if result.n_steps else float("nan")
        self._set_status("done", f"run {run} finished: {result.n_steps} steps per rank on {result.world_size} "
                                 f"rank(s) in {seconds:.1f} s; rank 0's last loss {last:.3f}, test accuracy "
                                 f"{result.test_accuracy:.3f}; replicas identical after every step: "
                                 f"{result.fingerprints_agree()}")
        self._show_plots(result)
        return result

    def _run(self, run: int):
        """Train; returns the TrainResult and the seconds it took (run_training checks the settings before any
        process starts; a refusal clears the bars made here: _failed)."""
        cfg = self.config()
        self._make_bars(cfg.world_size)
        method = resolve_start_method(self.start_method)
        self._set_status("busy", f"run {run}: training {cfg.world_size} rank(s) ({method})...")
        t0 = time.monotonic()
        from ..engine.runner import run_training

        result = run_training(cfg, progress=False, start_method=method, on_progress=self._on_progress)
        return result, time.monotonic() - t0

    def _failed(self, run: int, error: BaseException, text: str) -> None:
        self.error = error
        if not isinstance(error, RankFailedError):
            self._clear_run()  # nothing trained: no bars stay behind (a failed rank's bars show where it stopped)
        first = str(text).strip().splitlines()[0]  # never a traceback, even if a message carries one
        self._set_status("error", f"run {run}: {first}")

    def _clear_run(self) -> None:
        self.bars, self.bar_labels = [], []
        self.progress.children = ()
        self.output.outputs = ()

    def _add_notice(self, line: str) -> None:
        """One line a run wrote to stderr, or one of its result's notes, shown under the status message."""
        text = line.strip()
        if text.startswith(_PREFIX):
            text = text[len(_PREFIX):]
        if text and text not in self.notices:
            self.notices.append(text)
            self._set_status(self._kind, self.message)

    def _add_notes(self, result: Optional[TrainResult]) -> None:
        for note in getattr(result, "notes", None) or []:  # kept with the result: said again on a cached load
            self._add_notice(note)

    def _make_bars(self, world_size: int) -> None:
        import ipywidgets as w

        self.bars = [w.IntProgress(value=0, min=0, max=1, description=f"rank {r}", bar_style="info",
                                   style={"description_width": "60px"}) for r in range(world_size)]
        self.bar_labels = [w.Label("waiting") for _ in range(world_size)]
        self.progress.children = [w.HBox([b, lab]) for b, lab in zip(self.bars, self.bar_labels)]

    def _on_progress(self, counts: List[int], total: int) -> None:
        """run_training's callback: steps done per rank, out of total."""
        for bar, label, n in zip(self.bars, self.bar_labels, counts):
            bar.max = max(total, 1)
            bar.value = min(int(n), bar.max)
            label.value = f"{int(n)}/{total} steps"
            if n >= total:
                bar.bar_style = "success"

    def _show_plots(self, result: TrainResult) -> None:
        from .figures.training import plot_grad_norms, plot_losses

        self.output.outputs = tuple(_figure_output(f) for f in (plot_losses(result), plot_grad_norms(result)))

    def _set_status(self, kind: str, text: str) -> None:
        self.message, self._kind = text, kind
        lines = [f'<span style="color:{_COLORS[kind]}">{html.escape(text)}</span>']
        lines += [f'<span style="color:{_COLORS["notice"]}">note: {html.escape(n)}</span>' for n in self.notices]
        self.status.value = "<br>".join(lines)

    @property
    def status_text(self) -> str:
        """The status line as plain text: the message, then one "note: ..." line per notice of the run."""
        return "\n".join([self.message] + [f"note: {n}" for n in self.notices])

    # -------------------------------------------------------------------------------------------- display
    def _repr_mimebundle_(self, **kwargs: Any) -> Dict[str, Any]:
        bundle = self.widget._repr_mimebundle_(**kwargs)
        # The widgets' own text repr lists every child's state; this one line is stable from run to run.
        bundle["text/plain"] = repr(self)
        return bundle

    def __repr__(self) -> str:
        return "ControlPanel(" + ", ".join(f"{k}={v!r}" for k, v in self.settings().items()) + ")"


def control_panel(base: Optional[TrainConfig] = None, start_method: str = "auto") -> ControlPanel:
    """Build the control panel; display it as a cell's value, press Train, read .result afterwards."""
    return ControlPanel(base, start_method=start_method)
