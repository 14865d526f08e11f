"""Integration: a Qwen2.5-Coder-1.5B-Instruct int4 stream survives losing an agent that holds
part of its KV cache.

Five real agents of 512 MiB (no planning caps: none could hold half of the model's 1.1 GB of
weights, and the plan with the sessions' KV cache needs about 1.8 GB, so any four hold it). A
long greedy generation is streamed; after a few tokens an agent holding decoder layers, and so
part of the session's KV cache, is killed with SIGKILL. The coordinator frees the broken
version's segments on the agents left (the model fills them: the re-plan would not fit beside
its own broken copy), re-plans on the four, and the session replays its tokens on the new chain:
the streamed text is the one an uninterrupted greedy run of the whole model in one ONNX Runtime
session gives.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from generation_lab import (
    GenLab,
    decoder_lab,
    greedy_reference,
    kill_at_piece,
    live_version,
    stream_completion,
)

pytestmark = [pytest.mark.slow, pytest.mark.heavy, pytest.mark.timeout(3600)]

MODEL_ID = "qwen2.5-coder-1.5b"
AGENTS = 5
AGENT_MEMORY = "512MiB"
PROMPT = "def fibonacci(n):"
TOKENS = 40


@pytest.fixture(scope="module")
def lab(qwen_int4_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GenLab]:
    tmp = tmp_path_factory.mktemp("qwen-failover")
    with decoder_lab(qwen_int4_dir, tmp, MODEL_ID, AGENT_MEMORY, None, AGENTS) as started:
        yield started


def test_a_stream_survives_losing_a_stage_with_its_cache(lab: GenLab) -> None:
    want, _ = greedy_reference(lab.export, PROMPT, TOKENS)
    before = live_version(lab, MODEL_ID)["segments"]
    victim_name = next(p["device"] for p in before if p["state_bytes"] > 0)
    victim = next(a for a in lab.agents if a.name == victim_name)
    body = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
    killed = threading.Event()
    status, text = stream_completion(lab, body, kill_at_piece(victim, 8, killed))
    assert killed.is_set()
    assert (status, text) == (200, want)
    after = live_version(lab, MODEL_ID)["segments"]
    assert victim_name not in {p["device"] for p in after}
    assert len({p["device"] for p in after}) >= 2
