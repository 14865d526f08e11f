"""Errors raised by the LAN lab (:mod:`devtools.lab`)::

CoordinatorError
└── LabError                 the lab could not be built, used or removed
    ├── LabSpecError         the requested lab is invalid (counts, rates, sizes, names)
    ├── LabUnavailableError  this machine cannot host a lab (not root, no ``ip``/``tc``)
    ├── LabStateError        the lab's state file is missing, unreadable or names a live lab
    ├── LabCommandError      an ``ip`` or ``tc`` command failed (argv, exit code, stderr)
    ├── LabAgentError        an edge agent in the lab died or was not discovered in time
    └── LabTeardownError     removal left something behind (carries every underlying error)
"""

from __future__ import annotations

from collections.abc import Sequence

from coordinator.errors import CoordinatorError


class LabError(CoordinatorError):
    """Base class of every error raised by :mod:`devtools.lab`."""


class LabSpecError(LabError):
    """The requested lab is invalid: host count, bandwidths, latencies, memory sizes or names."""


class LabUnavailableError(LabError):
    """This machine cannot host a lab: not root, or ``ip netns`` / ``tc`` is missing."""


class LabStateError(LabError):
    """The lab's state file is unreadable, or a live lab already uses the state dir."""


class LabCommandError(LabError):
    """An ``ip`` or ``tc`` command failed."""

    def __init__(self, argv: Sequence[str], returncode: int, stderr: str, what: str = "") -> None:
        self.argv = tuple(argv)
        self.returncode = returncode
        self.stderr = stderr.strip()
        self.what = what
        doing = f" ({what})" if what else ""
        super().__init__(
            f"`{' '.join(self.argv)}`{doing} exited with {returncode}: {self.stderr or 'no output'}"
        )


class LabAgentError(LabError):
    """An edge agent in the lab exited, or was not discovered in time."""


class LabTeardownError(LabError):
    """Removing the lab failed somewhere; ``errors`` holds every underlying failure."""

    def __init__(self, errors: Sequence[BaseException]) -> None:
        self.errors = tuple(errors)
        details = "; ".join(str(e) for e in self.errors)
        super().__init__(f"lab teardown incomplete ({len(self.errors)} problem(s)): {details}")
