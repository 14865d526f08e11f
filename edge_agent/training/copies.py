"""The served version a training agent fine-tunes, as the coordinator sends it.

``fedshard agent --train-data DIR`` (without ``--train-segments``) trains on the copy the
coordinator sent last (:mod:`protocols.training_copy`): ``STATE/training/current`` points at
it, and that is the SuperNode's ``segments-dir``. The order of checks is the security argument:

1. The control plane checks route, role (coordinator only) and declared size before a byte of
   the body is read; a file's body may be no larger than the largest file the pending offer
   still lacks (nothing, while no offer is pending).
2. An offer's signature (CA key) is verified before anything is stored or removed; a copy
   larger than ``--train-storage`` is refused (:class:`StorageError`, 507).
3. A file is kept only when its SHA-256 and size are those of a file the offer lacks; it is
   written atomically to ``training/copy-blobs/<sha256>``.
4. When the last file is in, the copy's directory is built from hard links and ``current`` is
   switched to it atomically (a symlink replaced by rename).

Storage stays bounded: a new offer drops every earlier copy and every kept file it does not
list, so at most one copy (at most ``--train-storage`` bytes) is held.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import secrets
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from edge_agent.config import TrainConfig
from edge_agent.errors import IntegrityError, SignatureError, StorageError
from edge_agent.net.control import COORDINATOR_ONLY, Response, Route, json_response
from edge_agent.training.ledger import PrivacyLedger, PrivacyPolicy
from edge_agent.trust.identity import PublicKey, verify_signature
from hostkit.files import write_atomic
from protocols.ledger import LEDGER_FILE, PRIVACY_PATH, RunFateReport
from protocols.training_copy import (
    TrainingCopy,
    TrainingCopyOffer,
    TrainingCopyStatus,
    copy_signing_bytes,
)

log = logging.getLogger(__name__)

CURRENT = "current"
BLOBS = "copy-blobs"
COPIES = "copies"
DEFAULT_STORAGE_BYTES = 4 << 30


class TrainingCopies:
    """The agent's training copy: offers, files, and the ``current`` link (thread-safe)."""

    def __init__(
        self,
        root: Path,
        storage_bytes: int,
        ca_key: Callable[[], PublicKey | None],
    ) -> None:
        self.root = root
        self.storage_bytes = storage_bytes
        self._ca_key = ca_key
        self._lock = threading.Lock()
        self._pending: TrainingCopy | None = None

    @property
    def current(self) -> Path:
        """The training version the SuperNode reads (a symlink to the last complete copy)."""
        return self.root / CURRENT

    def largest_missing(self) -> int:
        """The largest file the pending offer lacks (0 without one): a file body's limit."""
        with self._lock:
            pending = self._pending
            if pending is None:
                return 0
            return max((f.size for f in pending.files if not self._held(f.sha256)), default=0)

    def offer(self, body: bytes) -> TrainingCopyStatus:
        """Verify and record an offer; drop what it does not list; what is still missing."""
        offer = TrainingCopyOffer.from_json(body)
        try:
            signature = bytes.fromhex(offer.signature_hex)
        except ValueError as exc:
            raise SignatureError("the signature is not hex") from exc
        verify_signature(
            self._ca_key(), offer.signature_algorithm, signature, copy_signing_bytes(offer.version)
        )
        copy = offer.version
        if copy.total_bytes > self.storage_bytes:
            raise StorageError(
                f"copy {copy.copy_id} is {copy.total_bytes} bytes, over the "
                f"{self.storage_bytes}-byte training storage"
            )
        with self._lock:
            self._drop_all_but(copy)
            self._pending = copy
            status = self._status(copy)
            if status.ready:
                self._install(copy)
        log.info("training copy %s offered: %d files missing", copy.copy_id, len(status.missing))
        return status

    def receive(self, body: bytes) -> TrainingCopyStatus:
        """Keep one file of the pending offer (hash and size checked); install when complete."""
        digest = hashlib.sha256(body).hexdigest()
        with self._lock:
            copy = self._pending
            wanted = None if copy is None else {f.sha256: f.size for f in copy.files}
            if copy is None or wanted is None or wanted.get(digest) != len(body):
                raise IntegrityError(
                    f"a file of {len(body)} bytes hashing to {digest} is not one the "
                    "pending training copy lacks"
                )
            self._write_blob(digest, body)
            status = self._status(copy)
            if status.ready:
                self._install(copy)
        return status

    def _held(self, sha256: str) -> bool:
        return (self.root / BLOBS / sha256).is_file()

    def _status(self, copy: TrainingCopy) -> TrainingCopyStatus:
        missing = sorted({f.sha256 for f in copy.files if not self._held(f.sha256)})
        return TrainingCopyStatus(copy_id=copy.copy_id, missing=missing, ready=not missing)

    def _write_blob(self, digest: str, data: bytes) -> None:
        blobs = self.root / BLOBS
        blobs.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomic(blobs / digest, data)

    def _drop_all_but(self, copy: TrainingCopy) -> None:
        """Remove every earlier copy, ``current``, and each kept file ``copy`` does not list."""
        keep = {f.sha256 for f in copy.files}
        self.current.unlink(missing_ok=True)
        shutil.rmtree(self.root / COPIES, ignore_errors=True)
        blobs = self.root / BLOBS
        for path in blobs.iterdir() if blobs.is_dir() else ():
            if path.name not in keep:
                path.unlink(missing_ok=True)

    def _install(self, copy: TrainingCopy) -> None:
        """Build the copy's directory from hard links, then point ``current`` at it."""
        copies = self.root / COPIES
        copies.mkdir(parents=True, exist_ok=True, mode=0o700)
        building = copies / f".{copy.copy_id}.{secrets.token_hex(4)}"
        building.mkdir(mode=0o700)
        for f in copy.files:
            os.link(self.root / BLOBS / f.sha256, building / f.name)
        final = copies / copy.copy_id
        shutil.rmtree(final, ignore_errors=True)
        building.rename(final)
        link = self.root / f".{CURRENT}.{secrets.token_hex(4)}"
        link.symlink_to(Path(COPIES) / copy.copy_id)
        link.replace(self.current)
        self._pending = None
        log.info("training copy %s installed (%d bytes)", copy.copy_id, copy.total_bytes)


def privacy_policy(root: Path, train: TrainConfig) -> PrivacyPolicy:
    """The policy ``fedshard agent`` was given, over the ledger in the training dir ``root``
    (the same file its SuperNode's ClientApp appends to)."""
    return PrivacyPolicy(
        ledger_file=root.resolve() / LEDGER_FILE,
        budget=train.privacy_budget,
        allow_non_dp=train.allow_non_dp,
        allow_non_secagg=train.allow_non_secagg,
    )


def training_routes(
    copies: TrainingCopies, policy: PrivacyPolicy | None = None
) -> dict[tuple[str, str], Route]:
    """The control-plane routes of :class:`TrainingCopies` (coordinator only), and with a
    ``policy`` ``GET /v1/training/privacy``: the privacy ledger's totals
    (:class:`~protocols.ledger.PrivacyStatus`: accounting figures, not the records'), and
    ``POST`` of a :class:`~protocols.ledger.RunFateReport`, which the ledger records."""

    async def offer(body: bytes) -> Response:
        status = await asyncio.to_thread(copies.offer, body)
        return json_response(status.model_dump_json())

    async def receive(body: bytes) -> Response:
        status = await asyncio.to_thread(copies.receive, body)
        return json_response(status.model_dump_json())

    async def privacy(body: bytes) -> Response:
        assert policy is not None
        status = await asyncio.to_thread(PrivacyLedger(policy.ledger_file).status, policy)
        return json_response(status.model_dump_json())

    async def fate(body: bytes) -> Response:
        assert policy is not None
        report = RunFateReport.from_json(body)
        ledger = PrivacyLedger(policy.ledger_file)
        await asyncio.to_thread(ledger.mark, report.run, report.fate)
        status = await asyncio.to_thread(ledger.status, policy)
        return json_response(status.model_dump_json())

    routes = {
        ("POST", "/v1/training/copy"): Route(offer, COORDINATOR_ONLY),
        ("POST", "/v1/training/file"): Route(
            receive, COORDINATOR_ONLY, body_limit=copies.largest_missing
        ),
    }
    if policy is not None:
        routes[("GET", PRIVACY_PATH)] = Route(privacy, COORDINATOR_ONLY)
        routes[("POST", PRIVACY_PATH)] = Route(fate, COORDINATOR_ONLY)
    return routes
