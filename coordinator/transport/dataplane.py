"""The coordinator's data-plane client: requests into a chain, results matched by request id.

The coordinator never imports the agent, so this is its own small client of the frame protocol
(:mod:`protocols.frames`, topology in :mod:`protocols.deploy`). One event loop runs in a
dedicated thread (:class:`DataPlane`); each :class:`ChainClient` holds one TLS 1.3 connection
to the first agent of a deployed chain (client certificate from the CA, the peer's device name
checked) and, for a longer chain, one to the last agent, which returns the answers; any number
of requests are in flight at once, matched by ``request_id`` whichever connection answers.
Blocking callers use :meth:`ChainClient.infer`; coroutines await
:meth:`ChainClient.infer_async`.

One loop thread (not a reader thread per socket) because an ``SSLSocket`` must not be read and
written from two threads at once.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import ssl
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from coordinator.config import Timeouts
from coordinator.errors import (
    AgentError,
    NotServableError,
)
from coordinator.transport.tls import check_peer
from coordinator.transport.wire_errors import remote_error
from protocols.deploy import ROLE_AGENT, Hop
from protocols.errors import FrameError
from protocols.frames import (
    PREFIX_BYTES,
    Frame,
    FrameHeader,
    FrameKind,
    decode_frame,
    encode_frame_parts,
)
from protocols.frames import frame_length as prefix_length

log = logging.getLogger(__name__)

Array = npt.NDArray[Any]
T = TypeVar("T")
MAX_FRAME_BYTES = 1 << 30


class DataPlane:
    """An event loop in its own thread that runs every data-plane connection."""

    def __init__(self, timeouts: Timeouts | None = None) -> None:
        self.connect_s = (timeouts or Timeouts()).connect_s
        """How long opening a connection to an agent may take."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="data-plane", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        """Schedule ``coro`` on the data-plane loop."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Run ``coro`` on the loop and wait for its result (from any other thread)."""
        future = self.submit(coro)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        """Stop the loop and join its thread."""
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)
        self._loop.close()


class FrameConnection:
    """One TLS connection to an agent's data plane; frames in, frames out."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        on_frame: Callable[[Frame], None],
        on_close: Callable[[Exception], None],
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._lock = asyncio.Lock()
        self._on_frame = on_frame
        self._on_close = on_close
        self._task = asyncio.create_task(self._read_loop(), name="frame-reader")

    @classmethod
    async def open(
        cls,
        hop: Hop,
        ctx: ssl.SSLContext,
        on_frame: Callable[[Frame], None],
        on_close: Callable[[Exception], None],
        timeout: float | None = None,
    ) -> FrameConnection:
        """Connect to ``hop`` (within ``timeout``; None: the configured default) and check that
        its certificate names that device."""
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(hop.host, hop.data_port, ssl=ctx, limit=1 << 20),
                Timeouts().connect_s if timeout is None else timeout,
            )
        except (OSError, ssl.SSLError, TimeoutError) as exc:
            raise AgentError(f"cannot reach the data plane of {hop.device}: {exc}") from exc
        try:
            check_peer(writer.get_extra_info("ssl_object"), hop.device, ROLE_AGENT)
        except AgentError:
            writer.transport.abort()
            raise
        return cls(reader, writer, on_frame, on_close)

    @property
    def closed(self) -> bool:
        """Whether the connection has ended."""
        return self._task.done()

    async def send(self, header: FrameHeader, tensors: Mapping[str, Array]) -> None:
        """Write one frame (frames from concurrent senders never interleave)."""
        parts = encode_frame_parts(header, tensors)
        async with self._lock:
            if self._writer.is_closing():
                raise AgentError("the data-plane connection is closed")
            self._writer.writelines(parts)
            try:
                await self._writer.drain()
            except (OSError, ssl.SSLError) as exc:
                raise AgentError(f"sending to the data plane failed: {exc}") from exc

    async def _read_loop(self) -> None:
        error: Exception = AgentError("the agent closed the data-plane connection")
        try:
            while True:
                prefix = await self._reader.readexactly(PREFIX_BYTES)
                total = prefix_length(prefix, MAX_FRAME_BYTES)
                body = await self._reader.readexactly(total - PREFIX_BYTES)
                self._on_frame(decode_frame(prefix + body, MAX_FRAME_BYTES))
        except asyncio.IncompleteReadError:
            pass
        except (OSError, ssl.SSLError, FrameError) as exc:
            error = AgentError(f"the data-plane connection failed: {exc}")
        finally:
            self._writer.transport.abort()
            self._on_close(error)

    async def close(self) -> None:
        """Close the connection and wait for its reader."""
        self._writer.transport.abort()
        await asyncio.gather(self._task, return_exceptions=True)


class ChainClient:
    """Requests into one deployed chain (one plan version); results matched by request id.

    It follows :mod:`protocols.deploy`'s topology: with more than one agent it holds a second
    connection to the last agent, claims each request's answer there before sending the request
    to the first agent, and releases the claim when the answer came from the first agent (a
    refusal) instead.
    """

    def __init__(
        self, plane: DataPlane, chain: Sequence[Hop], plan_version: int, ctx: ssl.SSLContext
    ) -> None:
        if not chain:
            raise ValueError("a chain has at least one agent")
        self._plane = plane
        self._chain = list(chain)
        self._plan_version = plan_version
        self._ctx = ctx
        self._pending: dict[str, asyncio.Future[tuple[Frame, bool]]] = {}
        self._first: FrameConnection | None = None
        self._last: FrameConnection | None = None
        self._connecting = asyncio.Lock()
        self._ids = itertools.count()
        self._prefix = f"c{plan_version}-{id(self):x}-"
        self._aborted: AgentError | None = None

    def infer(self, tensors: Mapping[str, Array], timeout: float) -> dict[str, Array]:
        """Send one request and wait for its named outputs (blocking)."""
        return self._plane.call(self.infer_async(tensors, timeout), timeout + 1.0)

    async def infer_async(
        self, tensors: Mapping[str, Array], timeout: float, session: SessionStep | None = None
    ) -> dict[str, Array]:
        """Send one request and wait for its outputs; runs on the data-plane loop.

        With ``session`` the request is one step (or the end) of a generation session whose
        per-stage state the agents keep.
        """
        first, last = await self._connect()
        request_id = f"{self._prefix}{next(self._ids)}"
        future: asyncio.Future[tuple[Frame, bool]] = asyncio.get_running_loop().create_future()
        if self._aborted is not None:  # checked on the loop, with no await before registering
            raise self._aborted
        self._pending[request_id] = future
        try:
            if last is not None:
                await last.send(self._claim(request_id), {})
            header = FrameHeader(
                request_id=request_id,
                plan_version=self._plan_version,
                **(session.header_fields() if session is not None else {}),
            )
            await first.send(header, tensors)
            frame, from_first = await asyncio.wait_for(future, timeout)
        except TimeoutError as exc:
            raise NotServableError(f"no answer from the chain within {timeout:.0f} s") from exc
        finally:
            self._pending.pop(request_id, None)
        if from_first and last is not None:
            await last.send(self._claim(request_id, FrameKind.RELEASE), {})
        if frame.header.failed:
            raise remote_error(frame.header)
        return {name: np.array(value) for name, value in frame.tensors.items()}

    def _claim(self, request_id: str, kind: FrameKind = FrameKind.DATA) -> FrameHeader:
        return FrameHeader(
            request_id=request_id,
            segment_index=len(self._chain),
            plan_version=self._plan_version,
            kind=kind,
        )

    async def _connect(self) -> tuple[FrameConnection, FrameConnection | None]:
        async with self._connecting:
            if self._aborted is not None:
                raise self._aborted
            if _broken(self._first) or (len(self._chain) > 1 and _broken(self._last)):
                await self._close()
                self._first = await self._open(self._chain[0], from_first=True)
                if len(self._chain) > 1:
                    self._last = await self._open(self._chain[-1], from_first=False)
            assert self._first is not None
            return self._first, self._last

    async def _open(self, hop: Hop, from_first: bool) -> FrameConnection:
        return await FrameConnection.open(
            hop,
            self._ctx,
            lambda frame: self._on_frame(frame, from_first),
            self._on_close,
            self._plane.connect_s,
        )

    def _on_frame(self, frame: Frame, from_first: bool) -> None:
        future = self._pending.get(frame.header.request_id)
        if future is None or future.done():
            log.warning("reply to unknown request %s", frame.header.request_id)
        else:
            future.set_result((frame, from_first))

    def _on_close(self, error: Exception) -> None:
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error)

    def abort(self, reason: str) -> None:
        """Fail every request in flight with ``reason`` and refuse new ones (blocking).

        For a chain that lost a device: requests inside the lost agent would otherwise wait
        for an answer that never comes.
        """
        self._plane.call(self._abort(AgentError(reason)), 15.0)

    async def _abort(self, error: AgentError) -> None:
        self._aborted = error
        self._on_close(error)
        await self._close()

    def close(self) -> None:
        """Close the connections (blocking)."""
        self._plane.call(self._close(), 15.0)

    async def _close(self) -> None:
        for connection in (self._first, self._last):
            if connection is not None:
                await connection.close()
        self._first = self._last = None


def _broken(connection: FrameConnection | None) -> bool:
    return connection is None or connection.closed


@dataclass(frozen=True)
class SessionStep:
    """The session fields of a request (see :class:`protocols.frames.FrameHeader`)."""

    session_id: str
    position: int = 0
    end: bool = False
    rewind: bool = False
    """Cut the session back to ``position`` on every stage before the step."""

    def header_fields(self) -> dict[str, Any]:
        """Keyword arguments for the request's :class:`FrameHeader`."""
        return {
            "session_id": self.session_id,
            "session_position": None if self.end else self.position,
            "session_end": self.end,
            "session_rewind": self.rewind,
        }
