"""The budget of unfinished frames a data-plane server's connections share."""

from __future__ import annotations

from collections import Counter


class UnfinishedBudget:
    """Bytes that frames still being received may reserve, shared by a server's connections,
    at most ``per_peer`` of them by one peer.

    A frame's buffer is sized from its prefix; a peer that starts large frames on many
    connections and never finishes them would otherwise hold ``max_frame_bytes`` per
    connection, and with a single shared budget one peer could still take all of it and starve
    every other. A frame that does not fit what is left (in all, or of its peer's share) fails
    its connection with a FrameError.
    """

    def __init__(self, limit: int, per_peer: int | None = None) -> None:
        """``per_peer``: the most one peer may reserve (None: ``limit``)."""
        self.limit = limit
        self.per_peer = limit if per_peer is None else min(per_peer, limit)
        self.used = 0
        self._by_peer: Counter[str] = Counter()

    def take(self, nbytes: int, peer: str = "") -> bool:
        """Reserve ``nbytes`` for ``peer``; False (nothing reserved) when they do not fit."""
        return self.reserve(nbytes, peer) is None

    def reserve(self, nbytes: int, peer: str = "") -> str | None:
        """Reserve ``nbytes`` for ``peer`` and return None, or return why they do not fit
        (:meth:`refusal`) and reserve nothing."""
        why = self.refusal(nbytes, peer)
        if why is None:
            self.used += nbytes
            self._by_peer[peer] += nbytes
        return why

    def refusal(self, nbytes: int, peer: str = "") -> str | None:
        """Why ``nbytes`` for ``peer`` would not fit now, or None when they would."""
        if self.used + nbytes > self.limit:
            return f"the {self.limit}-byte budget of unfinished frames ({self.used} in use)"
        if self._by_peer[peer] + nbytes > self.per_peer:
            return (
                f"one peer's {self.per_peer}-byte share of the budget of unfinished frames "
                f"({self._by_peer[peer]} in use by {peer or 'this peer'})"
            )
        return None

    def give(self, nbytes: int, peer: str = "") -> None:
        """Release a reservation of ``peer``."""
        self.used -= nbytes
        self._by_peer[peer] -= nbytes
        if self._by_peer[peer] <= 0:
            del self._by_peer[peer]

    def held_by(self, peer: str) -> int:
        """Bytes ``peer`` has reserved now."""
        return self._by_peer[peer]
