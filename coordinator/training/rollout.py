"""Rollout: trained weights become a new version directory with a manifest and a lineage record.

Only the trained segments get new files (their initializers rewritten); every other segment file
is copied byte for byte, and the cut tensors (segment inputs and outputs) never change. The
manifest can be signed with the coordinator's CA (``manifest.json.sig``, ecdsa-p256-sha256).
Pushing the new version to running agents is the deployment code's job.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np
import onnx

from coordinator.training.errors import RolloutError
from coordinator.training.records import Lineage
from coordinator.training.segments import write_weights
from coordinator.training.version import LINEAGE_FILE, MANIFEST_FILE, SIGNATURE_FILE, Version
from hostkit.files import write_atomic

_VERSION_DIR = re.compile(r"^v(\d{4,})$")


class Signer(Protocol):
    """What rollout needs from the CA: a signature over bytes."""

    def sign(self, data: bytes) -> bytes:
        """Signature over ``data`` that :func:`verify_signature` checks with the CA certificate."""
        ...


def apply_weights(
    segments: Sequence[onnx.ModelProto], weights: Mapping[int, Mapping[str, np.ndarray]]
) -> list[onnx.ModelProto]:
    """New segments: those in ``weights`` get their initializers rewritten, the rest are kept.

    ``ModelProto`` in, ``ModelProto`` out; inputs are not modified.
    """
    for index in weights:
        if not 0 <= index < len(segments):
            raise RolloutError(f"no segment {index} to update")
    return [
        write_weights(seg, weights[i]) if i in weights else seg for i, seg in enumerate(segments)
    ]


def verify_signature(version_dir: Path, ca_cert_pem: bytes) -> None:
    """Check ``manifest.json.sig`` against the CA's key; raise :class:`RolloutError` if it is
    missing or does not verify (a version is verified like this before it is deployed)."""
    from cryptography import x509
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec

    try:
        manifest = (version_dir / MANIFEST_FILE).read_bytes()
        signature = (version_dir / SIGNATURE_FILE).read_bytes()
    except OSError as exc:
        raise RolloutError(f"{version_dir}: unsigned or unreadable version: {exc}") from exc
    key = x509.load_pem_x509_certificate(ca_cert_pem).public_key()
    if not isinstance(key, ec.EllipticCurvePublicKey):
        raise RolloutError("the CA key is not an EC key")
    try:
        key.verify(signature, manifest, ec.ECDSA(hashes.SHA256()))
    except InvalidSignature as exc:
        raise RolloutError(f"{version_dir}: the manifest signature does not verify") from exc


def next_version_dir(root: Path) -> Path:
    """``root/vNNNN`` one past the highest existing version directory."""
    numbers = [int(m.group(1)) for p in root.glob("v*") if (m := _VERSION_DIR.match(p.name))]
    return root / f"v{max(numbers, default=0) + 1:04d}"


def write_version(
    parent: Version,
    weights: Mapping[int, Mapping[str, np.ndarray]],
    lineage: Lineage,
    out_dir: Path,
    signer: Signer | None = None,
) -> Version:
    """Write ``out_dir`` with the parent's segments, ``weights`` applied, and a lineage record."""
    if out_dir.exists():
        raise RolloutError(f"{out_dir} already exists")
    new_segments = apply_weights(parent.segments, weights)
    entries = []
    for entry, seg in zip(parent.manifest.segments, new_segments, strict=True):
        if entry.index in weights:
            data = seg.SerializeToString()
        else:
            data = (parent.path / entry.file).read_bytes()
        write_atomic(out_dir / entry.file, data)
        entries.append(entry.model_copy(update={"sha256": hashlib.sha256(data).hexdigest()}))
    digest = hashlib.sha256("".join(e.sha256 for e in entries).encode()).hexdigest()
    model = parent.manifest.model.model_copy(update={"sha256": digest})
    manifest = parent.manifest.model_copy(update={"segments": entries, "model": model})
    manifest_bytes = manifest.to_json().encode()
    write_atomic(out_dir / MANIFEST_FILE, manifest_bytes)
    write_atomic(out_dir / LINEAGE_FILE, lineage.to_json().encode())
    if signer is not None:
        write_atomic(out_dir / SIGNATURE_FILE, signer.sign(manifest_bytes))
    return Version.load(out_dir)
