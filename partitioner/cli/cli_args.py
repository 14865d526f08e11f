"""What the partitioner's file-level commands share: the bad-input exit code, argument types and
sizes written for people.

Light to import (argparse only), like the commands' modules that register with it.
"""

from __future__ import annotations

import argparse

EXIT_BAD_INPUT = 1
"""Exit code of a command given a model, devices or samples it cannot use."""


def positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"wants a positive integer, got {text!r}")
    return int(text)


def human_size(n: int) -> str:
    """``n`` bytes for people: ``512 B``, ``1.5 KiB``, ... up to GiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:,.0f} {unit}" if unit == "B" else f"{value:,.1f} {unit}"
        value /= 1024
    return f"{value:,.1f} TiB"
