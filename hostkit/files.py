"""Atomic file writes (readers see the old content or the new, and a crash never leaves a torn
file) and file digests.

The coordinator's state dir and the agent's state files are written only through
:func:`write_atomic`.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

TEMP_SUFFIX = ".tmp"


def write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` so readers see the old or the new content, never a mix.

    The bytes go to a temporary file in the same directory, are flushed to disk, and replace
    ``path`` with one ``rename``; the directory is synced so the rename itself survives a crash.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def sweep_temp_files(directory: Path) -> list[Path]:
    """Delete the temporary files that writes interrupted by a crash left in ``directory``.

    They are never read (a write only becomes visible through its final ``rename``), so this
    is tidying, not repair. Only the coordinator writes its state dir: call it at start, before
    anything writes. Returns the files removed.
    """
    if not directory.is_dir():
        return []
    removed = []
    for path in directory.iterdir():
        if path.name.startswith(".") and path.name.endswith(TEMP_SUFFIX) and path.is_file():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def file_sha256(path: Path) -> str:
    """Hex SHA-256 of a file, streamed (the file is never held in memory whole)."""
    with path.open("rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()
