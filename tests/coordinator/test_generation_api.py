"""The OpenAI-compatible generation API on the coordinator app, over a fake bigram backend:
greedy and seeded sampling, stop strings (never leaked into a stream), limits and usage, the SSE
format, OpenAI error bodies, 429 + Retry-After, one ``end()`` per generation whatever happens,
and concurrent generations interleaving their steps."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator, MutableMapping
from pathlib import Path
from typing import Any, Protocol

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from generation_helpers import BOS, EOS, BigramBackend, bigram_table, tiny_model, word_id

from coordinator.fleet.registry import DeviceRegistry
from coordinator.generation.backend import GenerationModel
from coordinator.http.app import Services, create_app
from coordinator.trust.ca import CertificateAuthority
from coordinator.trust.pairing import Pairing

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CHAIN = [" the", " cat", " sat", " on", " a", " red", " mat"]
HELLO = [{"role": "user", "content": "hello"}]


class Reply(Protocol):
    """An HTTP response from TestClient or httpx.AsyncClient (different httpx builds)."""

    @property
    def status_code(self) -> int: ...

    @property
    def text(self) -> str: ...

    @property
    def headers(self) -> Any: ...

    def json(self) -> Any: ...


def _app(tmp_path: Path, backend: BigramBackend, **info: Any) -> FastAPI:
    model = tiny_model(backend, **info)
    models: dict[str, GenerationModel] = {"tiny": model}
    services = Services(
        token=TOKEN,
        registry=DeviceRegistry(),
        pairing=Pairing(tmp_path, CertificateAuthority.open(tmp_path)),
        generation=models.get,
    )
    return create_app(services)


@pytest.fixture
def chain() -> BigramBackend:
    return BigramBackend(bigram_table(chain=CHAIN))


@pytest.fixture
def client(tmp_path: Path, chain: BigramBackend) -> Iterator[TestClient]:
    with TestClient(_app(tmp_path, chain), raise_server_exceptions=False) as c:
        yield c


def _chat(client: TestClient, **body: Any) -> Reply:
    return client.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": HELLO, **body}, headers=AUTH
    )


def _sse(response: Reply) -> list[dict[str, Any]]:
    """Parse an event stream the way a plain client does; it must end with [DONE]."""
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    blocks = response.text.split("\n\n")
    assert blocks[-2:] == ["data: [DONE]", ""]
    assert all(b.startswith("data: ") and "\n" not in b for b in blocks[:-1])
    return [json.loads(b.removeprefix("data: ")) for b in blocks[:-2]]


def _streamed_text(chunks: list[dict[str, Any]]) -> str:
    out = []
    for chunk in chunks:
        for choice in chunk.get("choices", []):
            out.append(
                choice["delta"].get("content") or "" if "delta" in choice else choice["text"]
            )
    return "".join(out)


def _prompt(chain: BigramBackend) -> list[int]:
    """The prompt ids of the backend's first session (what the prefill step received)."""
    return chain.steps[0][2]


# ------------------------------------------------------------------- results


def test_greedy_chat_completion_text_usage_and_length(
    client: TestClient, chain: BigramBackend
) -> None:
    r = _chat(client, temperature=0, max_tokens=5)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == "tiny"
    assert body["id"].startswith("chatcmpl-")
    choice = body["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": " the cat sat on a"}
    assert choice["finish_reason"] == "length"
    prompt = _prompt(chain)
    assert prompt == [BOS, *b"<user>hello\n<assistant>"]  # the template's BOS only
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 5,
                             "total_tokens": len(prompt) + 5}  # fmt: skip
    assert chain.ended == [body["id"]]  # one session per generation, ended once


def test_completions_with_text_and_token_prompts(tmp_path: Path) -> None:
    backend = BigramBackend(bigram_table(seed=4))
    with TestClient(_app(tmp_path, backend)) as client:
        r = client.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": "Once", "temperature": 0, "max_tokens": 6},
            headers=AUTH,
        )
        body = r.json()
        assert body["object"] == "text_completion"
        expected = backend.greedy(backend.steps[0][2], 6)
        model = tiny_model(backend)
        assert body["choices"][0]["text"] == model.tokenizer.decode(expected)
        assert body["usage"]["prompt_tokens"] == 5  # BOS + 4 bytes
        ids = client.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": [word_id(" dog")], "temperature": 0},
            headers=AUTH,
        ).json()
        assert ids["usage"] == {"prompt_tokens": 1, "completion_tokens": 16, "total_tokens": 17}
        assert [p for _, p, _ in backend.steps[-16:]] == list(range(16))  # 16 tokens, 15 fed
        bad = client.post(
            "/v1/completions", json={"model": "tiny", "prompt": [10**6]}, headers=AUTH
        )
        assert bad.status_code == 400 and "token ids" in bad.json()["error"]["message"]


def test_eos_finishes_with_stop(tmp_path: Path) -> None:
    table = bigram_table(chain=[" big", " dog"])
    table[word_id(" dog"), EOS] = 200.0
    backend = BigramBackend(table)
    with TestClient(_app(tmp_path, backend)) as client:
        body = _chat(client, temperature=0).json()
    assert body["choices"][0]["message"]["content"] == " big dog"
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] == 3


def test_seeded_sampling_is_reproducible_and_seeds_differ(tmp_path: Path) -> None:
    backend = BigramBackend(bigram_table(seed=9))
    with TestClient(_app(tmp_path, backend)) as client:

        def text(seed: int) -> str:
            r = _chat(client, seed=seed, temperature=1.3, max_tokens=12)
            return str(r.json()["choices"][0]["message"]["content"])

        assert text(7) == text(7)
        assert len({text(s) for s in range(6)}) > 1
        greedy = _chat(client, temperature=0, max_tokens=12).json()
        nucleus = _chat(client, top_p=0.01, max_tokens=12).json()  # keeps the top token only
        assert greedy["choices"][0]["message"] == nucleus["choices"][0]["message"]


def test_stop_split_across_tokens_is_never_streamed(
    client: TestClient, chain: BigramBackend
) -> None:
    plain = _chat(client, temperature=0, max_tokens=7, stop=["t on", "zz"]).json()
    assert plain["choices"][0]["message"]["content"] == " the cat sa"
    assert plain["choices"][0]["finish_reason"] == "stop"
    assert plain["usage"]["completion_tokens"] == 4
    chunks = _sse(_chat(client, temperature=0, max_tokens=7, stop="t on", stream=True))
    assert _streamed_text(chunks) == " the cat sa"  # not even the "t" of "t on" leaked
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
    assert len(chain.ended) == 2


# ------------------------------------------------------------------- streaming


def test_chat_stream_format_with_usage(client: TestClient, chain: BigramBackend) -> None:
    chunks = _sse(
        _chat(client, temperature=0, max_tokens=4, stream=True,
              stream_options={"include_usage": True})
    )  # fmt: skip
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    deltas = [c["choices"][0]["delta"]["content"] for c in chunks[1:-2]]
    assert deltas == [" the", " cat", " sat", " on"]
    assert chunks[-2]["choices"][0] == {
        "index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"
    }  # fmt: skip
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-1]["choices"] == []
    prompt = len(_prompt(chain))
    assert chunks[-1]["usage"] == {
        "prompt_tokens": prompt, "completion_tokens": 4, "total_tokens": prompt + 4
    }  # fmt: skip


def test_completion_stream_without_usage(client: TestClient) -> None:
    r = client.post(
        "/v1/completions",
        json={"model": "tiny", "prompt": "x", "temperature": 0, "max_tokens": 3, "stream": True},
        headers=AUTH,
    )
    chunks = _sse(r)
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert all("usage" not in c for c in chunks)
    assert [c["choices"][0]["text"] for c in chunks] == [" the", " cat", " sat", ""]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


# ------------------------------------------------------------------- errors


def _error(r: Reply, status: int) -> dict[str, Any]:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and {"message", "type", "code"} <= set(body["error"])
    assert "Traceback" not in r.text
    error: dict[str, Any] = body["error"]
    return error


def test_token_unknown_model_and_bad_requests(client: TestClient, chain: BigramBackend) -> None:
    no_token = client.post("/v1/chat/completions", json={"model": "tiny", "messages": HELLO})
    assert _error(no_token, 401)["code"] == "invalid_api_key"
    assert no_token.headers["www-authenticate"] == "Bearer"
    unknown = client.post(
        "/v1/chat/completions", json={"model": "gpt-9", "messages": HELLO}, headers=AUTH
    )
    assert _error(unknown, 404)["code"] == "model_not_found"
    assert _error(_chat(client, temperature=3), 400)["param"] == "temperature"
    assert "n must be 1" in _error(_chat(client, n=2), 400)["message"]
    assert "at most 4" in _error(_chat(client, stop=list("abcde")), 400)["message"]
    assert _error(_chat(client, frobnicate=1), 400)["param"] == "frobnicate"
    assert "logprobs" in _error(_chat(client, logprobs=True), 400)["message"]
    too_long = _error(_chat(client, max_tokens=250), 400)
    assert too_long["code"] == "context_length_exceeded"
    tool = [{"role": "tool", "content": "x"}]
    refused = _chat(client, messages=tool)
    assert "no tools here" in _error(refused, 400)["message"]
    garbage = client.post(
        "/v1/chat/completions",
        content=b"{not json",
        headers={**AUTH, "content-type": "application/json"},
    )
    _error(garbage, 400)
    assert chain.steps == [] and chain.ended == []


def test_capacity_is_429_with_retry_after(tmp_path: Path) -> None:
    backend = BigramBackend(bigram_table(), capacity=2.3)
    with TestClient(_app(tmp_path, backend)) as client:
        for stream in (False, True):
            r = _chat(client, stream=stream)
            assert _error(r, 429)["code"] == "overloaded"
            assert r.headers["retry-after"] == "3"
    assert len(backend.ended) == 2 and len(set(backend.ended)) == 2


def test_failures_end_the_session_once_and_never_leak_a_trace(tmp_path: Path) -> None:
    backend = BigramBackend(bigram_table(chain=CHAIN), fail_at=3)
    with TestClient(_app(tmp_path, backend), raise_server_exceptions=False) as client:
        assert _error(_chat(client, temperature=0), 502)["code"] == "backend_error"
        chunks = _sse(_chat(client, temperature=0, stream=True))
        assert _streamed_text(chunks) == " the cat"
        assert chunks[-1]["error"]["message"] == "stage 2 went away"
        backend.fail_with = RuntimeError("secret internals")
        crash = _error(_chat(client, temperature=0), 500)
        assert "secret" not in crash["message"]
        chunks = _sse(_chat(client, temperature=0, stream=True))
        assert chunks[-1]["error"]["message"].startswith("internal error")
    assert len(backend.ended) == 4 and len(set(backend.ended)) == 4


# ------------------------------------------------------------------- concurrency


def test_concurrent_generations_interleave(tmp_path: Path) -> None:
    backend = BigramBackend(bigram_table(seed=5), delay_s=0.005)
    app = _app(tmp_path, backend)
    prompts = ["a", "bb", "ccc", "dddd"]

    async def run_all() -> list[dict[str, Any]]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:

            async def one(prompt: str, stream: bool) -> dict[str, Any]:
                body = {"model": "tiny", "prompt": prompt, "temperature": 0,
                        "max_tokens": 10, "stream": stream}  # fmt: skip
                r = await c.post("/v1/completions", json=body, headers=AUTH)
                if stream:
                    return {"text": _streamed_text(_sse(r))}
                return {"text": r.json()["choices"][0]["text"]}

            jobs = [one(p, stream=i % 2 == 1) for i, p in enumerate(prompts)]
            return list(await asyncio.gather(*jobs))

    results = asyncio.run(run_all())
    assert backend.max_active == len(prompts)
    order = [session for session, _, _ in backend.steps]
    switches = sum(a != b for a, b in itertools.pairwise(order))
    assert switches > 3 * len(prompts)  # steps alternate, not one generation after another
    model = tiny_model(backend)
    for prompt, result in zip(prompts, results, strict=True):
        ids = model.tokenizer.encode_prompt(prompt)
        assert result["text"] == model.tokenizer.decode(backend.greedy(ids, 10))
    assert sorted(backend.ended) == sorted(set(order))


def test_client_disconnect_ends_the_session(tmp_path: Path) -> None:
    backend = BigramBackend(bigram_table(seed=2), delay_s=0.01)
    app = _app(tmp_path, backend)
    body = json.dumps(
        {"model": "tiny", "messages": HELLO, "max_tokens": 200, "stream": True}
    ).encode()
    sent: list[MutableMapping[str, Any]] = []

    async def call() -> None:
        first_chunk = asyncio.Event()
        requested = False

        async def receive() -> dict[str, Any]:
            nonlocal requested
            if not requested:
                requested = True
                return {"type": "http.request", "body": body, "more_body": False}
            await first_chunk.wait()
            return {"type": "http.disconnect"}

        async def send(message: MutableMapping[str, Any]) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and message.get("body"):
                first_chunk.set()
                await asyncio.sleep(5)  # the client leaves while this chunk is being sent

        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
            "query_string": b"", "root_path": "", "client": ("127.0.0.1", 5000),
            "server": ("127.0.0.1", 80),
            "headers": [(b"authorization", f"Bearer {TOKEN}".encode()),
                        (b"content-type", b"application/json")],
        }  # fmt: skip
        await asyncio.wait_for(app(scope, receive, send), timeout=3)
        ended.extend(backend.ended)  # before asyncio.run closes leftover generators

    ended: list[str] = []
    asyncio.run(call())
    assert sent[0]["status"] == 200
    assert not any(b"[DONE]" in m.get("body", b"") for m in sent)
    assert ended == [backend.steps[0][0]] and backend.ended == ended
    assert len(backend.steps) < 20  # stopped right after the client left, not after 200 tokens
