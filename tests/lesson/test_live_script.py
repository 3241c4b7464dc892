"""run_script: a program's lines shown while it runs (not at its end), a running line that counts the seconds in
Jupyter and leaves only the command behind, and nothing left running after a timeout."""
from __future__ import annotations

import io
import subprocess
import sys
import textwrap

import pytest

from ddp_helpers.lesson.live_script import run_script

# Prints a line, then waits (at most 60 s) for the file named in argv[1]: only a reader that sees the line while
# the program runs can create it in time.
WAITS_FOR_ITS_READER = textwrap.dedent("""
    import os, sys, time
    print("first line")
    deadline = time.monotonic() + 60
    while not os.path.exists(sys.argv[1]):
        if time.monotonic() > deadline:
            print("nobody read the first line while I ran", file=sys.stderr)
            sys.exit(3)
        time.sleep(0.02)
    print("second line")
""")


class _Reader(io.StringIO):
    """sys.stdout for the test: creates the marker file as soon as the first line is written."""

    def __init__(self, marker):
        super().__init__()
        self.marker = marker

    def write(self, text):
        if "first line" in text:
            self.marker.write_text("seen")
        return super().write(text)


def test_lines_are_shown_while_the_program_runs(tmp_path, monkeypatch):
    marker = tmp_path / "seen"
    reader = _Reader(marker)
    monkeypatch.setattr(sys, "stdout", reader)
    run = run_script([sys.executable, "-c", WAITS_FOR_ITS_READER, str(marker)], shown_as="python waiter.py")
    assert run.returncode == 0, run.stderr
    assert reader.getvalue() == "$ python waiter.py\nfirst line\nsecond line\n"
    assert run.stdout == "first line\nsecond line\n" and run.stderr == ""


def test_a_failing_program_shows_its_stderr(capsys):
    run = run_script([sys.executable, "-c", "import sys; print('partial'); sys.exit('it broke')"], shown_as="x")
    assert run.returncode == 1
    captured = capsys.readouterr()
    assert captured.out == "$ x\npartial\n" and captured.err == "it broke\n"


# The listing's script where torchvision isn't installed: its import fails as it would there.
WITHOUT_TORCHVISION = ("import sys; sys.path = [p for p in sys.path if 'site-packages' not in p]; "
                       "import torchvision")


def test_a_program_missing_torchvision_names_the_extra_in_one_line(capsys):
    """Issue 62: the listing's script cell failed with a bare AssertionError wrapping torchvision's ImportError."""
    with pytest.raises(ModuleNotFoundError) as raised:
        run_script([sys.executable, "-c", WITHOUT_TORCHVISION],
                   shown_as="python examples/ddp_mnist.py --data-root <the folder>")
    line = str(raised.value)
    assert "\n" not in line and line.startswith("python examples/ddp_mnist.py needs torchvision"), line
    assert 'pip install ".[vision]"' in line and "vision extra" in line, line
    assert "No module named 'torchvision'" in raised.value.stderr, "the program's own error is kept"
    assert "Traceback" not in capsys.readouterr().err, "the one line replaces the program's traceback"


def test_a_torchvision_built_for_another_torch_names_the_paired_build(monkeypatch):
    from ddp_helpers.common import extras

    monkeypatch.setattr(extras, "_version", {"torch": "2.13.0+cpu", "torchvision": "0.28.0"}.get)
    foreign = "raise RuntimeError('operator torchvision::nms does not exist')"
    with pytest.raises(ModuleNotFoundError, match=r"torchvision 0\.28\.0 doesn't load beside torch 2\.13\.0\+cpu .*"
                       r"pip install torchvision==0\.28\.0\+cpu --index-url https://download\.pytorch\.org/whl/cpu"):
        run_script([sys.executable, "-c", foreign], shown_as="python examples/ddp_mnist.py")
    assert extras.paired_install("2.15.0") == "pip install torchvision==0.29.2"
    assert "released with torch 9.9.9" in extras.paired_install("9.9.9+cpu")


def _left_running(token: str) -> list:
    """Processes (not zombies) whose command line holds token: what a run left behind."""
    import psutil

    left = []
    for proc in psutil.process_iter(["cmdline", "status"]):
        if token in " ".join(proc.info["cmdline"] or []) and proc.info["status"] != psutil.STATUS_ZOMBIE:
            left.append(proc.pid)
    return left


# A program that starts a child of its own (as the script starts its ranks), says so, and sleeps.
PARENT_AND_CHILD = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
                    "'import time; time.sleep(60)', sys.argv[1]]); print('started', flush=True); time.sleep(60)")


@pytest.mark.slow
def test_an_interrupt_ends_the_program_and_what_it_started(tmp_path):
    """The stop button (KeyboardInterrupt in the cell) leaves nothing running: the program's group is ended."""
    def stop_when_started(line):
        if line.startswith("started"):
            raise KeyboardInterrupt

    token = f"child-of-{tmp_path.name}"
    with pytest.raises(KeyboardInterrupt):
        run_script([sys.executable, "-c", PARENT_AND_CHILD, token], shown_as="sleeper", on_line=stop_when_started)
    assert _left_running(token) == []


@pytest.mark.slow
def test_a_timeout_ends_the_program(tmp_path):
    token = f"timed-out-{tmp_path.name}"
    with pytest.raises(subprocess.TimeoutExpired):
        run_script([sys.executable, "-c", PARENT_AND_CHILD, token], shown_as="sleeper", timeout_s=2)
    assert _left_running(token) == []


@pytest.mark.timeout(180)
@pytest.mark.slow
def test_in_a_kernel_the_command_line_counts_seconds_then_stores_only_the_command(tmp_path):
    """What nbval compares (the first display, the stream) equals what a saved notebook keeps (the last update)."""
    from tests._kernel import cell_outputs

    marker = tmp_path / "seen"
    script = tmp_path / "waiter.py"
    # Each step waits for the test to have seen the previous one: an update while nothing is printed yet, the
    # first line, an update after it.
    script.write_text(textwrap.dedent("""
        import os, sys, time

        def wait_for(path):
            deadline = time.monotonic() + 60
            while not os.path.exists(path):
                if time.monotonic() > deadline:
                    sys.exit(f"{path} never came")
                time.sleep(0.02)

        wait_for(sys.argv[1] + ".starting")
        print("first line")
        wait_for(sys.argv[1] + ".running")
        print("second line")
    """))

    def on_message(msg):
        text = msg["content"].get("data", {}).get("text/plain", "") + msg["content"].get("text", "")
        for word in ("starting", "running"):
            if msg["msg_type"] == "update_display_data" and f"[{word}" in text:
                (tmp_path / f"seen.{word}").write_text("")

    outputs = cell_outputs(textwrap.dedent(f"""
        import sys
        from ddp_helpers.lesson.live_script import run_script
        run = run_script([sys.executable, {str(script)!r}, {str(marker)!r}], shown_as="python waiter.py")
        assert run.returncode == 0, run.stderr
    """), on_message=on_message)
    kinds = [o["msg_type"] for o in outputs]
    assert kinds[0] == "display_data" and outputs[0]["data"] == {"text/plain": "$ python waiter.py"}, outputs[0]
    updates = [o["data"]["text/plain"] for o in outputs if o["msg_type"] == "update_display_data"]
    assert any(u.startswith("$ python waiter.py    [starting (nothing printed yet): ") for u in updates), updates
    assert updates[-1] == "$ python waiter.py", updates  # the last update puts back what the first display said
    streams = "".join(o["text"] for o in outputs if o["msg_type"] == "stream")
    assert streams == "first line\nsecond line\n"
    first_line_at = next(i for i, o in enumerate(outputs) if o["msg_type"] == "stream")
    assert any(o["msg_type"] == "update_display_data" and "[running: " in o["data"]["text/plain"]
               for o in outputs[first_line_at:]), "no running line after the first line"
