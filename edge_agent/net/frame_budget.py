"""The budget of unfinished frames a data-plane server's connections share."""

from __future__ import annotations


class UnfinishedBudget:
    """Bytes that frames still being received may reserve, shared by a server's connections.

    A frame's buffer is sized from its prefix; a peer that starts large frames on many
    connections and never finishes them would otherwise hold ``max_frame_bytes`` per
    connection. A frame that does not fit what is left fails its connection with a FrameError.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0

    def take(self, nbytes: int) -> bool:
        """Reserve ``nbytes``; False (nothing reserved) when they do not fit."""
        if self.used + nbytes > self.limit:
            return False
        self.used += nbytes
        return True

    def give(self, nbytes: int) -> None:
        """Release a reservation."""
        self.used -= nbytes
