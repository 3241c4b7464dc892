"""The torch the committed notebooks were executed with, and a one-line note when another one runs (stdlib only)."""
from __future__ import annotations

from typing import Optional

RECORDED_TORCH = "2.14.1"  # requirements-recorded.txt's torch pin (tests/project/test_packaging.py keeps them equal)


def installed_torch() -> Optional[str]:
    """The installed torch's version from its metadata, without importing torch (warm_up runs before it loads)."""
    from importlib import metadata  # here, not at the top: it loads email, zipfile and csv, for warm_up() only

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def torch_differs_note(version: Optional[str] = None) -> Optional[str]:
    """One line when the running torch isn't the recorded one (a local tag such as +cpu doesn't count); else None."""
    version = installed_torch() if version is None else version
    if version is None or version.split("+")[0] == RECORDED_TORCH:
        return None
    return (f"[ddp_helpers] torch {version} here; these notebooks were recorded with torch {RECORDED_TORCH}: "
            "outputs that quote torch's source or its log lines may differ (the package needs torch>=2.13).")
