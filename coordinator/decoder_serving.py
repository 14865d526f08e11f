"""Serving a decoder over the agents: generation steps as data-plane requests.

Each step of a session is one request through the model's chain, carrying only the new tokens
with their attention mask and positions (:mod:`protocols.decoder`); every stage feeds its own
layers' KV cache for that session and keeps the grown one, so only hidden states travel between
agents. The last stage answers with the top-k next-token candidates. Steps of different sessions
are independent requests, so concurrent generations interleave in the pipeline.

The deployer's health check of a decoder is a one-shot prefill (no session): the sample prompt
from an empty cache, compared with the same prefill run here.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from coordinator.dataplane import ChainClient, DataPlane, SessionStep
from coordinator.deployments import DeploymentStore, VersionRecord
from coordinator.errors import CoordinatorError, NotServableError, RequestError
from coordinator.generation.backend import GenerationModel, TopCandidates
from coordinator.generation.tokenizer import ChatTokenizer
from protocols.decoder import (
    ATTENTION_MASK,
    DECODER_FILE,
    INPUT_IDS,
    POSITION_IDS,
    TOP_IDS,
    TOP_LOGITS,
    DecoderInfo,
)
from protocols.errors import ProtocolError
from protocols.manifest import Manifest

Arrays = dict[str, np.ndarray[Any, Any]]
STEP_TIMEOUT_S = 60.0


def step_inputs(position: int, token_ids: Sequence[int]) -> Arrays:
    """The frame tensors of one step: ``token_ids`` appended after ``position`` tokens."""
    if not token_ids:
        raise RequestError("a generation step needs at least one token")
    count = len(token_ids)
    return {
        INPUT_IDS: np.asarray(token_ids, dtype=np.int64).reshape(1, count),
        ATTENTION_MASK: np.ones((1, position + count), dtype=np.int64),
        POSITION_IDS: np.arange(position, position + count, dtype=np.int64).reshape(1, count),
    }


def state_names(manifest: Manifest) -> set[str]:
    """Every per-session state input and output of a split model."""
    return {n for s in manifest.segments for p in s.state for n in (p.past, p.present)}


def health_feeds(manifest: Manifest, samples: Mapping[str, Any]) -> tuple[Arrays, Arrays]:
    """For a decoder: the one-shot prefill sent through the chain, and the same prefill with
    empty caches for a local run (which gives the expected answer)."""
    prompt = np.asarray(samples[INPUT_IDS], dtype=np.int64).reshape(-1)
    wire = step_inputs(0, prompt.tolist())
    local = dict(wire)
    pasts = {p.past: p.axis for s in manifest.segments for p in s.state}
    for info in manifest.model.inputs:
        if info.name in pasts:
            shape = [
                0 if k == pasts[info.name] else (d if isinstance(d, int) and d > 0 else 1)
                for k, d in enumerate(info.shape)
            ]
            local[info.name] = np.zeros(shape, dtype=np.dtype(info.dtype))
    return wire, local


class ChainDecoderBackend:
    """A :class:`~coordinator.generation.backend.DecoderBackend` over one deployed chain.

    ``client`` returns the chain client of the model's live version (looked up per step, so a
    new version takes over between sessions' steps); calls run on the data-plane loop.
    """

    def __init__(
        self, plane: DataPlane, client: Callable[[], ChainClient], timeout: float = STEP_TIMEOUT_S
    ) -> None:
        self._plane = plane
        self._client = client
        self._timeout = timeout

    async def step(self, session: str, position: int, token_ids: Sequence[int]) -> TopCandidates:
        """One step of ``session`` through the chain; its next-token candidates."""
        tensors = step_inputs(position, token_ids)
        out = await self._call(tensors, SessionStep(session, position))
        if TOP_LOGITS not in out or TOP_IDS not in out:
            raise NotServableError(f"the chain answered without {TOP_LOGITS}/{TOP_IDS}")
        return TopCandidates.of(out[TOP_LOGITS], out[TOP_IDS])

    async def end(self, session: str) -> None:
        """Free ``session``'s cache on every stage."""
        await self._call({}, SessionStep(session, end=True))

    async def _call(self, tensors: Arrays, session: SessionStep) -> Arrays:
        client = self._client()
        future = self._plane.submit(client.infer_async(tensors, self._timeout, session))
        return await asyncio.wrap_future(future)


class DecoderModels:
    """The generation API's model lookup: deployed models whose directory holds a
    ``decoder.json`` (what ``fedshard export`` writes for a decoder) and a tokenizer.

    ``client_of`` gives the chain client of a model's live version; ``planned_context`` the
    context length the live version's stages reserved KV memory for (None when unknown).
    """

    def __init__(
        self,
        store: DeploymentStore,
        plane: DataPlane,
        client_of: Callable[[str], ChainClient],
        planned_context: Callable[[VersionRecord], int | None] = lambda _: None,
    ) -> None:
        self._store = store
        self._plane = plane
        self._client_of = client_of
        self._planned_context = planned_context
        self._loaded: dict[tuple[str, str], tuple[ChatTokenizer, DecoderInfo]] = {}
        self._lock = threading.Lock()

    def __call__(self, model_id: str) -> GenerationModel | None:
        """The generation model for ``model_id``, or None if it is not a deployed decoder."""
        try:
            record = self._store.model(model_id)
            version = self._store.active(model_id)
        except CoordinatorError:
            return None
        if record.tokenizer_dir is None:
            return None
        loaded = self._load(model_id, Path(record.tokenizer_dir))
        if loaded is None:
            return None
        tokenizer, info = loaded
        planned = self._planned_context(version)
        if planned is not None and planned < info.max_context:
            info = info.model_copy(update={"max_context": planned})
        backend = ChainDecoderBackend(self._plane, lambda: self._client_of(model_id))
        return GenerationModel(backend=backend, tokenizer=tokenizer, info=info)

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


def planned_context(
    segment_dir: Callable[[str, int], Path],
) -> Callable[[VersionRecord], int | None]:
    """Reads a version's planned context length from the manifest in its segment directory."""

    def read(version: VersionRecord) -> int | None:
        path = segment_dir(version.model_id, version.plan_version) / "manifest.json"
        try:
            manifest = Manifest.from_json(path.read_bytes())
        except (OSError, ProtocolError):
            return None
        return manifest.sessions.max_context if manifest.sessions is not None else None

    return read
