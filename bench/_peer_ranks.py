"""The parent's side of bench/peer_pipelining.py's torch ranks (a helper, not a benchmark).

:class:`TorchRanks` starts three processes running ``_peer_torch`` (through
``peer_pipelining.py --worker``), sends rank 0 one command at a time and waits for its reply file;
on exit it asks them to quit and kills whatever is left.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import numpy as np
from agent_helpers import minilm_feeds

START_TIMEOUT_S = 300.0
COMMAND_TIMEOUT_S = 300.0


class PeerBenchError(RuntimeError):
    """A torch rank failed, or did not answer in time."""


class TorchRanks:
    """Three torch ranks holding the layer blocks ``ranges`` of MiniLM, ready for commands."""

    def __init__(self, work: Path, ranges: list[tuple[int, int]], onnx_model: Path) -> None:
        self.work = work
        self.ranges = ranges
        self.onnx_model = onnx_model
        self.procs: list[subprocess.Popen[bytes]] = []
        self.seq = 0
        self.info: dict[str, Any] = {}

    def __enter__(self) -> TorchRanks:
        self.work.mkdir(parents=True, exist_ok=True)
        np.savez(self.work / "feeds.npz", **minilm_feeds(1, 128))
        config = {
            "feeds": str(self.work / "feeds.npz"),
            "store": str(self.work / "store"),
            "out": str(self.work),
            "onnx_model": str(self.onnx_model),
            "ranges": self.ranges,
        }
        (self.work / "torch.json").write_text(json.dumps(config))
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "GLOO_SOCKET_IFNAME": "lo",
            "MASTER_ADDR": "127.0.0.1",
        }
        script = Path(__file__).with_name("peer_pipelining.py")
        try:
            for rank in range(len(self.ranges)):
                argv = [sys.executable, str(script), "--worker", str(self.work / "torch.json")]
                with open(self.work / f"rank{rank}.log", "wb") as log:
                    self.procs.append(
                        subprocess.Popen(
                            [*argv, "--rank", str(rank)],
                            stdin=subprocess.PIPE if rank == 0 else subprocess.DEVNULL,
                            stdout=log,
                            stderr=subprocess.STDOUT,
                            env=env,
                        )
                    )
            self.info = self._wait_for(self.work / "ready-0", START_TIMEOUT_S)
            for rank in range(1, len(self.ranges)):
                self._wait_for(self.work / f"ready-{rank}", START_TIMEOUT_S)
        except BaseException:
            self._stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop()

    def command(self, op: str, n: int = 0, m: int = 0) -> dict[str, Any]:
        """Send one command to rank 0 and return its reply."""
        stdin = self._stdin()
        stdin.write((json.dumps({"op": op, "n": n, "m": m}) + "\n").encode())
        stdin.flush()
        reply = self._wait_for(self.work / f"reply-{self.seq}.json", COMMAND_TIMEOUT_S)
        self.seq += 1
        return reply

    def _stdin(self) -> IO[bytes]:
        stdin = self.procs[0].stdin
        if stdin is None:
            raise PeerBenchError("rank 0 has no command pipe")
        return stdin

    def _wait_for(self, path: Path, timeout_s: float) -> dict[str, Any]:
        """The JSON in ``path`` once it exists; fails when a rank dies or time runs out."""
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            for rank, proc in enumerate(self.procs):
                if proc.poll() is not None:
                    log = (self.work / f"rank{rank}.log").read_text(errors="replace")
                    raise PeerBenchError(f"torch rank {rank} exited {proc.returncode}:\n{log}")
            if time.monotonic() > deadline:
                raise PeerBenchError(f"no {path.name} from the torch ranks in {timeout_s:.0f} s")
            time.sleep(0.02)
        reply: dict[str, Any] = json.loads(path.read_text())
        return reply

    def _stop(self) -> None:
        """Ask rank 0 to quit (the others follow), then kill any rank still running."""
        if self.procs and self.procs[0].poll() is None and self.procs[0].stdin is not None:
            with contextlib.suppress(BrokenPipeError):  # rank 0 gone: the kill covers it
                self.procs[0].stdin.write(b'{"op": "quit"}\n')
                self.procs[0].stdin.close()
        deadline = time.monotonic() + 30
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
