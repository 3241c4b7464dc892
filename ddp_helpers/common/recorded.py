"""The torch the committed notebooks were executed with, the ones their outputs were checked on, and a one-line note
when another one runs (stdlib only)."""
from __future__ import annotations

from typing import Optional, Tuple

RECORDED_TORCH = "2.14.1"  # requirements-recorded.txt's torch pin (tests/project/test_packaging.py keeps them equal)
# Every torch whose nbval run over every notebook passed against the stored outputs: the recorded one (make test)
# and the newest release (make test-ceiling, CEILING_TORCH; docs/maintainers.md, "The torch ceiling").
CHECKED_TORCH: Tuple[str, ...] = (RECORDED_TORCH, "2.15.0")
# The note's first words: notebooks/nbval_sanitize.cfg removes the line by them, so that a learner's nbval on a torch
# that runs the lesson correctly doesn't fail on it (tests/project/test_learner_setup.py keeps the two together).
NOTE_START = "[ddp_helpers] torch "


def installed_torch() -> Optional[str]:
    """The installed torch's version from its metadata, without importing torch (warm_up runs before it loads)."""
    from importlib import metadata  # here, not at the top: it loads email, zipfile and csv, for warm_up() only

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def torch_differs_note(version: Optional[str] = None) -> Optional[str]:
    """One line when the running torch isn't one the outputs were checked on (a local tag such as +cpu doesn't
    count); else None."""
    version = installed_torch() if version is None else version
    if version is None or version.split("+")[0] in CHECKED_TORCH:
        return None
    checked = " and ".join(CHECKED_TORCH)
    return (f"{NOTE_START}{version} here; these notebooks were recorded with torch {RECORDED_TORCH} and their "
            f"outputs checked on {checked}: outputs that quote torch's source or its log lines may differ (the "
            "package needs torch>=2.13).")
