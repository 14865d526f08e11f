"""The data plane's request handling: check, queue, compute in a worker thread, send on.

Topology (see :mod:`protocols.deploy`): a ring. Requesters talk to the first agent and keep
their connection; each agent sends its ``forward`` tensors to the next; the last agent sends the
results back to the first, which hands them to the requester's connection by ``request_id``.
Error frames travel the same path, skipping compute, so every accepted request gets one answer.

Per agent there are two bounded queues (compute and send) and one compute thread. A full compute
queue stops the connection readers, so TCP pushes back on the previous agent: backpressure.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from edge_agent.channel import FrameChannel
from edge_agent.checks import Array, check_tensors
from edge_agent.errors import (
    AgentError,
    ExecutionError,
    LinkError,
    NoSegmentError,
    PeerRejectedError,
    RequestError,
)
from edge_agent.links import Link
from edge_agent.metrics import AgentMetrics
from edge_agent.segments import Deployed, SegmentStore
from edge_agent.tls import check_peer
from protocols.deploy import PROBE_PREFIX, ROLE_AGENT, ROLE_COORDINATOR, Hop
from protocols.errors import FrameError
from protocols.frames import FrameHeader

log = logging.getLogger(__name__)

LinkFactory = Callable[[Hop], Link]
PEER_ROLES = frozenset({ROLE_AGENT, ROLE_COORDINATOR})


@dataclass
class _Work:
    deployed: Deployed
    header: FrameHeader
    feeds: dict[str, Array]
    carried: dict[str, Array]
    enqueued: float


@dataclass
class _Outgoing:
    deployed: Deployed
    header: FrameHeader
    tensors: Mapping[str, Array]


class Pipeline:
    """Serves data-plane channels for the segments in a :class:`SegmentStore`."""

    def __init__(
        self,
        store: SegmentStore,
        metrics: AgentMetrics,
        link_factory: LinkFactory,
        queue_depth: int,
    ) -> None:
        self._store = store
        self._metrics = metrics
        self._link_factory = link_factory
        self._compute_q: asyncio.Queue[_Work] = asyncio.Queue(maxsize=queue_depth)
        self._send_q: asyncio.Queue[_Outgoing] = asyncio.Queue(maxsize=queue_depth)
        self._pending: dict[str, FrameChannel] = {}
        self._links: dict[Hop, Link] = {}
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="segment")
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Start the compute and send workers (call from the event loop)."""
        self._tasks = [
            asyncio.create_task(self._compute_loop(), name="compute"),
            asyncio.create_task(self._send_loop(), name="send"),
        ]
        for task in self._tasks:
            task.add_done_callback(_worker_ended)

    async def stop(self) -> None:
        """Stop the workers, close the links, release the compute thread."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for link in self._links.values():
            await link.close()
        self._links.clear()
        self._executor.shutdown(wait=True)

    async def serve(self, channel: FrameChannel) -> None:
        """Read frames from one connection until it ends or sends something unreadable."""
        mine: set[str] = set()
        try:
            check_peer(channel.peer, roles=PEER_ROLES)
            while True:
                try:
                    item = await channel.read()
                except FrameError as exc:
                    self._count_error(exc)
                    log.warning("closing %s: bad frame: %s", channel.peer.name, exc)
                    await self._reply_error(channel, FrameHeader(request_id="unknown"), exc)
                    return
                if item is None:
                    return
                frame, size = item
                self._metrics.bytes_in.inc(size)
                try:
                    await self._dispatch(channel, frame.header, frame.tensors, mine)
                except PeerRejectedError as exc:
                    self._count_error(exc)
                    log.warning("closing %s: %s", channel.peer.name, exc)
                    await self._reply_error(channel, frame.header, exc)
                    return
        except PeerRejectedError as exc:
            self._count_error(exc)
            log.warning("refused data-plane peer: %s", exc)
        except (OSError, ssl.SSLError) as exc:
            log.info("data-plane connection from %s ended: %s", channel.peer.name, exc)
        finally:
            for request_id in mine:
                if self._pending.get(request_id) is channel:
                    del self._pending[request_id]
            await channel.close()

    async def _dispatch(
        self,
        channel: FrameChannel,
        header: FrameHeader,
        tensors: Mapping[str, Array],
        mine: set[str],
    ) -> None:
        if header.request_id.startswith(PROBE_PREFIX):
            self._metrics.bytes_out.inc(
                await channel.write(FrameHeader(request_id=header.request_id), {})
            )
            return
        deployed = self._store.get(header.plan_version)
        if deployed is None:
            await self._refuse(
                channel, header, NoSegmentError(f"no segment for plan {header.plan_version}")
            )
            return
        manifest = deployed.manifest
        index, chain = manifest.segment.index, manifest.chain
        if header.segment_index == len(chain) and manifest.is_first and not manifest.is_last:
            # results come from the last agent; error reports from any agent of the chain
            if header.error:
                if channel.peer.name not in {hop.device for hop in chain[1:]}:
                    raise PeerRejectedError(f"{channel.peer.name!r} is not part of this chain")
            else:
                check_peer(channel.peer, name=chain[-1].device, roles={ROLE_AGENT})
            await self._to_requester(header, tensors)
            return
        if header.segment_index != index:
            await self._refuse(
                channel,
                header,
                NoSegmentError(f"this agent runs segment {index}, not {header.segment_index}"),
            )
            return
        if index > 0:
            check_peer(channel.peer, name=chain[index - 1].device, roles={ROLE_AGENT})
        else:
            if header.error:
                await self._refuse(channel, header, RequestError("requesters may not send errors"))
                return
            if header.request_id in self._pending:
                await self._refuse(channel, header, RequestError("request id already in flight"))
                return
            self._pending[header.request_id] = channel
            mine.add(header.request_id)
        if header.error:
            await self._send_q.put(_Outgoing(deployed, header, {}))
            return
        try:
            feeds, carried = check_tensors(deployed.session.inputs, tensors, deployed.passthrough)
        except RequestError as exc:
            self._count_error(exc)
            await self._fail(deployed, header, exc)
            return
        await self._compute_q.put(_Work(deployed, header, feeds, carried, time.perf_counter()))
        self._metrics.queue_depth.labels("compute").set(self._compute_q.qsize())

    async def _compute_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            idle_from = time.perf_counter()
            work = await self._compute_q.get()
            start = time.perf_counter()
            self._metrics.idle_seconds.inc(start - idle_from)
            self._metrics.queue_wait_seconds.observe(start - work.enqueued)
            self._metrics.queue_depth.labels("compute").set(self._compute_q.qsize())
            try:
                outputs = await loop.run_in_executor(
                    self._executor, work.deployed.session.run, work.feeds
                )
            except ExecutionError as exc:
                self._count_error(exc)
                await self._fail(work.deployed, work.header, exc)
                continue
            self._metrics.compute_seconds.observe(time.perf_counter() - start)
            forward = {
                name: outputs[name] if name in outputs else work.carried[name]
                for name in work.deployed.manifest.forward
            }
            await self._send_q.put(_Outgoing(work.deployed, work.header, forward))
            self._metrics.queue_depth.labels("send").set(self._send_q.qsize())

    async def drop_links(self, devices: frozenset[str]) -> None:
        """Close the outgoing links to these devices (they were revoked)."""
        for hop in [hop for hop in self._links if hop.device in devices]:
            await self._links.pop(hop).close()

    async def _send_loop(self) -> None:
        while True:
            out = await self._send_q.get()
            self._metrics.queue_depth.labels("send").set(self._send_q.qsize())
            start = time.perf_counter()
            try:
                await self._deliver(out.deployed, out.header, out.tensors)
            except LinkError as exc:
                self._metrics.requests.labels("link_error").inc()
                log.error("request %s failed: %s", out.header.request_id, exc)
                await self._report_link_failure(out.deployed, out.header, exc)
                continue
            self._metrics.send_seconds.observe(time.perf_counter() - start)
            self._metrics.requests.labels("error" if out.header.error else "ok").inc()

    async def _deliver(
        self, deployed: Deployed, header: FrameHeader, tensors: Mapping[str, Array]
    ) -> None:
        manifest = deployed.manifest
        chain, index = manifest.chain, manifest.segment.index
        if manifest.is_last and manifest.is_first:
            await self._to_requester(
                header.model_copy(update={"segment_index": len(chain)}), tensors
            )
            return
        nxt = (index + 1) % len(chain)
        target = len(chain) if manifest.is_last else nxt
        link = self._links.get(chain[nxt])
        if link is None:
            link = self._links[chain[nxt]] = self._link_factory(chain[nxt])
        sent = await link.send(header.model_copy(update={"segment_index": target}), tensors)
        self._metrics.bytes_out.inc(sent)

    async def _report_link_failure(
        self, deployed: Deployed, header: FrameHeader, exc: LinkError
    ) -> None:
        """Tell the requester that the chain is broken: directly on the first stage, else by an
        error frame straight to the first agent (which accepts errors from any chain member)."""
        manifest = deployed.manifest
        chain = manifest.chain
        error = header.model_copy(
            update={"error": f"LinkError: {exc}"[:4096], "segment_index": len(chain)}
        )
        if manifest.is_first:
            await self._to_requester(error, {})
            return
        link = self._links.get(chain[0])
        if link is None:
            link = self._links[chain[0]] = self._link_factory(chain[0])
        try:
            await link.send(error, {})
        except LinkError as again:
            log.error("cannot tell the first agent about %s either: %s", header.request_id, again)

    async def _to_requester(self, header: FrameHeader, tensors: Mapping[str, Array]) -> None:
        channel = self._pending.pop(header.request_id, None)
        if channel is None:
            log.warning("result for %s has no requester any more", header.request_id)
            return
        try:
            self._metrics.bytes_out.inc(await channel.write(header, tensors))
        except (OSError, ssl.SSLError) as exc:
            log.warning("cannot return %s to %s: %s", header.request_id, channel.peer.name, exc)

    async def _fail(self, deployed: Deployed, header: FrameHeader, exc: AgentError) -> None:
        """Answer a failed request: straight to the requester on the first stage, else onward."""
        error = header.model_copy(update={"error": f"{type(exc).__name__}: {exc}"[:4096]})
        if deployed.manifest.is_first:
            await self._to_requester(error, {})
        else:
            await self._send_q.put(_Outgoing(deployed, error, {}))

    async def _refuse(self, channel: FrameChannel, header: FrameHeader, exc: AgentError) -> None:
        self._count_error(exc)
        log.warning("refused %s from %s: %s", header.request_id, channel.peer.name, exc)
        await self._reply_error(channel, header, exc)

    async def _reply_error(
        self, channel: FrameChannel, header: FrameHeader, exc: Exception
    ) -> None:
        reply = FrameHeader(
            request_id=header.request_id,
            segment_index=header.segment_index,
            plan_version=header.plan_version,
            error=f"{type(exc).__name__}: {exc}"[:4096],
        )
        try:
            self._metrics.bytes_out.inc(await channel.write(reply, {}))
        except (OSError, ssl.SSLError) as write_exc:
            log.info("could not tell %s about the error: %s", channel.peer.name, write_exc)

    def _count_error(self, exc: Exception) -> None:
        self._metrics.frame_errors.labels(type(exc).__name__).inc()


def _worker_ended(task: asyncio.Task[None]) -> None:
    """A worker loop only ends by cancellation; anything else is a bug that stops the stage."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.critical(
            "the %s worker crashed; this stage no longer serves", task.get_name(), exc_info=exc
        )
