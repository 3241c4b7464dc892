"""What to install when a program fails for want of an optional module: the extra that brings it, in one line."""
from __future__ import annotations

import re
from typing import Optional

EXTRAS = {"torchvision": "vision"}  # pyproject.toml's optional-dependencies, by the module each one brings
CPU_INDEX = "https://download.pytorch.org/whl/cpu"  # PyTorch's CPU-only builds (torch X+cpu, torchvision Y+cpu)
# The torchvision run with each torch here (make test-floor, make test, make test-ceiling; README, "Your torch").
PAIRED_TORCHVISION = {"2.13.0": "0.28.0", "2.14.1": "0.29.1", "2.15.0": "0.29.2"}
# A torchvision built for another torch (PyPI's CUDA build beside a CPU-only torch) fails as it loads its operators.
_FOREIGN_BUILD = re.compile(r"operator (\w+)::\w+ does not exist")
_MISSING = re.compile(r"ModuleNotFoundError: No module named '([\w]+)")


def _version(name: str) -> str:
    """An installed distribution's version, or '?'."""
    from importlib import metadata  # here: it loads email, zipfile and csv, only when a program has failed

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "?"


def install_hint(stderr: str, program: str) -> Optional[str]:
    """One line naming what to install, when stderr (a failed program's) says an extra's module is missing or was
    built for another torch; None when it says neither."""
    missing = _MISSING.search(stderr)
    if missing and missing[1] in EXTRAS:
        module = missing[1]
        return (f"{program} needs {module}, which is not installed: install the package's "
                f"{EXTRAS[module]} extra, pip install \".[{EXTRAS[module]}]\" in the ddp-tutorial folder "
                f"(a CPU-only torch: the {module} built for it, README), then restart the kernel")
    foreign = _FOREIGN_BUILD.search(stderr)
    if foreign and foreign[1] in EXTRAS:
        module, torch = foreign[1], _version("torch")
        return (f"{program} needs {module}, and {module} {_version(module)} doesn't load beside torch {torch} "
                f"({foreign[0]}: a build for another torch): install the one built for yours, "
                f"{paired_install(torch)}, then restart the kernel")
    return None


def paired_install(torch: str) -> str:
    """The pip command for the torchvision built for this torch (a CPU-only one from PyTorch's CPU index)."""
    base, _, local = torch.partition("+")
    vision = PAIRED_TORCHVISION.get(base)
    if vision is None:
        return (f"the torchvision released with torch {base} (pytorch.org lists the pairs), from the index your "
                "torch came from")
    if local == "cpu":
        return f"pip install torchvision=={vision}+cpu --index-url {CPU_INDEX}"
    return f"pip install torchvision=={vision}"
