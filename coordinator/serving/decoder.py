"""Serving a decoder over the agents: generation steps as data-plane requests.

Each step of a session is one request through the model's chain, carrying only the new tokens
with their attention mask and positions (:mod:`protocols.decoder`); every stage feeds its own
layers' KV cache for that session and keeps the grown one, so only hidden states travel between
agents. The last stage answers with the top-k next-token candidates. Steps of different sessions
are independent requests, so concurrent generations interleave in the pipeline.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from coordinator.config import Timeouts
from coordinator.deploy.store import DeploymentStore, ModelRecord, VersionRecord
from coordinator.errors import (
    AgentError,
    CapacityError,
    ChainBrokenError,
    CoordinatorError,
    NotServableError,
    RequestError,
)
from coordinator.fleet.registry import DeviceRegistry
from coordinator.generation.backend import GenerationModel, TopCandidates
from coordinator.generation.draft_model import DraftModel
from coordinator.generation.feeds import Arrays, step_inputs
from coordinator.generation.speculative import (
    Speculation,
    SpeculationStats,
    Speculative,
    drafter_for,
    trailing_candidates,
)
from coordinator.generation.tokenizer import ChatTokenizer
from coordinator.transport.dataplane import ChainClient, DataPlane, SessionStep
from protocols.decoder import (
    DECODER_FILE,
    TOP_IDS,
    TOP_LOGITS,
    TRAILING_TOP_IDS,
    TRAILING_TOP_LOGITS,
    DecoderInfo,
)
from protocols.errors import ProtocolError
from protocols.manifest import MANIFEST_FILE, Manifest

log = logging.getLogger(__name__)


ClientOf = Callable[[float], tuple[VersionRecord, ChainClient]]
"""The version to step on and its chain client; may wait (until a monotonic deadline) for a
re-plan after a device was lost."""
FailureReport = Callable[[VersionRecord, CoordinatorError], None]


class ChainDecoderBackend:
    """A :class:`~coordinator.generation.backend.DecoderBackend` over one model's chain.

    It remembers every token each session's stages hold. When a step fails because the chain
    broke (an agent lost, a stage that no longer knows the session), it reports the failure,
    takes the version the failover hands out (the same chain, or a re-planned one) and
    *replays*: the whole history, prefilled under a fresh session id, rebuilds every stage's KV
    cache, as Petals does, and the step's answer comes from that. The continuation is the one
    an uninterrupted session would have produced.
    """

    def __init__(
        self,
        plane: DataPlane,
        client_of: ClientOf,
        failed: FailureReport,
        timeouts: Timeouts | None = None,
    ) -> None:
        timeouts = timeouts or Timeouts()
        self._plane = plane
        self._client_of = client_of
        self._failed = failed
        self._timeout = timeouts.step_s
        self._recovery_s = timeouts.recovery_s
        """How long a step may wait, in all, for a broken chain to be re-planned and replayed."""
        self._history: dict[str, list[int]] = {}
        self._wire: dict[str, tuple[str, int]] = {}
        """Per session: the id its stages know it by, and the plan version holding it."""

    async def step(self, session: str, position: int, token_ids: Sequence[int]) -> TopCandidates:
        """One step of ``session`` through the chain; its next-token candidates."""
        return _candidates(await self._advance(session, position, token_ids, rewind=False))

    async def verify(
        self, session: str, position: int, token_ids: Sequence[int]
    ) -> list[TopCandidates]:
        """One speculative pass: ``session`` cut back to ``position`` tokens on every stage,
        then ``token_ids`` appended; the candidates after each of them."""
        out = await self._advance(session, position, token_ids, rewind=True)
        return _trailing(out, len(token_ids))

    async def _advance(
        self, session: str, position: int, token_ids: Sequence[int], rewind: bool
    ) -> Arrays:
        history = self._history.setdefault(session, [])
        if position > len(history) or (position != len(history) and not rewind):
            raise RequestError(f"session {session!r} holds {len(history)} tokens, not {position}")
        del history[position:]
        deadline = time.monotonic() + self._recovery_s
        version, client = await asyncio.to_thread(self._client_of, deadline)
        wire, held_on = self._wire.setdefault(session, (session, version.plan_version))
        if held_on == version.plan_version:
            try:
                out = await self._steps(client, version, wire, position, token_ids, rewind)
            except (AgentError, NotServableError) as exc:
                if isinstance(exc, CapacityError) or (position == 0 and not _lost(exc)):
                    raise
                await asyncio.to_thread(self._failed, version, exc)
                log.warning(
                    "session %s lost its chain (%s); replaying %d tokens",
                    session,
                    exc,
                    position + len(token_ids),
                )
                out = await self._replay(session, [*history, *token_ids], deadline)
        else:
            out = await self._replay(session, [*history, *token_ids], deadline)
        history.extend(token_ids)
        return out

    async def _replay(self, session: str, tokens: list[int], deadline: float) -> Arrays:
        """Prefill ``tokens`` under a fresh id on the version in service now."""
        while True:
            version, client = await asyncio.to_thread(self._client_of, deadline)
            wire = f"{session}~{secrets.token_hex(4)}"
            try:
                out = await self._steps(client, version, wire, 0, tokens, rewind=False)
            except (AgentError, NotServableError) as exc:
                if isinstance(exc, CapacityError) or time.monotonic() > deadline:
                    raise
                await asyncio.to_thread(self._failed, version, exc)
                continue
            self._wire[session] = (wire, version.plan_version)
            return out

    async def _steps(
        self,
        client: ChainClient,
        version: VersionRecord,
        wire: str,
        position: int,
        token_ids: Sequence[int],
        rewind: bool,
    ) -> Arrays:
        """Append ``token_ids`` at ``position`` in steps of at most the planned tokens per step
        (chunked prefill: every stage's workspace stays at the planned shapes); the last
        step's outputs."""
        chunk = prefill_chunk(version)
        out: Arrays = {}
        for start in range(0, len(token_ids), chunk):
            at = position + start
            step = SessionStep(wire, at, rewind=rewind and start == 0)
            out = await self._call(client, step_inputs(at, token_ids[start : start + chunk]), step)
        return out

    async def end(self, session: str) -> None:
        """Free ``session``'s cache on every stage that holds it."""
        self._history.pop(session, None)
        wire, held_on = self._wire.pop(session, (session, 0))
        try:
            version, client = await asyncio.to_thread(self._client_of, time.monotonic())
            if version.plan_version == held_on:
                await self._call(client, {}, SessionStep(wire, end=True))
        except CoordinatorError as exc:  # its stages drop it when it times out
            log.info("could not end session %s: %s", session, exc)

    async def _call(self, client: ChainClient, tensors: Arrays, session: SessionStep) -> Arrays:
        future = self._plane.submit(client.infer_async(tensors, self._timeout, session))
        return await asyncio.wrap_future(future)


def prefill_chunk(version: VersionRecord) -> int:
    """The most new tokens one step of ``version`` may carry (its planned ``sequence``)."""
    limits = version.limits
    if limits is None:
        return 1 << 30
    return max(1, min(limits.dims.get("sequence", 1 << 30), limits.product or 1 << 30))


def _lost(error: CoordinatorError) -> bool:
    """Whether a failure means the chain (not the request) is broken."""
    return isinstance(error, (AgentError, ChainBrokenError))


def _candidates(out: Arrays) -> TopCandidates:
    if TOP_LOGITS not in out or TOP_IDS not in out:
        raise NotServableError(f"the chain answered without {TOP_LOGITS}/{TOP_IDS}")
    return TopCandidates.of(out[TOP_LOGITS], out[TOP_IDS])


def _trailing(out: Arrays, count: int) -> list[TopCandidates]:
    if TRAILING_TOP_LOGITS not in out or TRAILING_TOP_IDS not in out:
        raise NotServableError(
            f"the chain answered without {TRAILING_TOP_LOGITS}/{TRAILING_TOP_IDS}"
        )
    try:
        return trailing_candidates(out[TRAILING_TOP_LOGITS], out[TRAILING_TOP_IDS], count)
    except ValueError as exc:
        raise NotServableError(f"the chain's trailing candidates do not fit: {exc}") from exc


class DecoderModels:
    """The generation API's model lookup: deployed models whose directory holds a
    ``decoder.json`` (what ``fedshard export`` writes for a decoder) and a tokenizer.

    ``client_of`` gives the version to use and its chain client (see :data:`ClientOf`),
    ``failed`` hears of broken chains, ``planned_context`` gives the context length a version's
    stages reserved KV memory for (None when unknown), ``rows_exact`` whether every device of a
    version computes a 4-bit product's row alike alone and in a pass (an int4 decoder
    speculates only then), ``draft_threads`` the intra-op threads of a draft model's calls,
    ``timeouts`` its backends' step and recovery waits. One backend per model keeps its
    sessions' histories.
    """

    def __init__(
        self,
        store: DeploymentStore,
        plane: DataPlane,
        client_of: Callable[[str, float], tuple[VersionRecord, ChainClient]],
        failed: FailureReport,
        planned_context: Callable[[VersionRecord], int | None] = lambda _: None,
        rows_exact: Callable[[VersionRecord], bool] = lambda _: True,
        draft_threads: int = 1,
        timeouts: Timeouts | None = None,
    ) -> None:
        self._store = store
        self._draft_threads = draft_threads
        self._timeouts = timeouts
        self._rows_exact = rows_exact
        self._plane = plane
        self._client_of = client_of
        self._failed = failed
        self._backends: dict[str, ChainDecoderBackend] = {}
        self.speculation_stats: dict[str, SpeculationStats] = {}
        """Per model id: how its speculative passes fared (the console shows them)."""
        self._planned_context = planned_context
        self._loaded: dict[tuple[str, str], tuple[ChatTokenizer, DecoderInfo]] = {}
        self._drafts: dict[tuple[str, str], DraftModel | None] = {}
        self._lock = threading.Lock()

    def __call__(self, model_id: str) -> GenerationModel | None:
        """The generation model for ``model_id``, or None if it is not a deployed decoder."""
        try:
            record = self._store.model(model_id)
            version = self._store.active(model_id)
        except CoordinatorError:
            return None
        if version.kind != "decoder" or record.tokenizer_dir is None:
            return None
        loaded = self._load(model_id, Path(record.tokenizer_dir))
        if loaded is None:
            return None
        tokenizer, info = loaded
        planned = self._planned_context(version)
        if planned is not None and planned < info.max_context:
            info = info.model_copy(update={"max_context": planned})
        backend = self._backends.get(model_id)
        if backend is None:
            backend = self._backends[model_id] = ChainDecoderBackend(
                self._plane,
                lambda deadline: self._client_of(model_id, deadline),
                self._failed,
                self._timeouts,
            )
        return GenerationModel(
            backend=backend,
            tokenizer=tokenizer,
            info=info,
            speculation=self._speculation(model_id, record, info, self._rows_exact(version)),
        )

    def _speculation(
        self, model_id: str, record: ModelRecord, info: DecoderInfo, rows_exact: bool
    ) -> Speculation | None:
        draft = self._draft(record) if record.speculative in ("draft", "auto") else None
        if not_in_effect(record.speculative, info, draft is None, rows_exact) is not None:
            return None
        drafters = drafter_for(record.speculative, draft)
        if drafters is None:
            return None
        stats = self.speculation_stats.setdefault(model_id, SpeculationStats())
        return Speculation(drafters, info.trailing_positions or 1, stats)

    def speculation_off(self, model_id: str) -> str | None:
        """Why ``model_id``'s speculative decoding setting is not in effect, in words (None:
        it is, or the setting is off, or no decoder is deployed under that id)."""
        try:
            record = self._store.model(model_id)
            version = self._store.active(model_id)
        except CoordinatorError:
            return None
        if record.speculative == "off" or record.tokenizer_dir is None:
            return None
        loaded = self._load(model_id, Path(record.tokenizer_dir))
        if loaded is None:
            return None
        draft = self._draft(record) if record.speculative == "draft" else None
        return not_in_effect(
            record.speculative, loaded[1], draft is None, self._rows_exact(version)
        )

    def _draft(self, record: ModelRecord) -> DraftModel | None:
        """The record's draft model, loaded once (None: none set, or it failed to load)."""
        if record.draft_model is None or record.tokenizer_dir is None:
            return None
        key = (record.draft_model, record.tokenizer_dir)
        with self._lock:
            if key not in self._drafts:
                try:
                    self._drafts[key] = DraftModel(Path(key[0]), Path(key[1]), self._draft_threads)
                except Exception:  # serve without it rather than not at all
                    log.exception("cannot load the draft model %s", key[0])
                    self._drafts[key] = None
            return self._drafts[key]

    def _load(self, model_id: str, directory: Path) -> tuple[ChatTokenizer, DecoderInfo] | None:
        key = (model_id, str(directory))
        with self._lock:
            if key not in self._loaded:
                path = directory / DECODER_FILE
                if not path.is_file():
                    return None
                info = DecoderInfo.from_json(path.read_bytes())
                self._loaded[key] = (ChatTokenizer.from_file(directory, info), info)
            return self._loaded[key]


def not_in_effect(
    setting: Speculative, info: DecoderInfo, no_draft: bool, rows_exact: bool = True
) -> str | None:
    """Why speculative decoding ``setting`` cannot run on a decoder described by ``info``
    (``no_draft``: its draft model is not loaded; ``rows_exact``: every device of its chain
    computes a 4-bit product's row alike alone and in a pass), in words; None when it can or
    is off.

    Greedy text is the same with speculation as without only where a pass of several tokens
    decodes each as a one-token step does, bit for bit: so a graph runs speculatively only if
    its export probed that (``rows_probed``) and found it so (``rows_independent``). int8 and
    int4 exports were probed before the probe's verdict was recorded, so theirs is trusted
    without ``rows_probed``; float graphs made before then were never probed.
    """
    if setting == "off":
        return None
    if not info.rows_independent:
        return (
            "rows not independent: its graph decodes a token differently in a pass of several "
            "(probed at export), so it decodes a token a pass"
        )
    if not info.rows_probed and info.weights not in ("int8", "int4"):
        return (
            "rows not checked: its graph was made without the probe that a pass of several "
            "tokens decodes as one-token steps (export it again), so it decodes a token a pass"
        )
    if info.weights == "int4" and not rows_exact:
        return (
            "an agent of its chain computes 4-bit products of one token differently from a pass "
            "of several (its CPU's kernel), so it decodes a token a pass"
        )
    if (info.trailing_positions or 1) < 2:
        return "its graph gives candidates for one position a pass"
    if setting == "draft" and no_draft:
        return "its draft model could not be loaded"
    return None


def planned_context(
    segment_dir: Callable[[str, int], Path],
) -> Callable[[VersionRecord], int | None]:
    """Reads a version's planned context length from the manifest in its segment directory."""

    def read(version: VersionRecord) -> int | None:
        path = segment_dir(version.model_id, version.plan_version) / MANIFEST_FILE
        try:
            manifest = Manifest.from_json(path.read_bytes())
        except (OSError, ProtocolError):
            return None
        return manifest.sessions.max_context if manifest.sessions is not None else None

    return read


def rows_exact_on(registry: DeviceRegistry) -> Callable[[VersionRecord], bool]:
    """Whether every device of a version announces that it computes a 4-bit product's row
    alike alone and in a pass (``int4_rows_exact``); a device that does not say so, or is not
    known, counts as not, so an int4 decoder then decodes a token a pass."""

    def exact(version: VersionRecord) -> bool:
        profiles = {d.name: d.announcement.profile for d in registry.devices(online_only=False)}
        return all(
            (profile := profiles.get(p.device)) is not None and profile.int4_rows_exact is True
            for p in version.segments
        )

    return exact
