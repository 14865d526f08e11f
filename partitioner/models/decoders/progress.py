"""Progress reporting for the slow steps of a decoder export.

:class:`Steps` times each step silently; :class:`RichSteps` also shows a spinner while a step
runs (or a bar, for steps whose amount of work is known) and a line when it ends (rich is
imported only when a step starts).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

Advance = Callable[[float], None]
"""Called with the amount of work just done in a :meth:`Steps.bar` step."""


class Steps:
    """Times named steps; ``timings`` maps each finished step to its duration in seconds."""

    def __init__(self) -> None:
        self.timings: dict[str, float] = {}

    @contextmanager
    def step(self, description: str) -> Iterator[None]:
        """Run the body of the ``with`` block as one step called ``description``."""
        with self.bar(description, None):
            yield

    @contextmanager
    def bar(self, description: str, total: float | None) -> Iterator[Advance]:
        """A step of ``total`` units of work (``None``: unknown); the body reports progress
        through the callable it is given."""
        started = time.perf_counter()
        with self._showing(description, total) as advance:
            yield advance
        elapsed = time.perf_counter() - started
        self.timings[description] = elapsed
        self._finished(description, elapsed)

    @contextmanager
    def _showing(self, description: str, total: float | None) -> Iterator[Advance]:
        yield lambda _amount: None

    def _finished(self, description: str, elapsed: float) -> None:
        """Called after a step succeeded."""


class RichSteps(Steps):
    """Shows a spinner (or a progress bar) per step on a rich console, and its time."""

    def __init__(self, console: Any = None) -> None:
        super().__init__()
        if console is None:
            from rich.console import Console

            console = Console(stderr=True)
        self.console = console

    @contextmanager
    def _showing(self, description: str, total: float | None) -> Iterator[Advance]:
        if total is None:
            with self.console.status(f"{description}..."):
                yield lambda _amount: None
            return
        from rich.progress import BarColumn, Progress, TaskProgressColumn, TimeRemainingColumn

        columns = (BarColumn(), TaskProgressColumn(), TimeRemainingColumn())
        with Progress(*Progress.get_default_columns()[:1], *columns, console=self.console) as bar:
            task = bar.add_task(description, total=total)
            yield lambda amount: bar.advance(task, amount)

    def _finished(self, description: str, elapsed: float) -> None:
        self.console.print(f"[green]done[/] {description} ({elapsed:.1f} s)")
