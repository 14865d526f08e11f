"""Integration: speculative decoding across three real agents (``tiny-llama``; prompt lookup, and
``tiny-gemma3`` as a draft model on the coordinator).

Greedy text with speculation (drafts verified in one pass of every stage, rejected positions
rewound on every stage) is the text without it and the text of the whole model in one ONNX
Runtime session, for an editing-style prompt that repeats itself and for free text; drafts were
verified (a random tiny model rarely agrees with them, so most passes are rejected and rewound on
every stage: the hard case for the caches); sessions leave no cache behind; and a real agent
refuses a rewind to a position its session never held.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from generation_lab import GenLab, agent_metric, decoder_lab, greedy_reference

from coordinator.errors import ChainBrokenError
from coordinator.serving.decoder import step_inputs
from coordinator.transport.dataplane import ChainClient, DataPlane, SessionStep
from protocols.decoder import TRAILING_TOP_IDS
from protocols.deploy import Hop

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

MODEL_ID = "tiny-llama"
CAP = "12MB"
"""Forces three segments (see test_generation_e2e.py)."""
EDIT = (
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"
    "# the same functions, renamed:\ndef add(a, b):\n    return a"
)
FREE = "The devices of a local network"
TOKENS = 40


@pytest.fixture(scope="module")
def lab(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GenLab]:
    tmp = tmp_path_factory.mktemp("generation-speculative")
    with decoder_lab(tiny_llama_dir, tmp, MODEL_ID, "512MiB", CAP) as started:
        yield started


def _texts(api: httpx.Client, mode: str, prompts: list[str]) -> list[str]:
    reply = api.put(f"/v1/deployments/{MODEL_ID}/speculative", json={"speculative": mode})
    assert reply.status_code == 200, reply.text
    out = []
    for prompt in prompts:
        body = {"model": MODEL_ID, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0}
        response = api.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        out.append(response.json()["choices"][0]["text"])
    return out


def _console_model(api: httpx.Client) -> dict[str, object]:
    [model] = [m for m in api.get("/v1/console/models").json() if m["model_id"] == MODEL_ID]
    return dict(model)


def test_greedy_text_is_identical_with_and_without_speculation(lab: GenLab) -> None:
    prompts = [EDIT, FREE]
    want = [greedy_reference(lab.export, p, TOKENS)[0] for p in prompts]
    with lab.coordinator.client(timeout=300) as api:
        assert _console_model(api)["speculative"] == "auto"  # on by default
        plain = _texts(api, "off", prompts)
        fast = _texts(api, "lookup", prompts)
        shown = _console_model(api)
    assert plain == want
    assert fast == want
    assert isinstance(shown["drafted_tokens"], int) and shown["drafted_tokens"] > 0
    assert shown["speculation_in_effect"] == "on: prompt lookup drafts"  # probed at export
    assert isinstance(shown["acceptance_rate"], float)
    assert isinstance(shown["tokens_per_s"], float) and shown["tokens_per_s"] > 0
    for agent in lab.agents:  # rewound and ended sessions hold nothing
        assert agent_metric(lab, agent, "fedshard_sessions") == 0
        assert agent_metric(lab, agent, "fedshard_session_state_bytes") == 0


def test_concurrent_speculative_sessions_agree(lab: GenLab) -> None:
    [want] = [greedy_reference(lab.export, EDIT, TOKENS)[0]]
    with (
        lab.coordinator.client(timeout=300) as api,
        concurrent.futures.ThreadPoolExecutor(4) as pool,
    ):
        texts = list(pool.map(lambda _: _texts(api, "auto", [EDIT])[0], range(4)))
    assert texts == [want] * 4


def test_an_agent_refuses_a_rewind_past_what_its_session_held(lab: GenLab) -> None:
    with lab.coordinator.client() as api:
        [record] = [m for m in api.get("/v1/deployments").json() if m["model_id"] == MODEL_ID]
    [live] = [v for v in record["versions"] if v["state"] == "active"]
    chain = [
        Hop(device=p["device"], host=p["host"], data_port=p["data_port"])
        for p in sorted(live["segments"], key=lambda p: p["index"])
    ]
    plane = DataPlane()
    client = ChainClient(plane, chain, live["plan_version"], lab.client_ctx)
    try:
        tokens = [5, 6, 7, 8, 9]

        def call(position: int, ids: list[int], rewind: bool) -> dict[str, np.ndarray]:
            step = SessionStep("rewind-test", position, rewind=rewind)
            return plane.call(client.infer_async(step_inputs(position, ids), 60, step), 90)

        call(0, tokens, False)
        with pytest.raises(ChainBrokenError, match=r"session_state: .*cannot be rewound"):
            call(6, [10], True)
        again = call(3, tokens[3:], True)  # cut back to 3, then the same two tokens
        whole = call(0, tokens, True)  # cut back to nothing: a fresh prefill
        np.testing.assert_array_equal(
            again[TRAILING_TOP_IDS][0, -2:], whole[TRAILING_TOP_IDS][0, -2:]
        )
        plane.call(client.infer_async({}, 60, SessionStep("rewind-test", end=True)), 90)
    finally:
        client.close()
        plane.close()


def test_a_draft_model_keeps_the_greedy_text_across_real_agents(
    lab: GenLab, tiny_gemma3_dir: Path, tmp_path: Path
) -> None:
    """``speculative: draft`` with ``tiny-gemma3`` (same tokenizer, other weights) as the draft
    model, set over the API; a draft with another tokenizer is refused (400)."""
    prompts = [EDIT, FREE]
    want = [greedy_reference(lab.export, p, TOKENS)[0] for p in prompts]
    other = tmp_path / "other"
    shutil.copytree(tiny_gemma3_dir, other)
    data = json.loads((other / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    vocab["cat"], vocab["dog"] = vocab["dog"], vocab["cat"]
    (other / "tokenizer.json").write_text(json.dumps(data))
    route = f"/v1/deployments/{MODEL_ID}/speculative"
    with lab.coordinator.client(timeout=300) as api:
        refused = api.put(route, json={"speculative": "draft", "draft_model": str(other)})
        assert refused.status_code == 400, refused.text
        assert "another tokenizer" in refused.json()["detail"]
        body = {"speculative": "draft", "draft_model": str(tiny_gemma3_dir)}
        assert api.put(route, json=body).status_code == 200
        before = _console_model(api)["drafted_tokens"]
        fast = _texts(api, "draft", prompts)
        shown = _console_model(api)
        concurrent = [_texts(api, "auto", [EDIT])[0] for _ in range(2)]
    assert fast == want
    assert concurrent == [want[0]] * 2
    assert isinstance(shown["drafted_tokens"], int) and isinstance(before, int)
    assert shown["drafted_tokens"] > before
