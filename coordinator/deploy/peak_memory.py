"""The peak resident memory of this process over a stretch of work (Linux ``VmHWM``).

:class:`PeakMemory` resets the kernel's high-water mark on entry (``5`` written to
``/proc/self/clear_refs``) and reads ``VmHWM`` from ``/proc/self/status`` on exit, so the peak
is this stretch's, not the process's lifetime one. Where the reset is not allowed it reports
``resource.getrusage``'s lifetime peak, an upper bound, and says so (``reset`` False). File
pages a memory map touched count while they stay mapped, as they do in the kernel's number.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path
from types import TracebackType
from typing import Self

PROC = Path("/proc/self")


class PeakMemory:
    """``with PeakMemory() as peak: ...`` then ``peak.bytes``."""

    def __init__(self) -> None:
        """Not started; enter it."""
        self.bytes = 0
        self.reset = False

    def __enter__(self) -> Self:
        try:
            (PROC / "clear_refs").write_text("5")
            self.reset = True
        except OSError:
            self.reset = False
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.bytes = peak_rss_bytes() if self.reset else lifetime_peak_bytes()

    def current(self) -> int:
        """The peak so far (within the stretch when reset)."""
        return peak_rss_bytes() if self.reset else lifetime_peak_bytes()


def peak_rss_bytes() -> int:
    """``VmHWM`` of this process in bytes (the lifetime peak where /proc is not there)."""
    try:
        for line in (PROC / "status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass  # no /proc: the rusage peak below
    return lifetime_peak_bytes()


def lifetime_peak_bytes() -> int:
    """``ru_maxrss`` of this process in bytes (kilobytes on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024
