"""Send the version a run trains to the paired agents that train (``fedshard.training-copy/1``).

A LoRA run on paired agents trains exactly the served version: before the SuperLink starts, the
run's staged segments dir (``manifest.json``, the segment files, ``tokenizer.json``) is offered
to every online paired agent, signed with the CA key over
:func:`protocols.training_copy.copy_signing_bytes`, over the agents' mutually authenticated
control plane; each agent verifies the signature and every file's hash and answers which files
it lacks, and only those are sent (a second run of a fine-tuned version sends only the segments
that changed). Agents that do not train (no ``--train-data``: no such route, 404) are skipped;
fewer agents holding the copy than the run needs fails the run before anything starts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from coordinator.errors import AgentError, AgentRefusedError
from coordinator.training.errors import TrainingRunError
from coordinator.transport.agent_client import AgentAddress, AgentClient
from hostkit.files import file_sha256
from protocols.manifest import Manifest
from protocols.training_copy import (
    COPY_MANIFEST,
    CopyFile,
    TrainingCopy,
    TrainingCopyOffer,
    TrainingCopyStatus,
    copy_signing_bytes,
)

log = logging.getLogger(__name__)

NOT_TRAINING = 404
"""An agent without ``--train-data`` has no training routes."""


def training_copy(copy_id: str, segments_dir: Path, extra: Sequence[str] = ()) -> TrainingCopy:
    """The copy of ``segments_dir``: its manifest, the segment files it lists and ``extra``
    files (the tokenizer), each with its SHA-256 and size."""
    manifest = Manifest.from_json((segments_dir / COPY_MANIFEST).read_bytes())
    names = [COPY_MANIFEST, *(e.file for e in manifest.segments), *extra]
    files = []
    for name in names:
        path = segments_dir / name
        files.append(CopyFile(name=name, sha256=file_sha256(path), size=path.stat().st_size))
    return TrainingCopy(copy_id=copy_id, files=files)


def signed_offer(copy: TrainingCopy, sign: Callable[[bytes], bytes]) -> TrainingCopyOffer:
    """``copy`` with the CA's signature (ECDSA P-256, SHA-256)."""
    signature = sign(copy_signing_bytes(copy))
    return TrainingCopyOffer(
        version=copy, signature_algorithm="ecdsa-p256-sha256", signature_hex=signature.hex()
    )


def send_copy(
    client: AgentClient, agent: AgentAddress, offer: TrainingCopyOffer, segments_dir: Path
) -> TrainingCopyStatus:
    """Offer the copy to one agent and send the files it lacks, one request each."""
    by_sha = {f.sha256: f for f in offer.version.files}
    status = client.training_copy(agent, offer)
    sent = 0
    while status.missing:
        sha = status.missing[0]
        if sha not in by_sha or sent >= len(by_sha):
            raise AgentError(f"{agent.device} asks for a file the copy does not hold: {sha}")
        status = client.training_file(agent, (segments_dir / by_sha[sha].name).read_bytes())
        sent += 1
    if not status.ready:
        raise AgentError(f"{agent.device} holds every file but did not install the copy")
    log.info("%s holds training copy %s (%d files sent)", agent.device, status.copy_id, sent)
    return status


def send_to_trainers(
    client: AgentClient,
    agents: Sequence[AgentAddress],
    offer: TrainingCopyOffer,
    segments_dir: Path,
    needed: int,
) -> list[str]:
    """Send the copy to every agent at once; the names of those that hold it now. Fewer than
    ``needed`` is a :class:`TrainingRunError` with each agent's reason."""

    def one(agent: AgentAddress) -> str | None:
        try:
            send_copy(client, agent, offer, segments_dir)
            return None
        except AgentRefusedError as exc:
            return "does not train" if exc.status == NOT_TRAINING else str(exc)
        except (AgentError, OSError) as exc:
            return str(exc)

    with ThreadPoolExecutor(max_workers=max(1, len(agents))) as pool:
        reasons = list(pool.map(one, agents))
    held = [a.device for a, why in zip(agents, reasons, strict=True) if why is None]
    if len(held) < needed:
        why = "; ".join(f"{a.device}: {r}" for a, r in zip(agents, reasons, strict=True) if r)
        raise TrainingRunError(
            f"{len(held)} paired agents hold the version to train, the run needs {needed}"
            + (f" ({why})" if why else "")
        )
    return held
