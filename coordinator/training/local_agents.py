"""Local agents for the demo: SuperNode processes on 127.0.0.1, one per data split.

They are started as separate processes (``python -m edge_agent.training.supernode``), the way an
agent would run them, so the coordinator never imports :mod:`edge_agent`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from coordinator.training.errors import FlowerProcessError
from coordinator.training.flower import SuperLink, offline_env
from hostkit.processes import stop_tree


@contextmanager
def start_local_agents(
    link: SuperLink,
    segments_dir: Path,
    data_dirs: Sequence[Path],
    budgets: Sequence[int],
    work_dir: Path,
    auth_keys: Sequence[Path] = (),
    cache_root: Path | None = None,
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Start one SuperNode per data dir (the ``i``-th authenticated with ``auth_keys[i]``,
    when given, and caching under ``cache_root/agent-i``, when given: kept between runs);
    stop them all on exit."""
    procs: list[subprocess.Popen[bytes]] = []
    keys: list[Path | None] = list(auth_keys) or [None] * len(data_dirs)
    # each SuperNode gets its share of the cores, so that they do not oversubscribe them
    threads = max(1, (os.cpu_count() or 1) // max(1, len(data_dirs)))
    try:
        for i, (data_dir, budget) in enumerate(zip(data_dirs, budgets, strict=True)):
            node_dir = work_dir / f"agent-{i}"
            node_dir.mkdir(parents=True, exist_ok=True)
            cmd = [
                sys.executable,
                "-m",
                "edge_agent.training.supernode",
                "--superlink",
                link.address,
                "--root-certificates",
                str(link.tls.ca_cert),
                "--segments-dir",
                str(segments_dir),
                "--data-dir",
                str(data_dir),
                "--work-dir",
                str(node_dir),
                "--budget-bytes",
                str(budget),
            ]
            if keys[i] is not None:
                cmd += ["--auth-private-key", str(keys[i])]
            if cache_root is not None:
                cmd += ["--cache-dir", str(cache_root / f"agent-{i}")]
            cmd += ["--threads", str(threads)]
            try:
                with (node_dir / "agent.log").open("wb") as log_file:
                    procs.append(
                        subprocess.Popen(
                            cmd,
                            env=offline_env(node_dir / "flwr-home"),
                            stdout=log_file,
                            stderr=subprocess.STDOUT,
                            start_new_session=True,
                        )
                    )
            except OSError as exc:
                raise FlowerProcessError(f"cannot start a local agent: {exc}") from exc
        yield procs
    finally:
        for proc in procs:
            stop_tree(proc)
