"""A stage's compute: one request, one step of a session, or a batch of queued requests.

The pipeline (:mod:`edge_agent.serve.pipeline`) queues :class:`Work`; :func:`take_batch` takes the
next request with the queued ones that may share its ONNX Runtime call (see
:mod:`edge_agent.runtime.batching`), and :class:`StageRunner` runs them on the stage's single
compute thread, feeding and keeping each session's state (see :mod:`edge_agent.runtime.sessions`).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from edge_agent.errors import RequestError
from edge_agent.net.channel import FrameChannel
from edge_agent.runtime.batching import MAX_BATCH, signature, split, stack
from edge_agent.runtime.checks import Array
from edge_agent.runtime.segments import Deployed
from edge_agent.runtime.sessions import SessionTable, session_key
from edge_agent.serve.metrics import AgentMetrics
from protocols.frames import FrameHeader


@dataclass
class Work:
    """A checked request waiting for compute."""

    deployed: Deployed
    header: FrameHeader
    feeds: dict[str, Array]
    carried: dict[str, Array]
    enqueued: float
    origin: FrameChannel | None
    """The requester's connection, on the first stage."""
    dims: dict[str, int] = field(default_factory=dict)
    """The sizes of its symbolic dimensions (checked against the planned shapes)."""

    @property
    def batchable(self) -> bool:
        """Whether it may share a call with other queued requests."""
        return self.deployed.batchable and not self.header.session_end


async def take_batch(queue: asyncio.Queue[Work], held: deque[Work]) -> list[Work]:
    """The next request, with the queued ones that can run in the same call; a queued request
    that cannot is kept in ``held`` and comes first next time."""
    first = held.popleft() if held else await queue.get()
    batch = [first]
    if not first.batchable:
        return batch
    shape = signature(first.feeds)
    rows = dict(first.dims)
    while len(batch) < MAX_BATCH:
        try:
            following = queue.get_nowait()
        except asyncio.QueueEmpty:
            break
        joined = _joined(first, rows, following)
        if following.batchable and signature(following.feeds) == shape and joined is not None:
            batch.append(following)
            rows = joined
        else:
            held.append(following)
            break
    return batch


def _joined(first: Work, rows: dict[str, int], following: Work) -> dict[str, int] | None:
    """The symbol sizes of the batch with ``following`` stacked on, if that fits the planned
    shapes (a batch of planned-size requests would otherwise run past the planned workspace)."""
    deployed = first.deployed
    if following.deployed is not deployed:
        return None
    axis = deployed.batch_symbol
    if axis is None:
        return dict(rows)
    joined = {**rows, axis: rows.get(axis, 0) + following.dims.get(axis, 0)}
    limits = deployed.manifest.limits
    if limits is not None and limits.violation(joined) is not None:
        return None
    return joined


class StageRunner:
    """Runs work on one compute thread (ONNX Runtime releases the GIL while it runs)."""

    def __init__(self, metrics: AgentMetrics) -> None:
        self._metrics = metrics
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="segment")

    async def run(self, batch: Sequence[Work]) -> list[dict[str, Array]]:
        """Outputs per request of ``batch`` (one request, or several batchable ones)."""
        if len(batch) == 1:
            return [await self._run_one(batch[0])]
        feeds, sizes = stack([work.feeds for work in batch])
        self._metrics.batch_size.observe(len(batch))
        outputs = await self._call(batch[0].deployed, feeds)
        return split(outputs, sizes)

    def shutdown(self) -> None:
        """Release the compute thread (after the current run)."""
        self._executor.shutdown(wait=True)

    async def _call(self, deployed: Deployed, feeds: dict[str, Array]) -> dict[str, Array]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, deployed.session.run, feeds)

    async def _run_one(self, work: Work) -> dict[str, Array]:
        """Run one request's segment; for a stateful segment, one step of its session."""
        table, header = work.deployed.sessions, work.header
        if header.session_end:
            if table is not None and header.session_id is not None:
                table.end(session_key(header.request_id, header.session_id))
                self._record_sessions(table)
            return {}
        if table is None:  # a stage of a decoder that holds no layer's cache runs as usual
            return await self._call(work.deployed, work.feeds)
        if header.session_id is None:  # one-shot: a fresh state, kept by nobody
            return await self._call(work.deployed, {**work.feeds, **table.empty_feeds()})
        key = session_key(header.request_id, header.session_id)
        step = table.begin_step(key, header.session_position or 0, header.session_rewind)
        try:
            outputs = await self._call(work.deployed, {**work.feeds, **step.feeds})
            table.end_step(step, outputs)
        except RequestError:
            table.discard(key)
            raise
        finally:
            self._record_sessions(table)
        return outputs

    def _record_sessions(self, table: SessionTable) -> None:
        self._metrics.sessions.set(len(table))
        self._metrics.session_state_bytes.set(table.state_bytes())
