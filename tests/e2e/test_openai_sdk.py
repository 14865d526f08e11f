"""Integration: the official ``openai`` package, with its defaults, against fedshard.

One module-scoped cluster on 127.0.0.1: a coordinator and two paired agents (real processes,
TLS, ONNX Runtime); MiniLM is deployed under caps that force two segments, and ``tiny-llama``
(random weights) beside it. The SDK's own client (retries off, so 429 and 503 come back at
once) lists and retrieves models, embeds (its default base64 and float, equal to each other and
to the unsharded model), completes, chats and streams with usage; every error class it has for
fedshard's statuses is raised with fedshard's message. The async client runs once. ``/metrics``
is scraped with prometheus_client's parser. Revocation runs last: it breaks MiniLM's chain.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from agent_helpers import AgentProc, minilm_model
from coordinator_helpers import (
    CoordinatorProc,
    pairing_code,
    start_coordinator,
    stop_process,
    unpaired_agents,
    unsharded_embeddings,
    wait_for,
)
from generation_lab import greedy_reference

openai = pytest.importorskip("openai")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

MINILM = "all-minilm-l6-v2"
LLAMA = "tiny-llama"
SENTENCES = ["Paris is the capital of France.", "How do I bake bread at home?"]
PROMPT = "The devices of a local network"
MINILM_CAP = "70MB"
"""Per-device planning cap: MiniLM's 90 MB of weights fit on neither device alone."""
HELLO = [{"role": "user", "content": "Say something."}]
SESSIONS = 4
"""Generation sessions a decoder deploy plans for by default."""


@dataclass
class Cluster:
    coordinator: CoordinatorProc
    agents: list[AgentProc]
    minilm: Path
    llama: Path

    def sdk(self, **options: Any) -> Any:
        """The SDK's client with its defaults, but no retries."""
        base = f"{self.coordinator.url}/v1"
        options = {"api_key": self.coordinator.token, **options}
        return openai.OpenAI(base_url=base, max_retries=0, timeout=120, **options)

    def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of the coordinator's ``/metrics``, by name and labels."""
        from prometheus_client.parser import text_string_to_metric_families

        with self.coordinator.client() as api:
            reply = api.get("/metrics")
        assert reply.status_code == 200, reply.text
        assert reply.headers["content-type"].startswith("text/plain")
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(reply.text)
            for s in family.samples
        }


def _deploy(coordinator: CoordinatorProc, *args: str) -> None:
    result = coordinator.cli("deploy", *args)
    assert result.returncode == 0, result.stdout + result.stderr + coordinator.log()


@pytest.fixture(scope="module")
def cluster(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    model = minilm_model(Path(request.config.cache.mkdir("fedshard-minilm")))
    tmp = tmp_path_factory.mktemp("openai-sdk")
    suffix = secrets.token_hex(3)
    coordinator = start_coordinator(tmp)
    try:
        names = [f"o{i}-{suffix}" for i in range(2)]
        with unpaired_agents(tmp, names, "512MiB") as agents:
            with coordinator.client() as api:
                assert wait_for(
                    lambda: set(names) <= {d["name"] for d in api.get("/v1/devices").json()}, 15
                )
            for agent in agents:
                paired = coordinator.cli("pair", agent.name, pairing_code(agent))
                assert paired.returncode == 0, paired.stdout + paired.stderr
            caps = [arg for name in names for arg in ("--memory-cap", f"{name}={MINILM_CAP}")]
            _deploy(coordinator, str(model), "--name", MINILM, *caps)
            llama = ["--name", LLAMA, "--tokenizer", str(tiny_llama_dir)]
            _deploy(coordinator, str(tiny_llama_dir / "model.onnx"), *llama)
            yield Cluster(coordinator, agents, model, tiny_llama_dir)
    finally:
        stop_process(coordinator.proc)


def test_models_list_and_retrieve(cluster: Cluster) -> None:
    client = cluster.sdk()
    listed = {m.id: m for m in client.models.list()}
    assert {MINILM, LLAMA} <= set(listed)
    one = client.models.retrieve(MINILM)
    assert (one.id, one.object, one.owned_by) == (MINILM, "model", "fedshard")
    assert one.created == listed[MINILM].created > 0
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.status_code == 404 and missing.value.code == "model_not_found"
    assert "no-such-model" in missing.value.message


def test_embeddings_default_and_float_agree_with_the_unsharded_model(cluster: Cluster) -> None:
    client = cluster.sdk()
    default = client.embeddings.create(model=MINILM, input=SENTENCES)  # asks for base64
    floats = client.embeddings.create(model=MINILM, input=SENTENCES, encoding_format="float")
    got = np.array([d.embedding for d in default.data])
    assert got.shape == (len(SENTENCES), 384)
    np.testing.assert_array_equal(got, np.array([d.embedding for d in floats.data]))
    want = unsharded_embeddings(cluster.minilm, SENTENCES)
    np.testing.assert_allclose(got, np.array([want[s] for s in SENTENCES]), atol=1e-5)
    assert default.usage.prompt_tokens == floats.usage.prompt_tokens > len(SENTENCES)
    assert [d.index for d in default.data] == [0, 1] and default.model == MINILM


def test_token_ids_dimensions_and_user(cluster: Cluster) -> None:
    from tokenizers import Tokenizer

    from partitioner.models.packaged import minilm_dir

    client = cluster.sdk()
    tokenizer = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    tokenizer.no_padding()  # the file pads to a fixed length
    ids = tokenizer.encode(SENTENCES[0]).ids
    text = client.embeddings.create(model=MINILM, input=SENTENCES[0], user="u1", dimensions=384)
    one = client.embeddings.create(model=MINILM, input=ids)
    many = client.embeddings.create(model=MINILM, input=[ids, ids[:4]])
    np.testing.assert_allclose(one.data[0].embedding, text.data[0].embedding, atol=1e-6)
    np.testing.assert_array_equal(many.data[0].embedding, one.data[0].embedding)
    assert one.usage.prompt_tokens == len(ids) and len(many.data) == 2
    with pytest.raises(openai.BadRequestError) as shortened:
        client.embeddings.create(model=MINILM, input="x", dimensions=128)
    assert shortened.value.param == "dimensions" and "Matryoshka" in shortened.value.message
    with pytest.raises(openai.BadRequestError) as bad_ids:
        client.embeddings.create(model=MINILM, input=[10**9])
    assert "token ids" in bad_ids.value.message


def test_completions_match_the_whole_model(cluster: Cluster) -> None:
    want, count = greedy_reference(cluster.llama, PROMPT, 16)
    done = cluster.sdk().completions.create(
        model=LLAMA, prompt=PROMPT, max_tokens=16, temperature=0
    )
    assert done.choices[0].text == want
    assert done.usage is not None and done.usage.completion_tokens == count


def test_chat_and_streamed_chat_with_usage_agree(cluster: Cluster) -> None:
    client = cluster.sdk()
    plain = client.chat.completions.create(
        model=LLAMA, messages=HELLO, max_tokens=12, temperature=0
    )
    text = plain.choices[0].message.content
    assert plain.choices[0].message.role == "assistant" and text
    stream = client.chat.completions.create(
        model=LLAMA,
        messages=HELLO,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage == plain.usage
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == plain.choices[0].finish_reason and set(finish[:-1]) == {None}


def test_bad_requests_and_auth_raise_the_sdks_classes(cluster: Cluster) -> None:
    client = cluster.sdk()
    with pytest.raises(openai.BadRequestError) as hot:
        client.chat.completions.create(model=LLAMA, messages=HELLO, temperature=5)
    assert hot.value.status_code == 400 and hot.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as odd:
        client.embeddings.create(model=MINILM, input=[])
    assert "empty" in odd.value.message
    with pytest.raises(openai.NotFoundError) as unknown:
        client.chat.completions.create(model="gpt-9", messages=HELLO)
    assert unknown.value.code == "model_not_found" and "gpt-9" in unknown.value.message
    with pytest.raises(openai.AuthenticationError) as anonymous:
        cluster.sdk(api_key="wrong-token").embeddings.create(model=MINILM, input="x")
    assert anonymous.value.status_code == 401 and "bearer token" in anonymous.value.message


def test_no_room_for_a_session_is_a_rate_limit_error_with_retry_after(cluster: Cluster) -> None:
    client = cluster.sdk()
    held = []
    try:
        for _ in range(SESSIONS):  # each returns once its prefill ran: the session is open
            held.append(
                client.completions.create(
                    model=LLAMA, prompt=PROMPT, max_tokens=480, temperature=0, stream=True
                )
            )
        with pytest.raises(openai.RateLimitError) as refused:
            client.completions.create(model=LLAMA, prompt=PROMPT, max_tokens=4)
    finally:
        for stream in held:
            stream.close()
    assert refused.value.status_code == 429 and "session" in refused.value.message
    assert int(refused.value.response.headers["retry-after"]) >= 1
    gauge = ("fedshard_coordinator_generation_sessions", (("model", LLAMA),))
    assert wait_for(lambda: cluster.scrape()[gauge] == 0, 30), cluster.scrape()[gauge]


def test_the_async_client(cluster: Cluster) -> None:
    async def run() -> tuple[Any, str]:
        async with openai.AsyncOpenAI(
            base_url=f"{cluster.coordinator.url}/v1",
            api_key=cluster.coordinator.token,
            max_retries=0,
        ) as client:
            embedded = await client.embeddings.create(model=MINILM, input=SENTENCES[1])
            stream = await client.chat.completions.create(
                model=LLAMA, messages=HELLO, max_tokens=6, temperature=0, stream=True
            )
            pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
            return embedded, "".join(pieces)

    embedded, text = asyncio.run(run())
    want = unsharded_embeddings(cluster.minilm, SENTENCES[1:])[SENTENCES[1]]
    np.testing.assert_allclose(embedded.data[0].embedding, want, atol=1e-5)
    plain = cluster.sdk().chat.completions.create(
        model=LLAMA, messages=HELLO, max_tokens=6, temperature=0
    )
    assert text == plain.choices[0].message.content


def test_metrics_count_real_requests(cluster: Cluster) -> None:
    with httpx.Client(base_url=cluster.coordinator.url, trust_env=False) as anonymous:
        assert anonymous.get("/metrics").status_code == 401
    before = cluster.scrape()
    client = cluster.sdk()
    client.embeddings.create(model=MINILM, input=SENTENCES)
    done = client.completions.create(model=LLAMA, prompt=PROMPT, max_tokens=5, temperature=0)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    after = cluster.scrape()

    def moved(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    requests = "fedshard_coordinator_requests_total"
    assert moved(requests, route="/v1/embeddings", method="POST", status="200") == 1
    assert moved(requests, route="/v1/completions", method="POST", status="200") == 1
    assert moved(requests, route="/v1/models/{model_id}", method="GET", status="404") == 1
    latency = "fedshard_coordinator_request_duration_seconds_count"
    assert moved(latency, route="/v1/embeddings", model=MINILM) == 1
    assert moved(latency, route="/v1/completions", model=LLAMA) == 1
    assert moved(latency, route="/v1/models/{model_id}", model="") == 1
    assert done.usage is not None
    tokens = "fedshard_coordinator_generated_tokens_total"
    assert moved(tokens, model=LLAMA) == done.usage.completion_tokens
    assert moved("fedshard_coordinator_input_tokens_total", model=MINILM) > len(SENTENCES)
    devices = after[("fedshard_coordinator_devices", (("online", "true"), ("status", "paired")))]
    assert devices == len(cluster.agents)
    assert after[("fedshard_coordinator_training_rounds_total", ())] == 0
    assert not any("no-such-model" in dict(labels).values() for _, labels in after)


def test_an_unservable_model_is_a_503_with_fedshards_message(cluster: Cluster) -> None:
    """Last: revoking a device MiniLM runs on leaves it unservable until redeployed."""
    revoked = cluster.coordinator.cli("revoke", cluster.agents[0].name)
    assert revoked.returncode == 0, revoked.stdout + revoked.stderr
    with pytest.raises(openai.InternalServerError) as refused:
        cluster.sdk().embeddings.create(model=MINILM, input="x")
    assert refused.value.status_code == 503 and "revoked" in refused.value.message
    assert isinstance(refused.value, openai.APIStatusError)
    assert refused.value.code == "model_not_servable"
