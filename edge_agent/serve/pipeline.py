"""The data plane's request handling: check, queue, compute in a worker thread, send on.

Topology (see :mod:`protocols.deploy`): a chain with a direct return. A requester sends each
request to the first agent and claims its answer on its own connection to the last agent. The
first agent prefixes the request id with the requester's verified name (so only that requester
can claim the answer); each agent sends its ``forward`` tensors to the next; the last agent hands
the result to the claiming connection. Errors after a request was accepted travel the same way,
skipping compute; the first agent answers its own refusals, and link failures it sees, on the
requester's connection. Every accepted request gets one answer. Who may send what, the routed
ids and the claims are decided in :mod:`edge_agent.net.routing`; this module does the I/O.

Per agent there are two bounded queues (compute and send) and one compute thread. A full compute
queue stops the connection readers, so TCP pushes back on the previous agent: backpressure.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from edge_agent.errors import AgentError, LinkError, NoSegmentError, PeerRejectedError, RequestError
from edge_agent.net.channel import FrameChannel
from edge_agent.net.links import Link
from edge_agent.net.routing import AnswerDesk, request_id_of, routed_header, routed_id
from edge_agent.net.tls import check_peer
from edge_agent.net.wire_errors import error_header
from edge_agent.runtime.checks import Array, check_planned, check_tensors
from edge_agent.runtime.segments import Deployed, SegmentStore
from edge_agent.runtime.sessions import check_session_fields
from edge_agent.serve.compute import StageRunner, Work, take_batch
from edge_agent.serve.metrics import AgentMetrics
from protocols.deploy import ORIGIN_SEPARATOR, PROBE_PREFIX, ROLE_AGENT, ROLE_COORDINATOR, Hop
from protocols.errors import FrameError
from protocols.frames import FrameHeader, FrameKind

log = logging.getLogger(__name__)

LinkFactory = Callable[[Hop], Link]
PEER_ROLES = frozenset({ROLE_AGENT, ROLE_COORDINATOR})


@dataclass
class _Outgoing:
    deployed: Deployed
    header: FrameHeader
    tensors: Mapping[str, Array]
    origin: FrameChannel | None


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
        self._compute_q: asyncio.Queue[Work] = asyncio.Queue(maxsize=queue_depth)
        self._send_q: asyncio.Queue[_Outgoing] = asyncio.Queue(maxsize=queue_depth)
        self._answers = AnswerDesk()
        self._held: deque[Work] = deque()
        """A request taken from the compute queue that did not fit the batch before it."""
        self._runner = StageRunner(metrics)
        self._links: dict[Hop, Link] = {}
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
        self._runner.shutdown()

    async def serve(self, channel: FrameChannel) -> None:
        """Read frames from one connection until it ends or sends something unreadable."""
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
                    await self._dispatch(channel, frame.header, frame.tensors)
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
            self._answers.drop(channel)
            await channel.close()

    async def _dispatch(
        self,
        channel: FrameChannel,
        header: FrameHeader,
        tensors: Mapping[str, Array],
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
        chain = manifest.chain
        if header.segment_index == len(chain) and manifest.is_last and not manifest.is_first:
            await self._answer_frame(channel, header, chain)
            return
        try:
            admitted = routed_header(channel.peer, header, manifest)
        except RequestError as exc:
            await self._refuse(channel, header, exc)
            return
        origin = channel if manifest.segment.index == 0 else None  # where the requester waits
        await self._accept(deployed, admitted, origin, tensors)

    async def _accept(
        self,
        deployed: Deployed,
        header: FrameHeader,
        origin: FrameChannel | None,
        tensors: Mapping[str, Array],
    ) -> None:
        """Check an admitted request and queue it for compute (or pass its error on)."""
        if header.failed:
            await self._send_q.put(_Outgoing(deployed, header, {}, None))
            return
        problem = check_session_fields(
            deployed.manifest.sessions is not None,
            header.session_id,
            header.session_position,
            header.session_end,
            header.session_rewind,
        )
        if problem is not None:
            await self._fail(deployed, header, RequestError(problem), origin)
            return
        if header.session_end:  # queued behind the session's steps, like any work
            await self._compute_q.put(Work(deployed, header, {}, {}, time.perf_counter(), origin))
            return
        try:
            feeds, carried = check_tensors(deployed.frame_inputs, tensors, deployed.passthrough)
            dims = check_planned(deployed.manifest.limits, deployed.frame_inputs, feeds)
        except RequestError as exc:
            self._count_error(exc)
            await self._fail(deployed, header, exc, origin)
            return
        await self._compute_q.put(
            Work(deployed, header, feeds, carried, time.perf_counter(), origin, dims)
        )
        self._metrics.queue_depth.labels("compute").set(self._compute_q.qsize())

    async def _answer_frame(
        self, channel: FrameChannel, header: FrameHeader, chain: list[Hop]
    ) -> None:
        """On the last stage, a frame for ``len(chain)``: an error report from a chain member
        (routed id), or a requester's claim on an answer (or, ``kind='release'``, its release)."""
        if ORIGIN_SEPARATOR in header.request_id:
            if not header.failed or channel.peer.name not in {h.device for h in chain[:-1]}:
                raise PeerRejectedError(f"{channel.peer.name!r} may not send answers here")
            await self._to_requester(header, {})
            return
        if header.failed:
            raise PeerRejectedError(f"{channel.peer.name!r} may not send errors here")
        key = routed_id(channel.peer, header.request_id)
        if header.kind is FrameKind.RELEASE:  # the requester got its answer elsewhere
            self._answers.release(channel, key)
            return
        try:
            parked = self._answers.claim(channel, key)
        except RequestError as exc:
            await self._refuse(channel, header, exc)
            return
        if parked is not None:  # the answer came before its claim
            await self._write_answer(channel, *parked)

    async def _compute_loop(self) -> None:
        while True:
            idle_from = time.perf_counter()
            batch = await take_batch(self._compute_q, self._held)
            start = time.perf_counter()
            self._metrics.idle_seconds.inc(start - idle_from)
            for work in batch:
                self._metrics.queue_wait_seconds.observe(start - work.enqueued)
            self._metrics.queue_depth.labels("compute").set(self._compute_q.qsize())
            try:
                results = await self._runner.run(batch)
            except RequestError as exc:
                self._count_error(exc)
                for work in batch:
                    await self._fail(work.deployed, work.header, exc, work.origin)
                continue
            elapsed = time.perf_counter() - start
            for work, outputs in zip(batch, results, strict=True):
                self._metrics.compute_seconds.observe(elapsed / len(batch))
                await self._emit(work, outputs)

    async def _emit(self, work: Work, outputs: Mapping[str, Array]) -> None:
        """Queue a computed request's forward tensors for sending."""
        forward = (
            {}
            if work.header.session_end
            else {
                name: outputs[name] if name in outputs else work.carried[name]
                for name in work.deployed.manifest.forward
            }
        )
        await self._send_q.put(_Outgoing(work.deployed, work.header, forward, work.origin))
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
                await self._deliver(out)
            except LinkError as exc:
                self._metrics.requests.labels("link_error").inc()
                log.error("request %s failed: %s", out.header.request_id, exc)
                await self._report_link_failure(out, exc)
                continue
            self._metrics.send_seconds.observe(time.perf_counter() - start)
            self._metrics.requests.labels("error" if out.header.failed else "ok").inc()

    def _link(self, hop: Hop) -> Link:
        link = self._links.get(hop)
        if link is None:
            link = self._links[hop] = self._link_factory(hop)
        return link

    async def _deliver(self, out: _Outgoing) -> None:
        manifest = out.deployed.manifest
        chain, index = manifest.chain, manifest.segment.index
        if manifest.is_last:
            header = out.header.model_copy(update={"segment_index": len(chain), "tensors": []})
            if out.origin is not None:  # a one-stage chain answers on the request's connection
                await self._write_answer(out.origin, header, out.tensors)
            else:
                await self._to_requester(header, out.tensors)
            return
        # tensors=[]: the codec rebuilds the specs from the arrays; this skips dumping the old ones
        header = out.header.model_copy(update={"segment_index": index + 1, "tensors": []})
        self._metrics.bytes_out.inc(await self._link(chain[index + 1]).send(header, out.tensors))

    async def _report_link_failure(self, out: _Outgoing, exc: LinkError) -> None:
        """Tell the requester that the chain is broken: on its connection from the first stage,
        else by an error frame straight to the last agent (which holds the requester's claim).
        When the last agent itself is unreachable, the requester's own connection to it fails."""
        manifest = out.deployed.manifest
        chain = manifest.chain
        error = error_header(out.header, exc, segment_index=len(chain))
        if out.origin is not None:
            await self._write_answer(out.origin, error, {})
            return
        if manifest.segment.index + 2 == len(chain):
            return  # the last agent is the one down; the requester's connection to it fails
        try:
            await self._link(chain[-1]).send(error, {})
        except LinkError as again:
            log.error("cannot tell the last agent about %s either: %s", error.request_id, again)

    async def _to_requester(self, header: FrameHeader, tensors: Mapping[str, Array]) -> None:
        """On the last stage: hand an answer to the connection that claimed it (or park it)."""
        channel = self._answers.take(header, tensors)
        if channel is not None:
            await self._write_answer(channel, header, tensors)

    async def _write_answer(
        self, channel: FrameChannel, header: FrameHeader, tensors: Mapping[str, Array]
    ) -> None:
        reply = header.model_copy(update={"request_id": request_id_of(header.request_id)})
        try:
            self._metrics.bytes_out.inc(await channel.write(reply, tensors))
        except (OSError, ssl.SSLError) as exc:
            log.warning("cannot return %s to %s: %s", header.request_id, channel.peer.name, exc)

    async def _fail(
        self, deployed: Deployed, header: FrameHeader, exc: AgentError, origin: FrameChannel | None
    ) -> None:
        """Answer a failed request: to the requester on the first stage, else onward."""
        error = error_header(header, exc)
        if origin is not None:
            await self._write_answer(origin, error, {})
        else:
            await self._send_q.put(_Outgoing(deployed, error, {}, None))

    async def _refuse(self, channel: FrameChannel, header: FrameHeader, exc: AgentError) -> None:
        self._count_error(exc)
        log.warning("refused %s from %s: %s", header.request_id, channel.peer.name, exc)
        await self._reply_error(channel, header, exc)

    async def _reply_error(
        self, channel: FrameChannel, header: FrameHeader, exc: Exception
    ) -> None:
        plain = FrameHeader(
            request_id=header.request_id,
            segment_index=header.segment_index,
            plan_version=header.plan_version,
        )
        reply = error_header(plain, exc)
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
