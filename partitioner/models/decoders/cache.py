"""Where converted checkpoints live between runs, and writing them there atomically.

The cache directory is chosen by the caller (the CLI reads ``$FEDSHARD_CACHE``; see
:func:`default_cache_dir`); nothing in the partitioner reads the environment for it.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

from partitioner.errors import GraphError

CACHE_ENV = "FEDSHARD_CACHE"
"""Environment variable naming the cache directory (read by the CLI entry point only)."""

COMPLETE_MARKER = ".complete"


def default_cache_dir(env_value: str | None) -> Path:
    """``env_value`` when set and non-empty, else ``~/.cache/fedshard``."""
    if env_value:
        return Path(env_value).expanduser()
    return Path.home() / ".cache" / "fedshard"


def cached_dir(target: Path, build: Callable[[Path], None]) -> Path:
    """Return ``target``, first building it with ``build(tmp_dir)`` if it is not complete.

    ``build`` fills a fresh temporary directory next to ``target``; it is then renamed into
    place and marked complete, so an interrupted build never leaves a half-written cache entry.
    """
    if (target / COMPLETE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    scratch = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir()
    try:
        build(scratch)
        (scratch / COMPLETE_MARKER).write_text("ok\n")
        if target.exists():
            shutil.rmtree(target)
        scratch.rename(target)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    if not (target / COMPLETE_MARKER).is_file():
        raise GraphError(f"{target}: cache entry was not written")
    return target
