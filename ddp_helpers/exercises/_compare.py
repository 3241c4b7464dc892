"""Comparisons the checks make in the parent: rounded text for small arrays, equality up to float32 rounding."""
from __future__ import annotations

from typing import Any

import numpy as np


def fmt(a: Any) -> str:
    """Short, rounded, deterministic text for a small array."""
    arr = np.asarray(a, dtype=np.float64).ravel()
    return "[" + ", ".join(f"{x:.4g}" for x in arr[:6]) + (", ..." if arr.size > 6 else "") + "]"


def close(a: Any, b: Any, rtol: float = 1e-5, atol: float = 1e-7) -> bool:
    """Same shape and element-wise equal up to float32 rounding."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return a.shape == b.shape and bool(np.allclose(a, b, rtol=rtol, atol=atol))


def rel_close(a: Any, b: Any, tol: float = 2e-3) -> bool:
    """Equal up to float32 rounding amplified by a subtraction: relative error of the whole vector."""
    a, b = np.asarray(a, dtype=np.float64).ravel(), np.asarray(b, dtype=np.float64).ravel()
    if a.shape != b.shape:
        return False
    scale = max(np.linalg.norm(b), 1e-12)
    return bool(np.linalg.norm(a - b) / scale < tol)
