"""llama.cpp on the same GGUF file, in one process, for ``bench/generate.py``,
``bench/gguf_speed.py``, ``bench/gguf_scale_deploy.py`` (greedy generation) and
``bench/gguf_agreement.py`` (teacher-forced scores and logits).

llama.cpp runs through node-llama-cpp's prebuilt CPU binary from npm (``make bench-setup``
installs it into ``bench/.node``; it needs ``node`` and ``npm``): the same ggml kernels a user
of llama.cpp gets, without compiling it (llama-cpp-python ships only a source distribution, and
building it did not finish in 75 minutes on these two busy cores). :file:`_llama_cpp.mjs` does the
run (both modes). When node or the package is missing, or the file cannot load,
:func:`llama_cpp_run` returns the reason instead of numbers, and the report says so.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


@dataclass(frozen=True)
class LlamaScores:
    """One teacher-forced pass: llama.cpp's tokenization, its top-1 after each position and
    the log-probability of the text's next token."""

    ids: tuple[int, ...]
    top: tuple[int, ...]
    logprob: tuple[float, ...]
    resident_bytes: int


def llama_cpp_run(gguf: Path, ids: list[int], tokens: int, threads: int = 1) -> LlamaRun | str:
    """Greedy ``tokens`` new tokens after the prompt ``ids`` (the same ids the other engines
    get) on ``threads`` threads; or why llama.cpp could not run."""
    reply = _node({"gguf": str(gguf), "ids": ids, "tokens": tokens, "threads": threads})
    if isinstance(reply, str):
        return reply
    return LlamaRun(
        ttft_s=float(reply["ttft_s"]),
        tokens=int(reply["tokens"]),
        decode_tps=float(reply["decode_tps"]),
        wall_s=float(reply["wall_s"]),
        resident_bytes=int(reply["resident_bytes"]),
        ids=tuple(int(i) for i in reply["ids"]),
    )


def llama_cpp_score(
    gguf: Path,
    text: str,
    max_tokens: int,
    threads: int = 1,
    batch_size: int = 512,
    logits: Path | None = None,
    vocab: int = 0,
) -> LlamaScores:
    """``text`` tokenized by llama.cpp with the file's own tokenizer (its first ``max_tokens``
    ids) and scored teacher-forced, ``batch_size`` tokens per evaluation (512: the text in one
    pass; 1: one token at a time, as decoding runs); with ``logits``, every position's
    ``vocab`` logits written there (float32, ``[n - 1, vocab]``). Raises ``SystemExit`` when
    llama.cpp cannot run."""
    request: dict[str, object] = {
        "gguf": str(gguf),
        "mode": "score",
        "text": text,
        "max_tokens": max_tokens,
        "threads": threads,
        "batch_size": batch_size,
    }
    if logits is not None:
        request |= {"logits_path": str(logits), "vocab": vocab}
    reply = _node(request)
    if isinstance(reply, str):
        raise SystemExit(reply)
    return LlamaScores(
        ids=tuple(int(i) for i in reply["ids"]),
        top=tuple(int(t) for t in reply["top"]),
        logprob=tuple(float(x) for x in reply["logprob"]),
        resident_bytes=int(reply["resident_bytes"]),
    )


def _node(request: dict[str, object]) -> dict[str, Any] | str:
    """One request to :file:`_llama_cpp.mjs`: its reply, or why llama.cpp could not run."""
    node = shutil.which("node")
    if node is None:
        return "node is not installed (llama.cpp runs through node-llama-cpp)"
    if not (NODE_DIR / "node_modules" / "node-llama-cpp").is_dir():
        return f"node-llama-cpp is not installed in {NODE_DIR}; run `make bench-setup`"
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
    reply: dict[str, Any] = json.loads(done.stdout.decode().strip().splitlines()[-1])
    return reply
