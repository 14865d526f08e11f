"""``fedshard.training-copy/1``: the served version a training agent fine-tunes, sent to it.

Before a LoRA run on paired agents, the coordinator sends each training agent exactly the
version the run trains (its ``manifest.json``, segment files and ``tokenizer.json``) over the
agent's control plane (mutually authenticated TLS, coordinator role only):

1. ``POST /v1/training/copy`` with a :class:`TrainingCopyOffer` (a JSON document of at most
   1 MiB): the list of files, each with its SHA-256 and size, signed with the CA key over
   :func:`copy_signing_bytes`. The agent verifies the signature before anything else, refuses a
   copy larger than its training storage, and answers :class:`TrainingCopyStatus`: the hashes
   of the files it does not hold yet (files it kept from an earlier copy are not sent again).
2. ``POST /v1/training/file`` once per missing file, the body being the file's bytes and
   nothing else. Before the body is read, its declared length must not exceed the largest file
   still missing; after, its SHA-256 and size must be those of a missing file of the offer.
   When the last one arrives the agent makes the copy its training version (atomically) and
   answers ``ready: true``.

The signature covers every file's hash, so a file is trusted only through the offer; no file is
parsed before its hash matched.
"""

from __future__ import annotations

import json
from typing import Final, Literal

from pydantic import Field, NonNegativeInt, model_validator

from protocols.base import FrozenModel
from protocols.deploy import SignatureAlgorithm
from protocols.manifest import MANIFEST_FILE

TRAINING_COPY_FORMAT: Final = "fedshard.training-copy/1"
COPY_MANIFEST: Final = MANIFEST_FILE
"""Every copy holds the version's manifest under this name."""
MAX_COPY_FILES: Final = 1024

_FILE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_SHA256 = r"^[0-9a-f]{64}$"


class CopyFile(FrozenModel):
    """One file of a copy: a plain name (no directories), its SHA-256 and size."""

    name: str = Field(pattern=_FILE_NAME)
    sha256: str = Field(pattern=_SHA256)
    size: NonNegativeInt


class TrainingCopy(FrozenModel):
    """What the coordinator signs: a version's files for fine-tuning on an agent."""

    format: Literal["fedshard.training-copy/1"] = TRAINING_COPY_FORMAT
    copy_id: str = Field(pattern=_FILE_NAME)
    """Names the copy (model and plan version, e.g. ``tiny-llama-v3``)."""
    files: list[CopyFile] = Field(min_length=1, max_length=MAX_COPY_FILES)

    @model_validator(mode="after")
    def _one_manifest_and_unique_names(self) -> TrainingCopy:
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            raise ValueError("file names repeat")
        if COPY_MANIFEST not in names:
            raise ValueError(f"a copy holds {COPY_MANIFEST}")
        return self

    @property
    def total_bytes(self) -> int:
        """Sum of the files' sizes."""
        return sum(f.size for f in self.files)


class TrainingCopyOffer(FrozenModel):
    """``POST /v1/training/copy``: the copy and the coordinator's signature over it."""

    version: TrainingCopy
    signature_algorithm: SignatureAlgorithm
    signature_hex: str = Field(min_length=2, max_length=1024, pattern=r"^[0-9a-f]+$")


class TrainingCopyStatus(FrozenModel):
    """The agent's answer to an offer and to each file: what it still lacks."""

    copy_id: str = Field(pattern=_FILE_NAME)
    missing: list[str] = Field(default_factory=list, max_length=MAX_COPY_FILES)
    """SHA-256 of each file still to send."""
    ready: bool
    """Every file is held and the copy is the agent's training version now."""


def copy_signing_bytes(copy: TrainingCopy) -> bytes:
    """The bytes the coordinator signs: the format tag, a newline, canonical JSON (sorted keys,
    no whitespace, ASCII escapes), as for deploy manifests."""
    obj = copy.model_dump(mode="json")
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return f"{TRAINING_COPY_FORMAT}\n{text}".encode()
