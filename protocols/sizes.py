"""Byte sizes as people write them: ``64MiB``, ``1.5GB``, ``4096``."""

from __future__ import annotations

import re
from typing import Final

from protocols.errors import SchemaError

UNITS: Final = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1 << 10,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1 << 20,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1 << 30,
}


def parse_size(text: str) -> int:
    """Bytes in ``text`` (decimal and binary units, any case); raises SchemaError."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if match is None or match.group(2).lower() not in UNITS:
        raise SchemaError(f"cannot read {text!r} as a size (try 64MiB or 1GB)")
    return int(float(match.group(1)) * UNITS[match.group(2).lower()])
