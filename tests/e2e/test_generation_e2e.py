"""Integration: text generation across three real agents, each keeping its own layers' KV cache.

One module-scoped lab on 127.0.0.1: a coordinator and three paired agents; ``tiny-llama``
(random weights, exported by ``fedshard export``) is deployed with ``fedshard deploy`` under caps
that force three segments. Generation through the OpenAI-compatible API is compared token for
token with the whole model in one ONNX Runtime session; the agents' own counters show what one
decode step sends per hop, that ended sessions free their cache, and that sessions beyond the
planned capacity are refused with 429 (and Retry-After) while the running ones finish.
"""

from __future__ import annotations

import concurrent.futures
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from generation_lab import (
    GenLab,
    agent_metric,
    agents_in_stage_order,
    decoder_lab,
    greedy_reference,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MODEL_ID = "tiny-llama"
PROMPT = "The devices of a local network"
AGENT_MEMORY = "512MiB"
CAP = "12MB"
"""Per-device planning cap: the embedding and the output head (7.8 MB each) plus runtime and KV
cache fit on no two devices, so the plan needs all three."""
SESSIONS = 4


@pytest.fixture(scope="module")
def lab(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GenLab]:
    tmp = tmp_path_factory.mktemp("generation-e2e")
    with decoder_lab(tiny_llama_dir, tmp, MODEL_ID, AGENT_MEMORY, CAP) as started:
        yield started


def _complete(api: httpx.Client, max_tokens: int, **extra: object) -> httpx.Response:
    body = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    return api.post("/v1/completions", json={**body, **extra})


def test_three_stages_each_hold_their_own_layers(lab: GenLab) -> None:
    with lab.coordinator.client() as api:
        [record] = [m for m in api.get("/v1/deployments").json() if m["model_id"] == MODEL_ID]
    [live] = [v for v in record["versions"] if v["state"] == "active"]
    assert [p["device"] for p in live["segments"]] == [a.name for a in lab.agents] or len(
        {p["device"] for p in live["segments"]}
    ) == 3
    manifest_path = next(lab.coordinator.state_dir.rglob("manifest.json"))
    manifest = json.loads(manifest_path.read_text())
    held = [[p["past"] for p in s["state"]] for s in manifest["segments"]]
    assert all(held[k] for k in (0, 1, 2)) or sum(map(len, held)) == 8, held
    assert sorted(n for names in held for n in names) == sorted(
        f"past.{i}.{kind}" for i in range(4) for kind in ("key", "value")
    )


def test_greedy_generation_matches_the_whole_model(lab: GenLab) -> None:
    want, count = greedy_reference(lab.export, PROMPT, 32)
    with lab.coordinator.client() as api:
        response = _complete(api, 32)
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["choices"][0]["text"] == want
    assert body["usage"]["completion_tokens"] == count


def test_decode_steps_send_one_hidden_state_per_hop(lab: GenLab) -> None:
    """The middle agent's bytes out per decode step: a frame with the hidden state."""
    middle = agents_in_stage_order(lab, MODEL_ID)[1]
    with lab.coordinator.client() as api:
        plain = {"speculative": "off"}  # one token per step (speculation is on by default)
        assert api.put(f"/v1/deployments/{MODEL_ID}/speculative", json=plain).status_code == 200
        before = agent_metric(lab, middle, "fedshard_bytes_out_total")
        short = _complete(api, 1)
        after_one = agent_metric(lab, middle, "fedshard_bytes_out_total")
        long = _complete(api, 17)
        after_many = agent_metric(lab, middle, "fedshard_bytes_out_total")
        default = {"speculative": "auto"}
        assert api.put(f"/v1/deployments/{MODEL_ID}/speculative", json=default).status_code == 200
    assert short.status_code == long.status_code == 200
    steps = long.json()["usage"]["completion_tokens"] - 1
    per_step = (after_many - after_one - (after_one - before)) / steps
    hidden = 64 * 4
    assert hidden <= per_step < hidden + 1024, per_step


def test_concurrent_sessions_interleave_and_agree(lab: GenLab) -> None:
    want, _ = greedy_reference(lab.export, PROMPT, 24)
    with lab.coordinator.client() as api, concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: _complete(api, 24), range(4)))
    assert [r.status_code for r in results] == [200] * 4
    assert {r.json()["choices"][0]["text"] for r in results} == {want}


def test_streamed_chat_completion(lab: GenLab) -> None:
    body = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": "Say something."}],
        "max_tokens": 8,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks = []
    with (
        lab.coordinator.client() as api,
        api.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                chunks.append(line[len("data: ") :])
    assert chunks[-1] == "[DONE]"
    parsed = [json.loads(c) for c in chunks[:-1]]
    assert parsed[-1]["usage"]["completion_tokens"] >= 1


def test_ended_sessions_free_their_cache_on_every_stage(lab: GenLab) -> None:
    with lab.coordinator.client() as api:
        assert _complete(api, 40).status_code == 200
    for agent in lab.agents:
        assert agent_metric(lab, agent, "fedshard_sessions") == 0
        assert agent_metric(lab, agent, "fedshard_session_state_bytes") == 0


def test_a_flood_beyond_capacity_gets_429_while_running_sessions_finish(lab: GenLab) -> None:
    body = {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": 120, "temperature": 0}
    first_chunk = [concurrent.futures.Future[None]() for _ in range(SESSIONS)]

    def long_stream(k: int) -> int:
        with (
            lab.coordinator.client() as api,
            api.stream("POST", "/v1/completions", json={**body, "stream": True}) as r,
        ):
            for line in r.iter_lines():
                if line.startswith("data: ") and not first_chunk[k].done():
                    first_chunk[k].set_result(None)
            return r.status_code

    with concurrent.futures.ThreadPoolExecutor(SESSIONS + 4) as pool:
        running = [pool.submit(long_stream, k) for k in range(SESSIONS)]
        concurrent.futures.wait(first_chunk, timeout=120)
        with lab.coordinator.client() as api:
            flood = [_complete(api, 4) for _ in range(4)]
        finished = [f.result(timeout=300) for f in running]
    assert finished == [200] * SESSIONS
    refused = [r for r in flood if r.status_code == 429]
    assert refused, [r.status_code for r in flood]
    assert all(r.headers.get("retry-after") for r in refused)
    assert "session" in refused[0].json()["error"]["message"]
