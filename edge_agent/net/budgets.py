"""What an agent's listeners may hold, derived from its ``--memory``.

Each request and frame was capped, but nothing capped how many there were: 200 concurrent
unauthenticated 1 MiB pairing bodies took a 256 MiB agent to 412 MB, and one paired peer took a
1 GiB agent to 603 MB through the fixed 2 x 256 MiB data-plane allowance. So, per listener:

- open connections: at most :func:`connection_caps` in all and per source address (further
  ones are closed before their TLS handshake);
- control-plane bodies being read, over all connections: :func:`control_body_budget`, except
  bodies of coordinator-only routes (deploys, training files: their caller is authenticated and
  their size checked against their own limits); a body that does not fit is answered 503
  before a byte of it is read;
- frames still being received on the data plane: :func:`frame_allowance`, of which one peer
  (by its certificate's name) may hold at most :func:`frame_allowance_per_peer`, so that a
  paired peer that starts large frames and never finishes them cannot starve the others.
"""

from __future__ import annotations

from collections import Counter

MiB = 1 << 20


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def connection_caps(memory_bytes: int) -> tuple[int, int]:
    """(in all, per source address) open connections of one listener: one per 2 MiB of
    ``--memory``, 64 to 512, and half of that per source."""
    total = _clamp(memory_bytes // (2 * MiB), 64, 512)
    return total, total // 2


def control_body_budget(memory_bytes: int) -> int:
    """Bytes of control-plane bodies being read at once: an eighth of ``--memory``, 4 to 64 MiB."""
    return _clamp(memory_bytes // 8, 4 * MiB, 64 * MiB)


def frame_allowance(memory_bytes: int, max_frame_bytes: int) -> int:
    """Bytes of data-plane frames still being received at once: a quarter of ``--memory``, at
    least 16 MiB, at most twice the frame limit."""
    return min(2 * max_frame_bytes, max(16 * MiB, memory_bytes // 4))


def frame_allowance_per_peer(allowance: int) -> int:
    """Bytes of unfinished frames one peer may hold: half of :func:`frame_allowance` (a larger
    frame from one peer is refused; a chain's frames are a few MiB at most)."""
    return allowance // 2


class ConnectionLimits:
    """Open connections of one listener, per source address and in all."""

    def __init__(self, total: int, per_source: int) -> None:
        self.total = total
        self.per_source = per_source
        self._open: Counter[str] = Counter()
        self.refused = 0

    @classmethod
    def for_memory(cls, memory_bytes: int) -> ConnectionLimits:
        """The caps :func:`connection_caps` gives for ``memory_bytes``."""
        return cls(*connection_caps(memory_bytes))

    def admit(self, peername: object) -> str | None:
        """The source's key when a connection from ``peername`` may open (count it), or None."""
        source = str(peername[0]) if isinstance(peername, tuple) and peername else "?"
        if self._open.total() >= self.total or self._open[source] >= self.per_source:
            self.refused += 1
            return None
        self._open[source] += 1
        return source

    def release(self, source: str) -> None:
        """A connection from ``source`` closed."""
        self._open[source] -= 1
        if self._open[source] <= 0:
            del self._open[source]

    def open(self) -> int:
        """Connections open now."""
        return self._open.total()
