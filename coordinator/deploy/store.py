"""Deployments and their versions, persisted atomically in ``deployments.json``.

Each model id (``all-minilm-l6-v2``) has versions, numbered by the model alone: 1 for its first
deploy, then 2, 3, ... (every deploy, failover re-plan, expansion and training rollout that goes
live takes the next), shown as ``all-minilm-l6-v2 v3`` by every surface (:func:`version_label`).
One is *active* (requests go there) and the one it replaced stays loaded as *previous*, so a
rollback is a switch, not a redeploy.

Each version also has a *plan version*: the key its segments are loaded under on the agents,
unique across all models (an agent holds at most one segment per plan version). It is a wire
detail: the data plane, the agents' status and the book carry it, users are shown the model's
number. A book written before the per-model numbers (versions without ``version`` or
``kind``, ``active``/``previous`` holding plan versions) is migrated when it is read
(:func:`migrate_book`) and written back in the new form at the next change.

The model's kind (``encoder`` or ``decoder``) is decided once, at deploy
(:func:`model_kind`), and stored on the version; readers use the stored value.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, NonNegativeFloat, NonNegativeInt, PositiveInt

from coordinator.errors import (
    DraftModelError,
    NotServableError,
    RollbackError,
    StateError,
    UnknownModelError,
)
from coordinator.generation.draft_model import check_draft_model
from coordinator.generation.speculative import Speculative
from hostkit.files import write_atomic
from protocols.base import FrozenModel
from protocols.decoder import DECODER_FILE
from protocols.deploy import FixedCosts, ShapeLimits
from protocols.errors import SchemaError
from protocols.gguf_card import GgufCard
from protocols.manifest import TensorInfo
from protocols.plan import Objective

BOOK_FILE = "deployments.json"
MODEL_ID = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")

VersionState = Literal["active", "previous", "retired"]
ModelKind = Literal["encoder", "decoder"]
DEPLOYMENTS_DIR = "deployments"
"""Under the state dir: a directory per deployed version (:func:`segment_dir`)."""


class Placement(FrozenModel):
    """One segment of a version: where it runs, the plan's numbers and the agent's."""

    index: NonNegativeInt
    device: str
    host: str
    control_port: int
    data_port: int
    sha256: str
    param_bytes: NonNegativeInt
    predicted_memory_bytes: NonNegativeInt
    state_bytes: NonNegativeInt = 0
    """Of ``predicted_memory_bytes``, what the plan reserves for the sessions' state (a
    decoder's KV cache): allocated per session, so not in ``measured_memory_bytes`` (0 in
    records that predate it)."""
    predicted_compute_s: NonNegativeFloat
    """The plan's stage time: one request, or for a decoder one decode step."""
    predicted_prefill_s: NonNegativeFloat | None = None
    """Decoders: the plan's time for the stage to prefill a prompt (not planned on)."""
    measured_memory_bytes: int
    """Resident memory the agent measured after loading (DeployReport)."""
    warmup_s: NonNegativeFloat
    """Stage time the agent measured in the warm-up (median)."""
    load_s: NonNegativeFloat
    costs: FixedCosts | None = None
    """The operator, call and selection costs the agent measured with the warm-up (None from
    agents, and records, that predate it)."""


class VersionRecord(FrozenModel):
    """One deployed version of a model."""

    model_id: str
    version: PositiveInt
    """The model's own version number (1, 2, 3, ...), shown as ``MODEL vN``."""
    plan_version: PositiveInt
    """The key the agents hold its segments under, unique across all models (not shown)."""
    kind: ModelKind
    """``decoder`` (text generation, a KV cache per session) or ``encoder``: decided at
    deploy by :func:`model_kind`."""
    state: VersionState
    created_at: float
    source: str
    """Path of the ONNX or GGUF file it was split from."""
    objective: Objective
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    segments: list[Placement] = Field(min_length=1)
    health_max_abs_diff: NonNegativeFloat
    """Largest difference between the chain's answer and the local run in the health check."""
    memory_caps: dict[str, NonNegativeInt] = Field(default_factory=dict)
    """The operator's per-device planning caps, kept for re-plans after a device loss."""
    trigger: str = "operator"
    """Why it was deployed: ``operator``, ``failover: ...`` (a device was lost) or
    ``expand: ...`` (a lost device came back)."""
    limits: ShapeLimits | None = None
    """The planned shapes its stages enforce; requests are cut into runs that fit them."""
    card: GgufCard | None = None
    """A version built from a GGUF file (``source``): the file's name, architecture, size and
    quantization mix, its weights mode (kept for re-plans) and the build's peak memory."""


class ModelRecord(FrozenModel):
    """A model id, its tokenizer (text encoders) and its versions."""

    model_id: str
    tokenizer_dir: str | None = None
    speculative: Speculative = "auto"
    """How a decoder drafts tokens to verify in one chain pass (``off``: one token a pass)."""
    draft_model: str | None = None
    """Export directory of the draft model (same tokenizer) for ``draft`` and ``auto``."""
    active: PositiveInt | None = None
    """The model's version number requests go to."""
    previous: PositiveInt | None = None
    """The version number it replaced, still loaded for a rollback."""
    versions: list[VersionRecord] = Field(default_factory=list)

    def version(self, number: int) -> VersionRecord | None:
        """The version with this model version number, if any."""
        return next((v for v in self.versions if v.version == number), None)

    def by_plan(self, plan_version: int) -> VersionRecord | None:
        """The version whose segments the agents hold under ``plan_version``, if any."""
        return next((v for v in self.versions if v.plan_version == plan_version), None)

    def next_version(self) -> int:
        """The number the model's next version takes."""
        return max((v.version for v in self.versions), default=0) + 1


class DeploymentBook(FrozenModel):
    """The ``deployments.json`` file."""

    next_plan_version: PositiveInt = 1
    models: list[ModelRecord] = Field(default_factory=list)


class DeploymentStore:
    """Thread-safe access to the deployment book; every change is written atomically."""

    def __init__(self, state_dir: Path) -> None:
        self._path = state_dir / BOOK_FILE
        self._lock = threading.Lock()
        self._book = self._load()

    def book(self) -> DeploymentBook:
        """A snapshot."""
        with self._lock:
            return self._book

    def model(self, model_id: str) -> ModelRecord:
        """The record of ``model_id``; raises UnknownModelError."""
        record = next((m for m in self.book().models if m.model_id == model_id), None)
        if record is None:
            raise UnknownModelError(f"no model {model_id!r} is deployed")
        return record

    def active(self, model_id: str) -> VersionRecord:
        """The version requests go to; raises UnknownModelError or NotServableError."""
        record = self.model(model_id)
        live = record.version(record.active) if record.active else None
        if live is None:
            raise NotServableError(f"model {model_id!r} has no active version")
        return live

    def reserve_plan_version(self) -> int:
        """A fresh plan version, never handed out before (persisted before use)."""
        with self._lock:
            version = self._book.next_plan_version
            self._save(self._book.model_copy(update={"next_plan_version": version + 1}))
            return version

    def next_version(self, model_id: str) -> int:
        """The number ``model_id``'s next version takes (1 for a model not deployed yet)."""
        record = next((m for m in self.book().models if m.model_id == model_id), None)
        return record.next_version() if record is not None else 1

    def activate(self, version: VersionRecord, tokenizer_dir: str | None) -> list[VersionRecord]:
        """Make ``version`` active, the old active previous; returns the versions retired."""
        with self._lock:
            old = next((m for m in self._book.models if m.model_id == version.model_id), None)
            record = old or ModelRecord(model_id=version.model_id)
            keep = {record.active} - {None}
            retired = [v for v in record.versions if v.state != "retired" and v.version not in keep]
            versions = [
                _with_state(v, "previous" if v.version in keep else "retired")
                for v in record.versions
            ]
            if record.version(version.version) is not None:
                raise StateError(f"{version_label(version)} exists already")
            updated = record.model_copy(
                update={
                    "tokenizer_dir": tokenizer_dir or record.tokenizer_dir,
                    "active": version.version,
                    "previous": record.active,
                    "versions": [*versions, _with_state(version, "active")],
                }
            )
            self._put(updated)
            return retired

    def retire_previous(self, model_id: str, using: Collection[str]) -> VersionRecord | None:
        """Retire ``model_id``'s previous version if it has a segment on one of the devices
        ``using``, and return it (a version that cannot serve any more: a rollback has nothing
        to go back to then); None when there is no such previous version."""
        with self._lock:
            record = next((m for m in self._book.models if m.model_id == model_id), None)
            previous = record.version(record.previous) if record and record.previous else None
            if record is None or previous is None:
                return None
            if not set(using) & {p.device for p in previous.segments}:
                return None
            self._put(_previous_retired(record, previous))
            return previous

    def retire_every_previous(self) -> list[VersionRecord]:
        """Retire the previous version of every model (each kept only for a rollback) and
        return them."""
        with self._lock:
            retired = []
            for record in list(self._book.models):
                previous = record.version(record.previous) if record.previous else None
                if previous is None:
                    continue
                self._put(_previous_retired(record, previous))
                retired.append(previous)
            return retired

    def rollback(self, model_id: str) -> VersionRecord:
        """Switch ``model_id`` back to its previous version; returns the version now active."""
        with self._lock:
            record = next((m for m in self._book.models if m.model_id == model_id), None)
            if record is None:
                raise UnknownModelError(f"no model {model_id!r} is deployed")
            previous = record.version(record.previous) if record.previous else None
            if previous is None or record.active is None:
                raise RollbackError(f"model {model_id!r} has no previous version to go back to")
            versions = [
                _with_state(
                    v,
                    "previous"
                    if v.version == record.active
                    else "active"
                    if v.version == previous.version
                    else v.state,
                )
                for v in record.versions
            ]
            self._put(
                record.model_copy(
                    update={
                        "active": previous.version,
                        "previous": record.active,
                        "versions": versions,
                    }
                )
            )
            return _with_state(previous, "active")

    def set_speculative(
        self, model_id: str, mode: Speculative, draft_model: str | None = None
    ) -> ModelRecord:
        """Set a deployed model's speculative decoding (and its draft model, when given: an
        export directory, checked by :func:`check_draft_model`); raises UnknownModelError,
        DraftModelError (``draft`` without a draft model, or a draft that does not fit)."""
        with self._lock:
            record = next((m for m in self._book.models if m.model_id == model_id), None)
            if record is None:
                raise UnknownModelError(f"no model {model_id!r} is deployed")
            draft = draft_model or record.draft_model
            if draft_model is not None:
                if record.tokenizer_dir is None:
                    raise DraftModelError(f"{model_id} has no tokenizer to check a draft against")
                check_draft_model(Path(draft_model), Path(record.tokenizer_dir))
            if mode == "draft" and draft is None:
                raise DraftModelError(f"speculative draft needs a draft model for {model_id}")
            updated = record.model_copy(update={"speculative": mode, "draft_model": draft})
            self._put(updated)
            return updated

    def _put(self, record: ModelRecord) -> None:
        models = [m for m in self._book.models if m.model_id != record.model_id]
        self._save(self._book.model_copy(update={"models": [*models, record]}))

    def _load(self) -> DeploymentBook:
        if not self._path.exists():
            return DeploymentBook()
        try:
            raw = json.loads(self._path.read_bytes())
            return DeploymentBook.from_json(json.dumps(migrate_book(raw, self._path.parent)))
        except (OSError, ValueError, SchemaError) as exc:
            raise StateError(f"cannot read {self._path}: {exc}") from exc

    def _save(self, book: DeploymentBook) -> None:
        write_atomic(self._path, book.to_json().encode(), mode=0o600)
        self._book = book


def _previous_retired(record: ModelRecord, previous: VersionRecord) -> ModelRecord:
    """``record`` with its ``previous`` version retired (no rollback target left)."""
    versions = [
        _with_state(v, "retired") if v.version == previous.version else v for v in record.versions
    ]
    return record.model_copy(update={"previous": None, "versions": versions})


def _with_state(version: VersionRecord, state: VersionState) -> VersionRecord:
    return version if version.state == state else version.model_copy(update={"state": state})


def now() -> float:
    """Wall-clock time for records."""
    return time.time()


def version_label(version: VersionRecord) -> str:
    """How every surface names a version: ``MODEL vN`` with the model's own number."""
    return f"{version.model_id} v{version.version}"


def segment_dir(state_dir: Path, model_id: str, plan_version: int) -> Path:
    """Where the manifest and segment files of a deployed version are kept (the one owner of
    that path: the deployer writes there, training and the console's plan views read there).

    ``STATE/deployments/MODEL/plan-N`` by its plan version, which no other version ever takes;
    a state dir of an earlier release has them as ``vN``, which is used where it exists."""
    root = state_dir / DEPLOYMENTS_DIR / model_id
    earlier = root / f"v{plan_version}"
    return earlier if earlier.is_dir() else root / f"plan-{plan_version}"


def model_kind(
    inputs: Collection[TensorInfo], source: str | Path, tokenizer_dir: str | Path | None
) -> ModelKind:
    """``decoder`` for a text-generation graph: KV-cache or ``position_ids`` inputs, or a
    ``decoder.json`` next to its source or in its tokenizer directory; else ``encoder``."""
    names = [t.name for t in inputs]
    if any(n.startswith("past.") for n in names) or "position_ids" in names:
        return "decoder"
    places = [Path(source).parent, *([Path(tokenizer_dir)] if tokenizer_dir else [])]
    return "decoder" if any((p / DECODER_FILE).is_file() for p in places) else "encoder"


def migrate_book(raw: Any, state_dir: Path) -> Any:
    """A ``deployments.json`` document in today's form; one written before the per-model version
    numbers and the stored kind gets them (in place, returned for convenience).

    Its versions are numbered per model in plan-version order (the order they were made), its
    ``active`` and ``previous`` plan versions become those numbers, and each version's kind is
    decided as a deploy decides it now (its source and its model's tokenizer directory, read in
    ``state_dir`` when they were relative). A document already in today's form is unchanged.
    """
    if not isinstance(raw, dict):
        return raw
    for model in raw.get("models", []):
        versions = model.get("versions", [])
        if all("version" in v for v in versions):
            continue
        numbers: dict[int, int] = {}
        for number, old in enumerate(sorted(versions, key=lambda v: v["plan_version"]), 1):
            numbers[old["plan_version"]] = number
            old["version"] = number
        for field in ("active", "previous"):
            if model.get(field) is not None:
                model[field] = numbers.get(model[field], model[field])
    for model in raw.get("models", []):
        for old in model.get("versions", []):
            if "kind" not in old:
                inputs = [TensorInfo.model_validate(t) for t in old.get("inputs", [])]
                source = state_dir / old.get("source", "")
                old["kind"] = model_kind(inputs, source, model.get("tokenizer_dir"))
    return raw
