"""Lazy exports: a package's public names imported from their modules on first use, not at import time."""
from __future__ import annotations

import importlib
from typing import Any, Callable, Dict, Optional, Tuple

from .torch_state import TorchImportBroken, broken_message, half_imported


def lazy_exports(package: str, exports: Dict[str, str], namespace: Dict[str, Any],
                 base: Optional[str] = None) -> Tuple[Callable[[str], Any], Callable[[], list]]:
    """The module-level `__getattr__` and `__dir__` of `package`, whose names live in the modules `exports` maps
    them to (relative to `base`, by default `package`; "module:name" exports that module's `name` under another
    name); a name once imported is kept in `namespace`, the package's globals()."""

    def __getattr__(name: str) -> Any:
        if name in exports:
            broken = half_imported()  # read before the import below changes sys.modules
            try:
                module_name, _, attribute = exports[name].partition(":")
                module = importlib.import_module(f".{module_name}", base or package)
            except Exception as e:  # noqa: BLE001 - what a second import of a half-imported torch raises varies
                if broken:
                    raise TorchImportBroken(broken_message(e)) from None
                raise
            value = getattr(module, attribute or name)
            namespace[name] = value  # later lookups find it without calling __getattr__
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list:
        return sorted(set(namespace) | set(exports))

    return __getattr__, __dir__
