"""llama.cpp on the same GGUF file, in one process, for ``bench/generate.py``.

llama.cpp runs through node-llama-cpp's prebuilt CPU binary from npm (``make bench-setup``
installs it into ``bench/.node``; it needs ``node`` and ``npm``): the same ggml kernels a user
of llama.cpp gets, without compiling it (llama-cpp-python ships only a source distribution, and
building it did not finish in 75 minutes on these two busy cores). :file:`_llama_cpp.mjs` does the
run. When node or the package is missing, or the file cannot load, :func:`llama_cpp_run`
returns the reason instead of numbers, and the report says so.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
NODE_DIR = HERE / ".node"
RUNNER = HERE / "_llama_cpp.mjs"
TIMEOUT_S = 900.0


@dataclass(frozen=True)
class LlamaRun:
    """One greedy generation: prefill (time to first token), decode tokens/s, resident bytes."""

    ttft_s: float
    tokens: int
    decode_tps: float
    wall_s: float
    resident_bytes: int
    ids: tuple[int, ...] = ()
    """The generated token ids (greedy)."""


def llama_cpp_run(gguf: Path, ids: list[int], tokens: int, threads: int = 1) -> LlamaRun | str:
    """Greedy ``tokens`` new tokens after the prompt ``ids`` (the same ids the other engines
    get) on ``threads`` threads; or why llama.cpp could not run."""
    node = shutil.which("node")
    if node is None:
        return "node is not installed (llama.cpp runs through node-llama-cpp)"
    if not (NODE_DIR / "node_modules" / "node-llama-cpp").is_dir():
        return f"node-llama-cpp is not installed in {NODE_DIR}; run `make bench-setup`"
    request = {"gguf": str(gguf), "ids": ids, "tokens": tokens, "threads": threads}
    # the runner is copied next to node_modules so that node resolves the package from there
    runner = NODE_DIR / RUNNER.name
    shutil.copyfile(RUNNER, runner)
    try:
        done = subprocess.run(
            [node, str(runner)],
            input=json.dumps(request).encode(),
            capture_output=True,
            timeout=TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return f"llama.cpp did not finish within {TIMEOUT_S:.0f} s"
    if done.returncode != 0:
        return f"llama.cpp failed: {done.stderr.decode(errors='replace').strip()[-400:]}"
    reply = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return LlamaRun(
        ttft_s=float(reply["ttft_s"]),
        tokens=int(reply["tokens"]),
        decode_tps=float(reply["decode_tps"]),
        wall_s=float(reply["wall_s"]),
        resident_bytes=int(reply["resident_bytes"]),
        ids=tuple(int(i) for i in reply["ids"]),
    )
