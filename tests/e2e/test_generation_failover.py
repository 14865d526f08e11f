"""Integration: a generation survives losing the agent that holds part of its KV cache.

Three real agents serve ``tiny-llama`` under caps that let any two of them hold it. A long
greedy generation is streamed; after some tokens the agent holding the decoder layers (and so the
session's KV cache) is killed with SIGKILL. The coordinator notices, re-plans on the two agents
left, and the session replays its tokens on the new chain to rebuild the cache (as Petals does):
the streamed text is the one an uninterrupted greedy run produces. Speculative decoding is on (the
default): the stage is lost between verifying passes, and the replay rebuilds only the accepted
tokens (a unit test in test_generation_speculative.py loses it on a pass that carries drafts).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from generation_lab import GenLab, decoder_lab, greedy_reference, kill_at_piece, stream_completion

from coordinator.deploy.store import segment_dir
from protocols.manifest import MANIFEST_FILE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL_ID = "tiny-llama"
PROMPT = "The devices of a local network"
CAP = "24MB"
"""Room for the embedding, the output head and every layer on any two devices."""
TOKENS = 96


@pytest.fixture(scope="module")
def lab(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GenLab]:
    tmp = tmp_path_factory.mktemp("generation-failover")
    with decoder_lab(tiny_llama_dir, tmp, MODEL_ID, "512MiB", CAP) as started:
        yield started


def _stateful_device(lab: GenLab) -> str:
    live = lab.coordinator.api().active_version(MODEL_ID)
    manifest_path = segment_dir(lab.coordinator.state_dir, MODEL_ID, live.plan_version)
    manifest = json.loads((manifest_path / MANIFEST_FILE).read_text())
    holders = [s["device"] for s in manifest["segments"] if s["state"]]
    assert holders, manifest
    return str(holders[0])


def test_a_stream_survives_losing_the_stage_with_its_cache(lab: GenLab) -> None:
    want, _ = greedy_reference(lab.export, PROMPT, TOKENS)
    victim_name = _stateful_device(lab)
    victim = next(a for a in lab.agents if a.name == victim_name)
    body = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
    killed = threading.Event()
    status, text = stream_completion(lab, body, kill_at_piece(victim, 12, killed))
    assert killed.is_set()
    assert (status, text) == (200, want)
    with lab.coordinator.client() as api:
        [shown] = [m for m in api.get("/v1/console/models").json() if m["model_id"] == MODEL_ID]
        assert shown["speculative"] == "auto" and shown["tokens_per_s"] is not None
        [record] = [m for m in api.get("/v1/deployments").json() if m["model_id"] == MODEL_ID]
    [live] = [v for v in record["versions"] if v["state"] == "active"]
    assert victim_name not in {p["device"] for p in live["segments"]}
