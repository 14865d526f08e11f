"""Revocation reaches a running SuperLink: a revoked device's SuperNode is unregistered.

A SuperLink with node authentication admits the node keys registered when it started (the
paired agents' keys, :func:`coordinator.training.runner.paired_superlink`). Revoking a device
during a run removed it from the pairing book but left its key on the SuperLink, so its
SuperNode kept taking part. :class:`RevokedNodes` watches the book while the SuperLink runs
and unregisters (``flwr supernode unregister``) the node of every device whose key left it
(revoked, or paired again with another key); Flower then refuses that SuperNode's messages,
and the run goes on with the others or, when too few are left for a round, fails with
Flower's reason.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

log = logging.getLogger(__name__)
CHECK_S = 1.0


class RevokedNodes:
    """Registered SuperNodes by device, unregistered once their key leaves the book."""

    def __init__(
        self,
        registered: Mapping[str, tuple[str, int]],
        current: Callable[[], Mapping[str, str]],
        unregister: Callable[[int], None],
    ) -> None:
        """``registered``: device name -> (its node key, its node id on the SuperLink);
        ``current()``: the pairing book's node keys now; ``unregister(node_id)``."""
        self._registered = dict(registered)
        self._current = current
        self._unregister = unregister

    def check(self) -> list[str]:
        """Unregister the nodes of devices whose key is no longer in the book; their names."""
        keys = self._current()
        gone = sorted(n for n, (key, _) in self._registered.items() if keys.get(n) != key)
        for name in gone:
            _, node_id = self._registered[name]
            self._unregister(node_id)
            del self._registered[name]
            log.warning("unregistered the SuperNode of %s (node %d): not paired now", name, node_id)
        return gone


@contextmanager
def unregistering_revoked(nodes: RevokedNodes, interval_s: float = CHECK_S) -> Iterator[None]:
    """Check ``nodes`` every ``interval_s`` in a thread while the block runs (a failed check is
    logged and tried again next time: the SuperLink may be busy)."""
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(interval_s):
            try:
                nodes.check()
            except Exception:  # the watcher must outlive one failed unregister
                log.exception("could not unregister a revoked SuperNode")

    thread = threading.Thread(target=watch, name="revoked-nodes", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(30.0)
