"""Integration: the real Gemma 3 270M split across three agents generates exactly what
transformers' ``generate`` does on the unsharded model.

A coordinator and three agents on 127.0.0.1; planning caps (80% of the weights each) that no two
devices can meet, because the tied embedding is held by both the first and the last stage. The
test compares 32 greedy tokens token for token, shows that a decode step hands one hidden state
(640 float32 values) per hop, and that ending sessions frees their cache on every stage.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_helpers import AgentProc
from generation_lab import GenLab, agent_metric, agents_in_stage_order, decoder_lab

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

MODEL_ID = "gemma3-270m"
QUESTION = "What is the capital of France? Answer in one sentence."
HIDDEN_BYTES = 640 * 4


@pytest.fixture(scope="module")
def lab(gemma_export_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GenLab]:
    cap = f"{int(0.8 * (gemma_export_dir / 'model.onnx').stat().st_size)}"
    tmp = tmp_path_factory.mktemp("gemma-e2e")
    with decoder_lab(gemma_export_dir, tmp, MODEL_ID, "2GiB", cap) as started:
        yield started


def _chat(lab: GenLab, max_tokens: int, question: str = QUESTION) -> dict:  # type: ignore[type-arg]
    body = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "temperature": 0,
    }
    with lab.coordinator.client(timeout=600) as api:
        response = api.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()  # type: ignore[no-any-return]


def _reference_ids(lab: GenLab, max_tokens: int) -> tuple[list[int], list[int]]:
    """The prompt's ids as the coordinator renders them, and transformers' greedy answer."""
    from coordinator.generation.tokenizer import ChatTokenizer
    from partitioner.models.decoders.progress import Steps
    from partitioner.models.decoders.reference import transformers_greedy
    from partitioner.models.decoders.sources import load_source
    from protocols.decoder import DecoderInfo

    info = DecoderInfo.from_json((lab.export / "decoder.json").read_bytes())
    tokenizer = ChatTokenizer.from_file(lab.export, info)
    prompt = tokenizer.encode(tokenizer.render_chat([{"role": "user", "content": QUESTION}]))
    cache = Path(__file__).resolve().parents[2] / ".cache" / "fedshard"
    model = load_source(MODEL_ID, cache, Steps()).model
    return prompt, transformers_greedy(model, prompt, max_tokens, info.eos_token_ids)


def test_the_plan_uses_three_devices(lab: GenLab) -> None:
    with lab.coordinator.client() as api:
        [record] = [m for m in api.get("/v1/deployments").json() if m["model_id"] == MODEL_ID]
    [live] = [v for v in record["versions"] if v["state"] == "active"]
    assert len({p["device"] for p in live["segments"]}) == 3


def test_32_greedy_tokens_equal_transformers_generate(lab: GenLab) -> None:
    prompt, want = _reference_ids(lab, 32)
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(lab.export / "tokenizer.json"))
    body = _chat(lab, 32)
    text = body["choices"][0]["message"]["content"]
    assert body["usage"]["prompt_tokens"] == len(prompt)
    assert body["usage"]["completion_tokens"] == len(want)
    eos = set(tokenizer.token_to_id(t) or -1 for t in ("<end_of_turn>", "<eos>"))
    assert text == tokenizer.decode([t for t in want if t not in eos])
    assert len(want) >= 8  # a real answer, not an immediate end of turn


def _speculative(lab: GenLab, mode: str) -> None:
    with lab.coordinator.client() as api:
        answer = api.put(f"/v1/deployments/{MODEL_ID}/speculative", json={"speculative": mode})
    assert answer.status_code == 200, answer.text


def test_a_decode_step_hands_one_hidden_state_per_hop(lab: GenLab) -> None:
    first, middle, _ = agents_in_stage_order(lab, MODEL_ID)
    _speculative(lab, "off")  # one token per step (speculation is on by default)
    try:
        before = {a.name: agent_metric(lab, a, "fedshard_bytes_out_total") for a in (first, middle)}
        short = _chat(lab, 1)["usage"]["completion_tokens"]
        mid = {a.name: agent_metric(lab, a, "fedshard_bytes_out_total") for a in (first, middle)}
        long = _chat(lab, 9)["usage"]["completion_tokens"]
        after = {a.name: agent_metric(lab, a, "fedshard_bytes_out_total") for a in (first, middle)}
    finally:
        _speculative(lab, "auto")
    assert short == 1 and long > 2
    for agent in (first, middle):
        prefill = mid[agent.name] - before[agent.name]
        per_step = (after[agent.name] - mid[agent.name] - prefill) / (long - 1)
        assert HIDDEN_BYTES <= per_step < HIDDEN_BYTES + 1024, (agent.name, per_step)


def _four_sessions(lab: GenLab, watched: AgentProc) -> tuple[list[dict], float]:  # type: ignore[type-arg]
    """Four concurrent 48-token chats; their answers and ``watched``'s peak session state."""
    peak = 0.0
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        running = [pool.submit(_chat, lab, 48, f"Count to {k + 20}.") for k in range(4)]
        while not all(f.done() for f in running):
            peak = max(peak, agent_metric(lab, watched, "fedshard_session_state_bytes"))
        return [f.result() for f in running], peak


def test_sessions_free_their_cache_and_memory_returns(lab: GenLab) -> None:
    # ORT's arena grows (in power-of-two chunks) to the longest sequence it has run and then
    # keeps that workspace: the same workload once first sizes it, so what is compared below
    # is what the sessions themselves leave behind.
    _four_sessions(lab, agents_in_stage_order(lab, MODEL_ID)[1])
    baseline = [agent_metric(lab, a, "fedshard_resident_memory_bytes") for a in lab.agents]
    answers, peak = _four_sessions(lab, agents_in_stage_order(lab, MODEL_ID)[1])
    assert all(a["usage"]["completion_tokens"] > 0 for a in answers)
    assert peak > 0  # the middle stage did hold the sessions' cache meanwhile
    for agent, start in zip(lab.agents, baseline, strict=True):
        assert agent_metric(lab, agent, "fedshard_sessions") == 0
        assert agent_metric(lab, agent, "fedshard_session_state_bytes") == 0
        now = agent_metric(lab, agent, "fedshard_resident_memory_bytes")
        assert now <= start * 1.05, (agent.name, start, now)
