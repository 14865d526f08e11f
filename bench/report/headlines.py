"""Headline numbers a benchmark records next to its Markdown: ``bench/results/<name>.json``.

Format (``fedshard.bench-headlines/1``)::

    {"format": "fedshard.bench-headlines/1", "bench": "pipeline",
     "headlines": [{"name": "sharded / whole latency", "value": 1.17, "unit": "x",
                    "target": "<= 1.15", "met": false}, ...]}

``target`` is a comparison (``"<= 1.15"``, ``">= 0.8"``) or null; a bare number means "at
least" (``0.7`` reads as ``">= 0.7"``). ``unit`` is optional; ``met`` is derived from the target.
"""

from __future__ import annotations

import json
import math
import operator
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

FORMAT = "fedshard.bench-headlines/1"
RESULTS = Path(__file__).resolve().parents[1] / "results"
_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    ">=": operator.ge,
    "<": operator.lt,
    ">": operator.gt,
}
_TARGET = re.compile(r"^\s*(<=|>=|<|>)\s*([-+]?[0-9.]+(?:[eE][-+]?[0-9]+)?)\s*$")


class HeadlineError(ValueError):
    """A headline file or target that cannot be read."""


@dataclass(frozen=True)
class Headline:
    """One number worth quoting: a ratio, a rate, an accuracy."""

    name: str
    value: float
    unit: str = ""
    target: str | None = None

    @property
    def met(self) -> bool | None:
        """Whether ``value`` meets ``target`` (None without a target or a value)."""
        if self.target is None or not math.isfinite(self.value):
            return None
        match = _TARGET.match(self.target)
        if match is None:
            raise HeadlineError(f"target {self.target!r}: expected e.g. '<= 1.15'")
        return _OPS[match.group(1)](self.value, float(match.group(2)))

    def to_obj(self) -> dict[str, object]:
        """The JSON object of this headline (``met`` included)."""
        return {**asdict(self), "met": self.met}


def write_headlines(bench: str, headlines: list[Headline], results: Path = RESULTS) -> Path:
    """Write ``results/<bench>.json``; returns its path."""
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{bench}.json"
    doc = {"format": FORMAT, "bench": bench, "headlines": [h.to_obj() for h in headlines]}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def read_headlines(path: Path) -> list[Headline]:
    """The headlines of one ``<bench>.json``."""
    try:
        doc = json.loads(path.read_text())
        items = doc["headlines"]
        return [
            Headline(
                name=str(item["name"]),
                value=float(item["value"]) if item["value"] is not None else math.nan,
                unit=str(item.get("unit") or ""),
                target=_target(item.get("target")),
            )
            for item in items
        ]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise HeadlineError(f"{path}: {exc}") from exc


def _target(raw: object) -> str | None:
    """A target as written, a bare number read as a minimum."""
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, int | float) and not isinstance(raw, bool):
        return f">= {raw:g}"
    raise HeadlineError(f"target {raw!r}: expected a string such as '<= 1.15' or a number")
