"""Held-out and client data files: ``x``/``y`` NumPy ``.npz`` archives, never pickled."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from hostkit.files import write_atomic


def save_arrays(path: Path, x: np.ndarray, y: np.ndarray) -> None:
    """Write an ``x``/``y`` ``.npz`` (no pickled objects)."""
    buf = io.BytesIO()
    np.savez(buf, x=x, y=y)
    write_atomic(path, buf.getvalue())


def load_arrays(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Read an ``x``/``y`` ``.npz`` written by :func:`save_arrays` (pickle refused)."""
    with np.load(path, allow_pickle=False) as data:
        return data["x"], data["y"]
