"""The coordinator's ``/metrics`` and the OpenAI embeddings helpers, in process (fakes only:
the bigram backend of the generation tests, a registry without agents)."""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from generation_helpers import BigramBackend, bigram_table, tiny_model
from prometheus_client.parser import text_string_to_metric_families

from coordinator.errors import DimensionsError, RequestError
from coordinator.fleet.registry import DeviceRegistry
from coordinator.generation.backend import GenerationModel
from coordinator.http.app import Services, create_app
from coordinator.http.errors import error_json, is_openai_path
from coordinator.http.metrics import CoordinatorMetrics, FleetSources
from coordinator.http.openai_serving import EmbeddingsBody, encode_vector
from coordinator.serving.embeddings import TextEncoder, check_dimensions, default_tokenizer_dir
from coordinator.trust.ca import CertificateAuthority
from coordinator.trust.pairing import Pairing

TOKEN = "metrics-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def _samples(text: str) -> Samples:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _client(tmp_path: Path, backend: BigramBackend) -> TestClient:
    models: dict[str, GenerationModel] = {"tiny": tiny_model(backend)}
    services = Services(
        token=TOKEN,
        registry=DeviceRegistry(),
        pairing=Pairing(tmp_path, CertificateAuthority.open(tmp_path)),
        generation=models.get,
    )
    return TestClient(create_app(services), raise_server_exceptions=False)


def test_metrics_need_the_token_and_count_generations(tmp_path: Path) -> None:
    client = _client(tmp_path, BigramBackend(bigram_table(seed=3)))
    assert client.get("/metrics").status_code == 401
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    for stream in (False, True):
        reply = client.post("/v1/chat/completions", json={**chat, "stream": stream}, headers=AUTH)
        assert reply.status_code == 200
    missing = client.post("/v1/chat/completions", json={**chat, "model": "zz"}, headers=AUTH)
    assert missing.status_code == 404
    scraped = client.get("/metrics", headers=AUTH)
    assert scraped.headers["content-type"].startswith("text/plain")
    got = _samples(scraped.text)
    route = "/v1/chat/completions"
    requests = "fedshard_coordinator_requests_total"
    ok = (("method", "POST"), ("route", route), ("status", "200"))
    assert got[(requests, ok)] == 2
    assert got[(requests, (("method", "POST"), ("route", route), ("status", "404")))] == 1
    latency = "fedshard_coordinator_request_duration_seconds_count"
    assert got[(latency, (("model", "tiny"), ("route", route)))] == 2
    assert got[(latency, (("model", ""), ("route", route)))] == 1  # "zz" never became a label
    assert got[("fedshard_coordinator_generated_tokens_total", (("model", "tiny"),))] == 6
    assert got[("fedshard_coordinator_generation_sessions", (("model", "tiny"),))] == 0
    assert got[("fedshard_coordinator_training_rounds_total", ())] == 0
    client.get("/v1/nowhere", headers=AUTH)
    again = _samples(client.get("/metrics", headers=AUTH).text)
    assert again[(requests, (("method", "GET"), ("route", "/metrics"), ("status", "200")))] == 1
    assert again[(requests, (("method", "GET"), ("route", "unmatched"), ("status", "404")))] == 1


def test_fleet_metrics_are_read_at_scrape_time() -> None:
    devices = [("paired", True), ("paired", True), ("unpaired", True), ("revoked", False)]
    events = {"lost": 1, "recovering": 1}
    rounds = [3]
    metrics = CoordinatorMetrics()
    metrics.watch(FleetSources(lambda: devices, lambda: events, lambda: rounds[0]))
    got = _samples(metrics.render().decode())
    gauge = "fedshard_coordinator_devices"
    assert got[(gauge, (("online", "true"), ("status", "paired")))] == 2
    assert got[(gauge, (("online", "false"), ("status", "revoked")))] == 1
    failovers = "fedshard_coordinator_failover_events_total"
    assert got[(failovers, (("kind", "recovering"),))] == 1
    events["recovering"] = 2
    rounds[0] = 5
    later = _samples(metrics.render().decode())
    assert later[(failovers, (("kind", "recovering"),))] == 2
    assert later[("fedshard_coordinator_training_rounds_total", ())] == 5


def test_error_bodies_made_before_routing_follow_the_family() -> None:
    assert is_openai_path("/v1/embeddings") and is_openai_path("/v1/models/x")
    assert not is_openai_path("/v1/infer") and not is_openai_path("/v1/modelsx")
    body = error_json("/v1/chat/completions", 401, "no token")
    assert body == {
        "error": {"message": "no token", "type": "invalid_request_error", "param": None,
                  "code": "invalid_api_key"}
    }  # fmt: skip
    assert error_json("/v1/devices", 413, "too big") == {"detail": "too big"}


def test_embedding_bodies_and_encodings() -> None:
    vector = np.array([0.25, -1.5, 3.0e-8], dtype=np.float32)
    packed = encode_vector(vector, "base64")
    assert isinstance(packed, str)
    decoded = np.frombuffer(base64.b64decode(packed), dtype="<f4")
    np.testing.assert_array_equal(decoded, vector)
    assert encode_vector(vector, None) == encode_vector(vector, "float") == vector.tolist()
    assert EmbeddingsBody(model="m", input="a").inputs() == ["a"]
    assert EmbeddingsBody(model="m", input=["a", "b"]).inputs() == ["a", "b"]
    assert EmbeddingsBody(model="m", input=[5, 6]).inputs() == [[5, 6]]
    assert EmbeddingsBody(model="m", input=[[5], [6, 7]]).inputs() == [[5], [6, 7]]
    with pytest.raises(ValueError):
        EmbeddingsBody.model_validate({"model": "m", "input": ["a", 1]})
    check_dimensions("m", 384, None)
    check_dimensions("m", 384, 384)
    with pytest.raises(DimensionsError, match="Matryoshka"):
        check_dimensions("m", 384, 128)


def test_token_ids_embed_like_their_text() -> None:
    directory = default_tokenizer_dir("all-minilm-l6-v2")
    if directory is None:
        pytest.skip("the MiniLM package is not installed")
    from tokenizers import Tokenizer

    encoder = TextEncoder(Path(directory))
    texts = ["one short sentence", "and a somewhat longer second sentence here"]
    by_text, count = encoder.encode(texts)
    tokenizer = Tokenizer.from_file(str(Path(directory) / "tokenizer.json"))
    tokenizer.no_padding()  # the file pads to a fixed length
    ids = [tokenizer.encode(t).ids for t in texts]
    by_ids, id_count = encoder.encode_inputs(ids)
    assert count == id_count
    for name in ("input_ids", "attention_mask", "token_type_ids"):
        np.testing.assert_array_equal(by_ids[name], by_text[name])
    with pytest.raises(RequestError, match="token ids"):
        encoder.encode_inputs([[1, 10**7]])
    with pytest.raises(RequestError, match="at most"):
        encoder.encode_inputs([[101] * 10_000])
    with pytest.raises(RequestError, match="mixes"):
        encoder.encode_inputs(["a", [1]])
