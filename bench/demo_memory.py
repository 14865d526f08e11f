"""Peak resident memory of every process of ``fedshard demo``'s run (issue 40 item 7).

Runs ``fedshard demo --exit --port 0 [DEMO OPTIONS]`` with a cache dir (default: a fresh one,
as a new user's first run) and samples the resident memory of the demo and every process it
starts (coordinator, agents, exports, Flower) every ``--every`` seconds with psutil. Prints
each process's peak (by its command), the largest single process and the largest sum, and the
cache's size afterwards; writes them to ``bench/results/demo_memory.md`` (``--out``)::

    .venv/bin/python bench/demo_memory.py -- --skip-training
    .venv/bin/python bench/demo_memory.py --cache-dir .cache/fedshard -- --decoder gemma3-270m
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
FEDSHARD = Path(sys.executable).parent / "fedshard"
RESULTS = REPO / "bench" / "results" / "demo_memory.md"
MB = 1e6


@dataclass
class Peak:
    """One process's largest resident memory seen."""

    label: str
    rss: int = 0


def label_of(proc: psutil.Process) -> str:
    """A short name for a process: its fedshard subcommand (and agent name), else its program."""
    try:
        words = proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return "?"
    if "agent" in words and "--name" in words[:-1]:
        return f"agent {words[words.index('--name') + 1]}"
    for i, word in enumerate(words):
        if word.endswith("fedshard") and i + 1 < len(words):
            return " ".join(["fedshard", *words[i + 1 : i + 3]])
    return " ".join(Path(w).name for w in words[:3])[:80]


def sample(root: psutil.Process, peaks: dict[int, Peak]) -> int:
    """Record every live process's RSS under ``root``; their sum."""
    total = 0
    try:
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    for proc in procs:
        try:
            rss = int(proc.memory_info().rss)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        total += rss
        peak = peaks.setdefault(proc.pid, Peak(label_of(proc)))
        peak.rss = max(peak.rss, rss)
    return total


def dir_bytes(path: Path) -> int:
    """Bytes of every file under ``path``."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def main() -> None:
    """Run the demo, sample, print and write the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, help="the demo's cache (default: a fresh one)")
    parser.add_argument("--every", type=float, default=0.25)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("demo", nargs="*", help="options for `fedshard demo` (after --)")
    args = parser.parse_args()
    fresh = args.cache_dir is None
    cache = args.cache_dir or Path(tempfile.mkdtemp(prefix="demo-cache-"))
    command = [str(FEDSHARD), "demo", "--exit", "--port", "0", *args.demo]
    env = {**os.environ, "FEDSHARD_CACHE": str(cache), "COLUMNS": "200"}
    log = cache.parent / f"{cache.name}-demo.log"
    peaks: dict[int, Peak] = {}
    largest_sum = 0
    started = time.monotonic()
    with log.open("wb") as out:
        demo = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env)
        root = psutil.Process(demo.pid)
        while demo.poll() is None:
            largest_sum = max(largest_sum, sample(root, peaks))
            time.sleep(args.every)
    seconds = time.monotonic() - started
    print(log.read_text(errors="replace")[-3000:])
    rows = sorted(peaks.values(), key=lambda p: -p.rss)
    lines = [
        "# Peak resident memory of `fedshard demo`'s processes",
        "",
        f"`.venv/bin/python bench/demo_memory.py -- {' '.join(args.demo)}`"
        f"{' (fresh cache: a first run)' if fresh else f' (cache {cache})'}; exit code "
        f"{demo.returncode}, {seconds:.0f} s; psutil every {args.every} s.",
        "",
        f"- largest process: {rows[0].rss / MB:,.0f} MB ({rows[0].label})" if rows else "",
        f"- largest sum over the demo's processes at one time: {largest_sum / MB:,.0f} MB",
        f"- cache afterwards: {dir_bytes(cache) / MB:,.0f} MB",
        "",
        "| process | peak RSS MB |",
        "|---|---|",
        *(f"| {p.label} | {p.rss / MB:,.0f} |" for p in rows if p.rss > 50 * MB),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)


if __name__ == "__main__":
    main()
