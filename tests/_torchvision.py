"""Whether torchvision loads beside this torch, asked once per test process and only by the tests that need it.

A torchvision may be installed and still fail to import: PyPI's CUDA build beside a CPU torch raises
`RuntimeError: operator torchvision::nms does not exist` (docs/maintainers.md, "The torch floor"). The package
falls back then (data/sources.py); the tests that read data with torchvision, or run examples/ddp_mnist.py, carry
`@pytest.mark.needs_torchvision` and skip with the reason (tests/conftest.py), rather than fail.
"""
from __future__ import annotations

import functools
import importlib.util
from typing import Optional


@functools.lru_cache(maxsize=1)
def torchvision_problem() -> Optional[str]:
    """None when `import torchvision.datasets` works here; else why not (imported at the first call only)."""
    if importlib.util.find_spec("torchvision") is None:
        return "torchvision is not installed"
    try:
        import torchvision.datasets  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or OSError/RuntimeError from its compiled operators
        return f"torchvision is installed but can't be imported with this torch ({type(e).__name__}: {e})"
    return None


def torchvision_loads() -> bool:
    """Can this process import torchvision.datasets?"""
    return torchvision_problem() is None
