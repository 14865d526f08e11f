"""What the report is stamped with: the machine, the library versions, the date, the commit."""

from __future__ import annotations

import datetime as dt
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

LIBRARIES = ("onnxruntime", "torch", "onnx", "numpy", "transformers", "flwr")


def _proc_field(path: str, key: str) -> str | None:
    """The value of the first ``key: value`` line of a /proc file, if any."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` says."""
    return _proc_field("/proc/cpuinfo", "model name") or platform.processor() or "unknown"


def memory_gib() -> float | None:
    """Total memory in GiB (``/proc/meminfo``)."""
    total = _proc_field("/proc/meminfo", "MemTotal")
    return int(total.split()[0]) / 2**20 if total else None


def versions() -> dict[str, str]:
    """Installed versions of the libraries the benchmarks measure (without importing them)."""
    found = {"Python": platform.python_version()}
    for name in LIBRARIES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def commit(repo: Path) -> str:
    """The checked-out commit (short), with ``+changes`` when the tree differs from it."""
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (" +changes" if dirty else "")


def stamp(repo: Path) -> list[str]:
    """Markdown lines describing where and when the report was made."""
    mem = memory_gib()
    libs = ", ".join(f"{name} {version}" for name, version in versions().items())
    return [
        f"- Machine: {os.cpu_count()} CPU cores (`os.cpu_count()`), "
        f"{f'{mem:.1f} GiB' if mem is not None else 'unknown'} memory, {cpu_model()}, "
        f"{platform.system()} {platform.release()} {platform.machine()}",
        f"- Software: {libs}",
        f"- Report written {dt.datetime.now(dt.UTC).strftime('%Y-%m-%d %H:%M UTC')} "
        f"at commit {commit(repo)}",
    ]
