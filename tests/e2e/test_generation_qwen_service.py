"""Integration: what fedshard does for Gemma, done for the real Qwen2.5-Coder-1.5B-Instruct int4.

Four real agents of 1 GiB on 127.0.0.1, each under a planning cap of 45 % of the model's weights
(as ``make demo`` deploys it: no agent holds half of it), serve it to a real coordinator:

- concurrent sessions interleave and each equals the whole model in one ONNX Runtime session;
- beyond the sessions the stages reserve KV cache for, requests get 429 with ``Retry-After``
  while the running sessions finish;
- a redeploy goes live under a running stream (two versions side by side: what the 1 GiB
  budgets are for), and a rollback returns to the first version, with no failed request.

Failover with KV replay is in ``test_generation_qwen_failover.py`` (five 512 MiB agents).
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from generation_lab import (
    GenLab,
    agent_metric,
    decoder_lab,
    greedy_reference,
    live_version,
    stream_completion,
)

pytestmark = [pytest.mark.slow, pytest.mark.heavy, pytest.mark.timeout(3600)]

MODEL_ID = "qwen2.5-coder-1.5b"
AGENT_MEMORY = "1GiB"
CAP_SHARE = 0.45
"""The demo's planning cap per agent, as a share of the model's weights."""
PROMPT = "def fibonacci(n):"
SESSIONS = 4
"""What the stages reserve KV cache for (the default session limits)."""


def _weights_bytes(export: Path) -> int:
    return sum(f.stat().st_size for f in export.iterdir() if f.name.startswith("model.onnx"))


def _cap(export: Path) -> str:
    return f"{int(CAP_SHARE * _weights_bytes(export) / 1e6)}MB"


@pytest.fixture(scope="module")
def lab(qwen_int4_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GenLab]:
    tmp = tmp_path_factory.mktemp("qwen-service")
    cap = _cap(qwen_int4_dir)
    with decoder_lab(qwen_int4_dir, tmp, MODEL_ID, AGENT_MEMORY, cap, agents=4) as started:
        yield started


@pytest.fixture(scope="module")
def reference(lab: GenLab) -> Callable[[int], str]:
    """The whole model's greedy text in one ONNX Runtime session, by token count (memoized)."""
    texts: dict[int, str] = {}

    def text(tokens: int) -> str:
        if tokens not in texts:
            texts[tokens] = greedy_reference(lab.export, PROMPT, tokens)[0]
        return texts[tokens]

    return text


def _body(max_tokens: int) -> dict[str, object]:
    return {"model": MODEL_ID, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}


def _complete(api: httpx.Client, max_tokens: int) -> httpx.Response:
    return api.post("/v1/completions", json=_body(max_tokens))


def test_no_agent_holds_half_of_it_and_each_stage_keeps_its_layers_cache(lab: GenLab) -> None:
    half = _weights_bytes(lab.export) / 2
    segments = live_version(lab, MODEL_ID)["segments"]
    assert len(segments) >= 3
    for p in segments:
        assert p["param_bytes"] < half, p
    assert sum(1 for p in segments if p["state_bytes"] > 0) >= 2, segments


def test_concurrent_sessions_each_equal_one_session(
    lab: GenLab, reference: Callable[[int], str]
) -> None:
    want = reference(16)
    with (
        lab.coordinator.client(timeout=900) as api,
        concurrent.futures.ThreadPoolExecutor(SESSIONS) as pool,
    ):
        results = list(pool.map(lambda _: _complete(api, 16), range(SESSIONS)))
    assert [r.status_code for r in results] == [200] * SESSIONS, [r.text for r in results]
    assert {r.json()["choices"][0]["text"] for r in results} == {want}
    for agent in lab.agents:
        assert agent_metric(lab, agent, "fedshard_session_state_bytes") == 0


def test_beyond_capacity_429_while_running_sessions_finish(lab: GenLab) -> None:
    first_piece = [threading.Event() for _ in range(SESSIONS)]

    def long_stream(k: int) -> int:
        return stream_completion(lab, _body(48), lambda n: first_piece[k].set())[0]

    with concurrent.futures.ThreadPoolExecutor(SESSIONS) as pool:
        running = [pool.submit(long_stream, k) for k in range(SESSIONS)]
        assert all(e.wait(600) for e in first_piece)
        with lab.coordinator.client(timeout=120) as api:
            flood = [_complete(api, 4) for _ in range(4)]
        finished = [f.result(timeout=900) for f in running]
    assert finished == [200] * SESSIONS
    refused = [r for r in flood if r.status_code == 429]
    assert refused, [(r.status_code, r.text) for r in flood]
    assert all(r.headers.get("retry-after") for r in refused)


def test_redeploy_under_a_stream_then_rollback_fail_nothing(
    lab: GenLab, reference: Callable[[int], str]
) -> None:
    first = live_version(lab, MODEL_ID)["plan_version"]
    redeployed: list[str] = []

    def redeploy_once(n: int) -> None:
        if n == 4 and not redeployed:
            args = ["deploy", str(lab.export / "model.onnx"), "--name", MODEL_ID]
            args += ["--tokenizer", str(lab.export)]
            for agent in lab.agents:
                args += ["--memory-cap", f"{agent.name}={_cap(lab.export)}"]
            done = lab.coordinator.cli(*args)
            redeployed.append(done.stdout + done.stderr)
            assert done.returncode == 0, redeployed[-1] + lab.coordinator.log()[-4000:]

    status, text = stream_completion(lab, _body(32), redeploy_once)
    assert redeployed, "the stream ended before the redeploy"
    assert (status, text) == (200, reference(32))
    second = live_version(lab, MODEL_ID)["plan_version"]
    assert second > first
    with lab.coordinator.client(timeout=120) as api:
        back = api.post(f"/v1/deployments/{MODEL_ID}/rollback")
        assert back.status_code == 200, back.text
        assert live_version(lab, MODEL_ID)["plan_version"] == first
        answer = _complete(api, 32)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == reference(32)
