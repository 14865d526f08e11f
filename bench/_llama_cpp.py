"""llama.cpp on the same GGUF file, in one process, for ``bench/generate.py``.

``llama-cpp-python`` is the benchmark's own dependency (``pip install 'fedshard[bench]'``, or
``make bench-setup``): it builds llama.cpp from source. When it is missing or cannot load the
file, :func:`llama_cpp_run` returns the reason instead of numbers, and the report says so.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LlamaRun:
    """One greedy generation: prefill (time to first token), decode tokens/s, resident bytes."""

    ttft_s: float
    tokens: int
    decode_tps: float
    wall_s: float
    resident_bytes: int


def llama_cpp_run(gguf: Path, ids: list[int], tokens: int, threads: int = 1) -> LlamaRun | str:
    """Greedy ``tokens`` new tokens after the prompt ``ids`` (the same ids the other engines
    get), one thread; or why llama.cpp could not run."""
    try:
        from llama_cpp import Llama
    except ImportError as exc:
        return f"llama-cpp-python is not installed ({exc}); run `make bench-setup`"
    model = Llama(
        model_path=str(gguf),
        n_ctx=max(512, len(ids) + tokens + 8),
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=512,
        verbose=False,
    )
    model.eval(ids[:4])  # warm up
    model.reset()
    start = time.perf_counter()
    model.eval(ids)
    token = _greedy(model)
    ttft = time.perf_counter() - start
    decode_start = time.perf_counter()
    for _ in range(tokens - 1):
        model.eval([token])
        token = _greedy(model)
    decode = time.perf_counter() - decode_start
    resident = rss_bytes()
    model.close()
    return LlamaRun(ttft, tokens, (tokens - 1) / decode, time.perf_counter() - start, resident)


def rss_bytes() -> int:
    """This process's resident memory (``VmRSS``; the mapped GGUF pages count)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def _greedy(model: object) -> int:
    import numpy as np

    logits = model.scores[model.n_tokens - 1]  # type: ignore[attr-defined]
    return int(np.argmax(logits))
