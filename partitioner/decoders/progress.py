"""Progress reporting for the slow steps of a decoder export.

:class:`Steps` times each step silently; :class:`RichSteps` also shows a spinner while a step
runs and a line when it ends (rich is imported only when a step starts).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


class Steps:
    """Times named steps; ``timings`` maps each finished step to its duration in seconds."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}

    @contextmanager
    def step(self, description: str) -> Iterator[None]:
        """Run the body of the ``with`` block as one step called ``description``."""
        started = time.perf_counter()
        with self._showing(description):
            yield
        elapsed = time.perf_counter() - started
        self.timings[description] = elapsed
        self._finished(description, elapsed)

    @contextmanager
    def _showing(self, description: str) -> Iterator[None]:
        yield

    def _finished(self, description: str, elapsed: float) -> None:
        """Called after a step succeeded."""


class RichSteps(Steps):
    """Shows a spinner per step on a rich console, and the time each step took."""

    def __init__(self, console: Any = None) -> None:
        super().__init__()
        if console is None:
            from rich.console import Console

            console = Console(stderr=True)
        self.console = console

    @contextmanager
    def _showing(self, description: str) -> Iterator[None]:
        with self.console.status(f"{description}..."):
            yield

    def _finished(self, description: str, elapsed: float) -> None:
        self.console.print(f"[green]done[/] {description} ({elapsed:.1f} s)")
