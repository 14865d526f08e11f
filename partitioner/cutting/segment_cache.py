"""Segment files kept between splits, so cutting the same model the same way again is a copy.

A segment file is a pure function of the model file, the segment's spec (its nodes, weights,
inputs and outputs), the analysis settings and the code that builds and saves it. The cache key
hashes all of them: the model's SHA-256, the spec, the settings, and the source of
:mod:`partitioner.cutting.segments` and :mod:`partitioner.analysis.modelio`, so a change to either
module never serves a stale file. Re-planning a model onto the same cut (a failover that expands
back, a demo's second run, a redeploy) then reuses the files instead of rebuilding gigabytes of
protobuf.

Entries are ``KEY.onnx`` plus ``KEY.sha256`` (the file's own hash, for the manifest). Files are
written to a temporary name and renamed, so a crash never leaves half an entry. The least
recently used entries are removed beyond ``max_bytes``. Only single-file segments are cached
(no external data).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path

from partitioner.analysis import modelio
from partitioner.cutting import segments
from partitioner.cutting.segments import SegmentSpec

DEFAULT_MAX_BYTES = 8 << 30
SUFFIX = ".onnx"
HASH_SUFFIX = ".sha256"


def _code_fingerprint() -> str:
    digest = hashlib.sha256()
    for module in (segments, modelio):
        digest.update(Path(str(module.__file__)).read_bytes())
    return digest.hexdigest()


class SegmentCache:
    """A directory of segment files by content key (see the module doc)."""

    def __init__(self, root: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self._code = _code_fingerprint()

    def key(self, model_sha256: str, spec: SegmentSpec, settings: Mapping[str, object]) -> str:
        """The key of ``spec`` cut from the model with that hash under ``settings``."""
        document = {
            "model": model_sha256,
            "spec": asdict(spec),
            "settings": dict(settings),
            "code": self._code,
        }
        text = json.dumps(document, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def fetch(self, key: str, dest: Path) -> str | None:
        """Put the cached file at ``dest`` (hard link, else copy); its SHA-256, or None."""
        source, recorded = self._paths(key)
        try:
            sha256 = recorded.read_text().strip()
            dest.unlink(missing_ok=True)
            _link_or_copy(source, dest)
        except FileNotFoundError:
            return None
        os.utime(source)  # most recently used
        return sha256

    def store(self, key: str, file: Path, sha256: str) -> None:
        """Keep ``file`` (whose hash is ``sha256``) under ``key``; drop the oldest beyond size."""
        self.root.mkdir(parents=True, exist_ok=True)
        target, recorded = self._paths(key)
        partial = target.with_name(f".{key}.partial")
        _link_or_copy(file, partial)
        partial.replace(target)
        tmp = recorded.with_name(f".{key}.sha256.partial")
        tmp.write_text(sha256 + "\n")
        tmp.replace(recorded)
        self.prune()

    def prune(self) -> None:
        """Remove least recently used entries until the cache holds at most ``max_bytes``."""
        entries = []
        for path in self.root.glob(f"*{SUFFIX}"):
            with contextlib.suppress(FileNotFoundError):
                stat = path.stat()
                entries.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in entries)
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            path.unlink(missing_ok=True)
            path.with_suffix(HASH_SUFFIX).unlink(missing_ok=True)
            total -= size

    def _paths(self, key: str) -> tuple[Path, Path]:
        return self.root / f"{key}{SUFFIX}", self.root / f"{key}{HASH_SUFFIX}"


def _link_or_copy(source: Path, dest: Path) -> None:
    try:
        os.link(source, dest)
    except OSError:
        shutil.copyfile(source, dest)
