"""Byte sizes as people write them."""

from __future__ import annotations

import pytest

from protocols.errors import SchemaError
from protocols.sizes import parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [("4096", 4096), ("64MiB", 64 << 20), ("1.5GB", 1_500_000_000), (" 2 kib ", 2048)],
)
def test_units(text: str, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "-5MiB", "1 PB", "1e3"])
def test_bad_sizes_are_schema_errors(text: str) -> None:
    with pytest.raises(SchemaError):
        parse_size(text)
